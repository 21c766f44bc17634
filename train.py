"""GRPO-PODS training: generate n rollouts per prompt, keep m of them, update LoRA on those m.

Algorithm 1 of the paper, one iteration per step (`train_loop`, numbered as here):
    1. draw prompts                                  (data.py)
    2. sample n rollouts per prompt                  (sampling.py: transformers; vllm_sampler.py: vLLM)
    3. score them with the rule-based reward        (rewards.py)
    4. keep m per prompt with a down-sampling rule   (pods.py, Definition 3.1 / Lemma 3.1)
    5. advantages from the kept rewards only         (grpo.py: group_advantages)
    6. one clipped policy-gradient step on the kept rollouts, in micro-batches (update.py, grpo.py: grpo_loss)
    7. hand the new LoRA adapter to the sampler
Around it: the flags and their profiles (config.py), the model and LoRA (model.py), checkpoints (checkpoint.py), the
run's directory and --resume (run_dir.py), metrics, progress bar and Ctrl-C (progress.py), torchrun (distributed.py).

Usage:
    python train.py --n 32 --m 16                              # GPU: Qwen2.5-3B-Instruct, GSM8K, vLLM;
                                                               # CPU: embedded SmolLM2-135M, arithmetic
    python train.py --rule none --n 16 --dataset arith         # vanilla GRPO on all n rollouts
    python train.py --resume --out-dir runs/pods               # continue from the last checkpoint
    python train.py --resume auto --out-dir runs/pods          # continue if there is one, else start (torchrun --max-restarts)
    torchrun --standalone --nproc_per_node 8 train.py -- --n 128 --m 32 --prompts-per-step 8
                                                               # 8 GPUs, data-parallel (distributed.py)

Fields left at None in `Args` take the GPU profile (the authors' released configuration) on a
GPU and the CPU profile (sized for the embedded model) otherwise; config.json records the values used.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.contrib.logging import logging_redirect_tqdm

import checkpoint
import config
import data
import distributed
import grpo
import pods
import progress
import run_dir
import sampling
import vllm_sampler
from model import GPU_MODEL, SetupError, load_trainable_policy, pick_model
from update import UpdateSettings, policy_update

log = logging.getLogger("pods")


def arg(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    """Every flag of train.py (--lr for lr, --no-share-prompt for share_prompt=False). None takes the device's
    profile (config.PROFILES: [GPU x, CPU y] below); docs/defaults.md says why each default is what it is."""

    model: str = arg("auto", f"hub name or local dir; 'embedded' = SmolLM2-135M-Instruct; 'auto' = {GPU_MODEL} on a GPU, else embedded")
    dataset: str = arg("auto", "'gsm8k' (hub), 'arith[:LEVELS]' (built-in task), a GSM8K-style .jsonl, or 'auto' = gsm8k on a GPU, else arith")
    n: int = arg(32, "rollouts generated per prompt")
    m: int = arg(16, "rollouts kept per prompt for the update (PODS); --rule none keeps all n (m is set to n, as config.json records)")
    rule: str = arg("max_variance", "down-sampling rule: max_variance | max_reward | random | none (vanilla GRPO on all n)")
    uniform_groups: str = arg("keep", "groups whose kept rewards are all equal: keep (the paper) | skip (left out of the update) | refill (DAPO's dynamic sampling: draw more prompts until the step has --prompts-per-step informative groups)")
    max_refill_rounds: int = arg(4, "--uniform-groups refill: at most this many generation rounds a step, the first included")
    prompts_per_step: int | None = arg(None, "prompts per step, over all processes under torchrun [GPU 1, CPU 4]")
    max_prompt_tokens: int = arg(512, "prompts longer than this are skipped")
    max_new_tokens: int | None = arg(None, "completion length limit [GPU 512, CPU 32]")
    temperature: float = arg(0.9, "sampling temperature; also divides the logits in the update")
    lr: float | None = arg(None, "AdamW learning rate [GPU 5e-6, CPU 3e-4]")
    adam_beta1: float = arg(0.9, "AdamW beta1")
    adam_beta2: float = arg(0.99, "AdamW beta2")
    weight_decay: float = arg(0.1, "AdamW weight decay")
    max_grad_norm: float = arg(0.1, "gradient clipping norm")
    max_skipped_steps: int = arg(3, "stop, saving the last good weights, after this many updates in a row with a non-finite loss or gradient")
    warmup_ratio: float = arg(0.01, "linear warm-up over this share of the run's first --steps (in updates made), then constant")
    lora_rank: int | None = arg(None, "LoRA rank on all attention and MLP projections [GPU 64, CPU 16]")
    lora_alpha: int | None = arg(None, "LoRA alpha [GPU 64, CPU 32]")
    micro_batch: int | None = arg(None, "rollouts per forward/backward pass; gradients accumulate over the kept rollouts [GPU 4, CPU 8]")
    clip_eps: float = arg(0.2, "PPO clip range epsilon (no effect: one update per batch of rollouts, so the ratio is 1)")
    clip_eps_high: float | None = arg(None, "upper clip range (default: --clip-eps; no effect, as --clip-eps)")
    beta: float = arg(0.0, "KL penalty weight against the base model (the LoRA adapter switched off); 0 = no KL term")
    tis_cap: float = arg(0.0, "weight each token by min(pi_trainer / pi_sampler, this cap), truncated importance sampling; 0 = off")
    steps: int | None = arg(None, "training steps [GPU 1000, CPU 100; --resume: the run's]")
    time_budget: float | None = arg(None, "stop after this many minutes of training, 0 = no limit (--steps still applies) [0; --resume: the run's]")
    save_every_steps: int = arg(25, "save a checkpoint every this many steps (0 = off)")
    save_every_minutes: float = arg(10.0, "save a checkpoint every this many minutes of training (0 = off)")
    out_dir: str = arg("runs/pods", "directory for config.json, metrics.jsonl and checkpoint-STEP/")
    seed: int = arg(0, "random seed")
    backend: str = arg("auto", "generation backend: vllm | hf | auto (vllm when it imports and a GPU is present)")
    resume: str = arg("no", "continue from the last checkpoint in --out-dir: yes (bare --resume; there must be one) | auto (if any) | no")
    gpu_memory_utilization: float = arg(0.3, "vLLM: share of GPU memory for its weights, LoRA slots and KV cache; the rest is for training")
    vllm_kv_cache_gb: float | None = arg(None, "vLLM: KV cache size in GiB (a CPU rounds it up to whole GiB), instead of what --gpu-memory-utilization leaves")
    vllm_enforce_eager: bool = arg(False, "vLLM: no CUDA graphs (slower generation, less memory: small cards)")
    vllm_sleep: bool = arg(False, "vLLM: free its KV cache during each update, re-allocate it before the next generation "
                                  "(vLLM 0.25: its weights too, to host memory and back)")
    gradient_checkpointing: bool | None = arg(None, "recompute activations in the backward pass [GPU on, CPU off]")
    bf16_weights: bool | None = arg(None, "frozen base weights in bfloat16, the LoRA adapter in float32 [GPU on, CPU off]")
    bf16_autocast: bool | None = arg(None, "bfloat16 autocast for generation and the update [GPU off, CPU on where it computes bfloat16]")
    gen_batch: int = arg(64, "hf backend: sequences per generate call (rounded down to whole groups of n, one group at least)")
    share_prompt: bool | None = arg(None, "compute each prompt once per group, in hf generation and in the update (exact) [GPU off, CPU on]")
    merged_sampler: bool | None = arg(None, "hf backend: generate with a copy of the policy, its LoRA merged in after every update [on]")
    cuda_graph: bool = arg(True, "hf backend on a GPU: replay each decode step as one CUDA graph (--no-cuda-graph: launch its kernels one by one)")


# ----------------------------------------------------------------------------- Algorithm 1


def train_loop(args, model, tokenizer, optimizer, scheduler, sampler, stream, state, rng, out_dir, metrics_path,
               world: distributed.World = distributed.World(), resumed: bool = False):
    """Algorithm 1, one step per iteration: 1. draw prompts, 2-3. sample n rollouts per prompt and score them,
    4. keep m of each prompt's n (pods.py), 5. advantages from the kept rewards (grpo.py) (1-5: sample_step, in
    rounds under --uniform-groups refill), 6. one update on the informative groups (update.py), 7. hand the new
    adapter to the sampler; then a metrics row and, when due, a checkpoint. Until --steps, the time budget, a Ctrl-C
    or --max-skipped-steps non-finite updates in a row, then a final checkpoint. Under torchrun each rank runs this
    loop on its share of the prompts; `distributed.any_rank` and `reduce_row` keep the ranks agreeing on when to
    stop and on what to report, and only rank 0 writes."""
    stop = {"requested": False}
    previous_handlers = progress.set_handlers({sig: progress.ctrl_c_handler(stop) for sig in progress.stop_signals()})
    last_save_s = state["elapsed_s"]
    last_saved_step = state["step"] if resumed else -1  # a fresh run stopped before its first step still saves checkpoint-0
    bar = progress.progress_bar(args, state, world)
    if state.setdefault("skipped_in_a_row", 0) >= args.max_skipped_steps:  # the run stopped for them; resumed, perhaps with a lower --lr
        state["skipped_in_a_row"] = 0
    try:
        with open(metrics_path if world.is_main else os.devnull, "a") as metrics_file:
            while (state["step"] < args.steps and state["skipped_in_a_row"] < args.max_skipped_steps
                   and not distributed.any_rank(stop["requested"], world)):
                if progress.budget_spent(args, state):
                    log.info("time budget of %g min reached", args.time_budget)
                    break
                start, at_start = time.perf_counter(), checkpoint.random_state(rng)
                step = sample_step(args, sampler, stream, rng, stop, world)  # 1-5, with refill when asked (--uniform-groups)
                if step is None:  # the checkpoint continues as if this step had not begun: --resume draws it again, alike
                    checkpoint.set_random_state(at_start, rng)
                    log.info("generation stopped by Ctrl-C; saving the last finished step %d", state["step"])
                    break
                generation_s = time.perf_counter() - start

                update_start = time.perf_counter()
                if step.global_rows:  # 6. the update on the informative groups (--uniform-groups keep: on all kept)
                    sampler.release_memory()  # --vllm-sleep: vLLM's KV cache is freed for the update
                    update = policy_update(model, optimizer, scheduler, step.kept, step.advantages, update_settings(args),
                                           tokenizer.pad_token_id, rows_in_mean=step.rows_in_mean)
                    state["skipped_in_a_row"] = progress.count_skipped(update, state["skipped_in_a_row"], state["step"] + 1)
                    sampler.update_weights(distributed.unwrap(model))  # 7. vLLM: the new adapter; transformers: the merged copy
                    sampler.wake_up()
                else:  # no rank has a group to learn from: no backward, no optimizer or scheduler step, no non-finite update
                    update = {"grad_norm": 0.0, "lr": optimizer.param_groups[0]["lr"], "skipped": 0}
                update_s = time.perf_counter() - update_start

                seconds = {"generation_s": generation_s, "update_s": update_s, "step_s": time.perf_counter() - start}
                metrics = distributed.reduce_row(seconds | step.metrics | update, world, maxima=(*seconds, "sampler_gap_max"))  # all ranks
                state["step"] += 1
                state["elapsed_s"] += metrics.pop("step_s")  # the slowest rank's, so that all ranks agree on the time budget
                state["data_position"] = stream.position
                row = {"step": state["step"], "elapsed_s": round(state["elapsed_s"], 3),
                       **{k: round(v, 3) if k in seconds else v for k, v in metrics.items()}, "n": args.n, "m": args.m}
                progress.write_row(metrics_file, row)

                due_steps = args.save_every_steps and state["step"] % args.save_every_steps == 0
                due_time = args.save_every_minutes and state["elapsed_s"] - last_save_s >= args.save_every_minutes * 60
                if due_steps or due_time:
                    checkpoint.save(out_dir, model, optimizer, scheduler, state, rng, world)
                    last_save_s, last_saved_step = state["elapsed_s"], state["step"]
                progress.show_progress(bar, args, state, row)  # last: nothing cosmetic runs before the checkpoint
        if state["step"] > last_saved_step:  # decided from the state alone, so every rank agrees
            path = checkpoint.save(out_dir, model, optimizer, scheduler, state, rng, world)
            log.info("saved %s", path)
        if state["skipped_in_a_row"] >= args.max_skipped_steps:
            raise TrainingError(f"{state['skipped_in_a_row']} updates in a row had a non-finite loss or gradient norm and were skipped; "
                                f"the last good weights are in {out_dir} (checkpoint-{state['step']}): lower --lr or "
                                f"--max-grad-norm, or pass --no-bf16-autocast, then --resume{' with more --steps' * (state['step'] >= args.steps)}")
    finally:
        progress.restore_handlers(previous_handlers)  # only now: a Ctrl-C during the last save is still a first one
        progress.close_bar(bar)
    if distributed.any_rank(stop["requested"], world) and state["step"] < args.steps and not progress.budget_spent(args, state):
        raise KeyboardInterrupt  # on every rank, where a signal reached one (rank 0 says so); a Ctrl-C in the last step: done


# ----------------------------------------------------------------------------- one step


@dataclass
class Round:
    """One generation round on this rank: its scored rollouts (steps 2-3), the indices of the m kept of each prompt's n
    (step 4), and whether each group's kept rewards differ (pods.informative_groups: a uniform group has advantages 0)."""
    scored: sampling.Scored
    kept: list[int]
    informative: np.ndarray


@dataclass
class Step:
    """Steps 1-5 on this rank: the update's rows, their advantages, policy_update's rows_in_mean, all ranks' rows, metrics."""
    kept: list[sampling.Rollout]
    advantages: torch.Tensor
    rows_in_mean: float
    global_rows: int
    metrics: dict


def sample_step(args: Args, sampler, stream: data.PromptStream, rng: np.random.Generator, stop: dict, world: distributed.World) -> Step | None:
    """Steps 1-5 of Algorithm 1 on this rank; None when a Ctrl-C stopped generation, or came while refill needed a round.
    --uniform-groups skip and refill continue in informative_step. Metrics under keep's names: the first round's, in any mode."""
    first = draw_round(args, sampler, stream, rng, stop, world)  # 1-4. prompts, n rollouts each, scored, m kept of each n
    if first is None:
        return None
    metrics = progress.step_metrics([first], args.n, args.m) | {"uniform_share": float(np.mean(~first.informative))}
    if args.uniform_groups != "keep":
        return informative_step(args, sampler, stream, rng, stop, world, first, metrics)
    advantages = grpo.group_advantages(first.scored.rewards[first.kept].view(-1, args.m)).flatten()  # 5. from the kept rewards
    metrics |= {"generation_rounds": 1, "prompts_drawn": args.prompts_per_step,
                "informative_rows": args.m * sum(distributed.gather(int(first.informative.sum()), world))}  # over all ranks
    kept = [first.scored.rollouts[i] for i in first.kept]
    return Step(kept, advantages, rows_in_mean=len(kept), global_rows=len(kept) * world.size, metrics=metrics)


def draw_round(args: Args, sampler, stream: data.PromptStream, rng: np.random.Generator, stop: dict, world: distributed.World) -> Round | None:
    """Steps 1-4 on this rank's share of a batch of prompts; None on every rank when a Ctrl-C stopped generation on any."""
    batch = distributed.shard(stream.next_batch(args.prompts_per_step), world)  # 1. prompts (this rank's share)
    scored = sampling.generate_unless_stopped(sampler, batch, args.n, stop)  # 2-3. n rollouts per prompt, scored
    if distributed.any_rank(scored is None, world):
        return None
    kept = select(scored.rewards, args.rule, args.n, args.m, rng)  # 4. keep m of each prompt's n
    return Round(scored, kept, pods.informative_groups(scored.rewards[kept].view(-1, args.m)))


def informative_step(args: Args, sampler, stream: data.PromptStream, rng: np.random.Generator, stop: dict,
                     world: distributed.World, first: Round, metrics: dict) -> Step | None:
    """Steps 1-5 on informative groups only (--uniform-groups skip or refill). Skip leaves uniform groups out; refill
    also draws further rounds, a full batch each, until the informative groups over all ranks reach --prompts-per-step
    or --max-refill-rounds rounds have run (DAPO's dynamic sampling). The step takes the first informative groups in
    draw order (round, rank, position): torchrun's ranks train on the groups one process with every prompt trains on.
    So ranks may hold different numbers of rows: each weighs its rows by all rows / ranks (policy_update's rows_in_mean),
    and a rank with none runs one row at weight 0, as DDP's all-reduce needs its backward. Refill logs all rounds'
    figures as all_rounds_* (whether it draws again depends on the first round: pooled, they are biased)."""
    rounds = [first]
    informative = [np.concatenate(distributed.gather(first.informative, world))]  # per round, every rank's in rank order
    while (args.uniform_groups == "refill" and sum(map(np.sum, informative)) < args.prompts_per_step
           and len(rounds) < args.max_refill_rounds):  # a Ctrl-C leaves the step to --resume, not cut short to fewer groups
        another = None if distributed.any_rank(stop["requested"], world) else draw_round(args, sampler, stream, rng, stop, world)
        if another is None:
            return None
        rounds.append(another)
        informative.append(np.concatenate(distributed.gather(another.informative, world)))
    chosen = pods.dynamic_sampling(np.concatenate(informative), args.prompts_per_step)  # group g of all drawn: round, rank, position
    share, per_round = args.prompts_per_step // world.size, args.prompts_per_step
    mine = [(rounds[g // per_round], g % per_round % share) for g in chosen if g % per_round // share == world.rank]
    rows = [(drawn, drawn.kept[group * args.m + j]) for drawn, group in mine for j in range(args.m)]
    global_rows = len(chosen) * args.m
    if rows:
        kept = [drawn.scored.rollouts[i] for drawn, i in rows]
        kept_rewards = torch.stack([drawn.scored.rewards[i] for drawn, i in rows]).view(-1, args.m)
        advantages, rows_in_mean = grpo.group_advantages(kept_rewards).flatten(), global_rows / world.size  # 5. from the kept rewards
    else:  # none here but some elsewhere (none anywhere: no update is made)
        kept, advantages, rows_in_mean = [first.scored.rollouts[first.kept[0]]], torch.zeros(1), math.inf
    if args.uniform_groups == "refill":
        metrics |= {f"all_rounds_{k}": v for k, v in progress.step_metrics(rounds, args.n, args.m).items()}
    metrics |= {"generation_rounds": len(rounds), "prompts_drawn": len(rounds) * per_round, "informative_rows": global_rows}
    return Step(kept, advantages, rows_in_mean, global_rows, metrics)


def select(scores: torch.Tensor, rule: str, n: int, m: int, rng: np.random.Generator) -> list[int]:
    """Indices of the kept rollouts, group by group (pods.downsample, Definition 3.1): all n for vanilla GRPO (rule "none")."""
    if rule == "none":
        return list(range(len(scores)))
    return pods.downsample(scores, m, rule, group_size=n, rng=rng)


def update_settings(args: Args) -> UpdateSettings:
    """The update's hyperparameters, taken from the flags of the same names."""
    return UpdateSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(UpdateSettings)})


# ----------------------------------------------------------------------------- setting up a run


def train(args: Args, world: distributed.World = distributed.World()) -> Path:
    """A training run in this process; under torchrun, this rank's part of it (`world`)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out_dir = Path(args.out_dir)
    found = run_dir.found_in(out_dir)
    resuming = run_dir.continues(args.resume, out_dir, found)
    args = config.resolve(run_dir.run_length(args, out_dir, found[-1]) if resuming else args, device, world.size)
    model_name = pick_model(args.model, device)  # here, before --out-dir is made (and --out-dir before the model loads)
    if resuming:
        changes = run_dir.check_resume_config(out_dir, args, world.size, found[-1], model_name)  # warnings, if it trains on
    config.check_torchrun(device, world)
    examples = data.load_examples(args.dataset, "train", seed=args.seed)  # a missing dataset stops the run
    run_dir.make_out_dir(out_dir)
    with run_dir.held(out_dir, world.is_main, found):  # a second train.py on --out-dir stops here, before it writes
        distributed.start(world)  # torchrun: meet the other ranks (every rank has passed the checks above)
        distributed.barrier(world)  # ... before rank 0 writes anything into out_dir
        torch.manual_seed(args.seed)  # the LoRA initialisation, the same on every rank
        model, tokenizer = load_trainable_policy(model_name, device, args.lora_rank, args.lora_alpha, args.bf16_weights,
                                                 args.gradient_checkpointing, args.bf16_autocast, args.max_prompt_tokens + args.max_new_tokens)
        sampler = make_sampler(args, model, tokenizer, device, world)
        try:
            log.info("%s", progress.start_line(args, model_name, sampler, out_dir, device, world))
            torch.manual_seed(args.seed + world.rank)  # again (an in-process vLLM engine seeds this process's generators
            rng = np.random.default_rng(args.seed + world.rank)  # when it starts); each rank samples its own rollouts
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                          betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
            state = {"step": 0, "elapsed_s": 0.0, "data_position": 0, "first_steps": args.steps}  # resumed: the checkpoint's
            warmup = lambda: max(1, math.ceil(args.warmup_ratio * state.get("first_steps", args.steps)))  # the run's first --steps':
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup()))  # more keep its length

            metrics_path = out_dir / "metrics.jsonl"
            if resuming:
                resume_from = distributed.from_main(found[-1], world)  # every rank loads the one rank 0 found
                state = checkpoint.load(resume_from, model, optimizer, scheduler, rng, world)
                run_dir.take_optimizer_settings(optimizer, scheduler, args)
                log.info("resumed from %s: step %d, %.0f s of training", resume_from, state["step"], state["elapsed_s"])
                progress.say_resumed(args, state, out_dir, changes)
                sampler.update_weights(model)
            if world.is_main:  # the rows of steps that run again go (all of them where a run died before its first checkpoint)
                run_dir.drop_rows_after(metrics_path, state["step"])
            if world.is_main and not progress.nothing_left(args, state):  # a run already there keeps its config.json (its own settings)
                run_config = dataclasses.asdict(args) | {"dataset": data.recorded(args.dataset), "model_resolved": model_name,
                                                         "device": device, "torch": torch.__version__, "world_size": world.size}
                run_dir.write_config(out_dir, run_config, state["step"] if resuming else None)
            stream = data.PromptStream(examples, lambda question: sampling.build_prompt(tokenizer, question), args.max_prompt_tokens,
                                       args.seed, state["data_position"])
            model = distributed.wrap(model, world)  # torchrun: DDP; the sampler keeps the PEFT model it was given
            with logging_redirect_tqdm():  # log lines print above the progress bar, not on its line
                train_loop(args, model, tokenizer, optimizer, scheduler, sampler, stream, state, rng, out_dir, metrics_path, world,
                           resumed=resuming)
            return out_dir
        finally:
            try:  # before distributed.finish: vLLM's engine shutdown destroys the default process group
                sampler.close()
            except Exception as err:  # (it would replace the error on its way out, or end a finished run in a traceback)
                log.warning("could not shut the sampler down (%r); the run's files are written", err)


def make_sampler(args: Args, model, tokenizer, device: str, world: distributed.World = distributed.World()):
    """The generation backend. Under torchrun every rank gets its own vLLM engine on its own GPU,
    started the way TRL's colocate mode does (external_launcher), with its own seed. vLLM reads the weights
    transformers read (config.name_or_path: model.local_model_path's answer, the hub asked once)."""
    if vllm_sampler.uses_vllm(args.backend, device):
        return vllm_sampler.VLLMSampler(
            model.config.name_or_path, tokenizer, args.max_new_tokens, args.temperature, args.lora_rank,
            max_model_len=args.max_prompt_tokens + args.max_new_tokens, max_num_seqs=args.prompts_per_step // world.size * args.n,
            gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gb=args.vllm_kv_cache_gb,
            enforce_eager=args.vllm_enforce_eager, sleep_during_update=args.vllm_sleep, dtype="bfloat16",
            seed=args.seed + world.rank, external_launcher=world.launched,
            adapter_bytes=2 * sum(p.numel() for p in model.parameters() if p.requires_grad),  # handed over in bfloat16
            adapter_fallback_dir=args.out_dir, logprobs=True,  # the sampler/trainer gap (policy_update)
        )
    return sampling.HFSampler(model, tokenizer, args.max_new_tokens, args.temperature, args.gen_batch,
                              autocast_bf16=args.bf16_autocast, share_prompt=args.share_prompt, merged=args.merged_sampler,
                              merged_dtype=config.merged_dtype(args), cuda_graph=args.cuda_graph)


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. non-finite updates in a row); the last good state is saved."""


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "transformers", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = config.parse_args(Args, argv, __doc__.split("\n")[0])
    world = distributed.World()  # one process, until torchrun's environment is read
    try:
        world = distributed.world_from_env()
        if not world.is_main:  # torchrun: rank 0 speaks for all (the others' warnings stay: a GPU of theirs may differ)
            log.setLevel(logging.WARNING)
        out_dir = train(args, world)
        saved = checkpoint.find(out_dir)
        log.info("done: metrics in %s, checkpoints %s%s", out_dir / "metrics.jsonl", ", ".join(p.name for p in saved[-3:]),
                 f" ({len(saved)} in all)" if len(saved) > 3 else "")
    except (config.UsageError, data.DataError, SetupError, distributed.LaunchError) as err:
        progress.say_at_exit(f"error: {err}", world)
        return 2
    except (TrainingError, checkpoint.CheckpointError) as err:
        progress.say_at_exit(f"error: {err}", world)
        return 1
    except torch.OutOfMemoryError:
        progress.say_at_exit(progress.out_of_memory_line(Path(args.out_dir)), world, this_rank_only=True)
        return 1
    except KeyboardInterrupt:
        progress.say_at_exit(progress.interrupted_line(Path(args.out_dir)) if world.is_main else "", world)
        return 130
    finally:
        distributed.finish(world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
