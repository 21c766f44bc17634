"""Rollouts with transformers: sample n completions per prompt, on any device.

The generation phase of GRPO / PODS (Algorithm 1 of the paper, "sample n rollouts per prompt").
Generation is the cheap, parallel phase; PODS then keeps only m of the n rollouts for the
expensive update (pods.py).

`HFSampler` runs a short decode loop of its own (prefill each prompt, once for its n rows with share_prompt,
decode one token per row per step: decode.py makes that step fast). train.py and eval.py sample from a copy of the policy
with the LoRA merged in (`merged=True`: bfloat16, or float32 on a CPU without bfloat16 arithmetic), refreshed after every
update; without it, from the PEFT model itself. It works anywhere,
including a CPU with no GPU. vllm_sampler.VLLMSampler is the GPU backend with the same interface,
`sampler.generate(prompts, n) -> list[list[Rollout]]`. `generate_and_score` runs either on a batch and scores
every rollout with the reward (rewards.py): Algorithm 1's steps 2-3.

Run `python sampling.py` to sample a few answers from the embedded model.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

import rewards
from decode import CudaGraphDecode, EagerDecode, kv_cache_name, release_cache, reserve_cache, windowed_attention

log = logging.getLogger("pods")


@dataclass
class Rollout:
    """One sampled completion. `completion_ids` ends at the first EOS (kept, so the policy
    learns to stop); nothing after it is stored, so nothing after it is ever trained on."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    truncated: bool  # hit max_new_tokens without EOS
    logprobs: list[float] | None = None  # sampler's log-probs of completion_ids, when asked for


@dataclass
class Scored:
    """A batch's rollouts, n per prompt, group after group, and per rollout its reward, correctness and format."""

    rollouts: list[Rollout]
    rewards: torch.Tensor
    correct: torch.Tensor
    formatted: torch.Tensor


def generate_and_score(sampler, batch: list[tuple[list[int], str]], n: int) -> Scored:
    """Algorithm 1's steps 2-3 for a batch of (prompt ids, reference answer): n rollouts per prompt from any sampler
    (HFSampler below, vllm_sampler.VLLMSampler), each scored by the rule-based reward (rewards.py)."""
    groups = sampler.generate([prompt for prompt, _ in batch], n)
    rollouts = [r for group in groups for r in group]
    answers = [answer for _, answer in batch for _ in range(n)]
    return Scored(rollouts, torch.tensor([rewards.reward(r.text, a) for r, a in zip(rollouts, answers)]),
                  torch.tensor([rewards.correctness_reward(r.text, a) for r, a in zip(rollouts, answers)]),
                  torch.tensor([float(rewards.is_well_formatted(r.text)) for r in rollouts]))


def generate_unless_stopped(sampler, batch: list[tuple[list[int], str]], n: int, stop: dict) -> Scored | None:
    """generate_and_score, or None when a Ctrl-C (`stop["requested"]`) stopped the generation itself (vLLM's engine
    may get the signal too and abort its requests): the policy is then still that of the last finished step, which
    is what gets saved. The error the generation ended in is logged, in case it was not the Ctrl-C's."""
    try:
        return generate_and_score(sampler, batch, n)
    except Exception as err:
        if not stop["requested"]:
            raise
        log.info("the generation stopped with the Ctrl-C (%r)", err)
        return None


def build_prompt(tokenizer, question: str) -> list[int]:
    """Token ids of the chat prompt (rewards.chat_messages: the system prompt asking for the format the reward checks)."""
    ids = tokenizer.apply_chat_template(rewards.chat_messages(question), add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def stop_token_ids(tokenizer, generation_config=None) -> set[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return {i for i in ids if i is not None}


def cut_at_stop(token_ids: list[int], stops: set[int]) -> tuple[list[int], bool]:
    """Tokens up to and including the first stop token, and whether none was found (truncated)."""
    for i, t in enumerate(token_ids):
        if t in stops:
            return token_ids[: i + 1], False
    return token_ids, True


class HFSampler:
    """Sampling with transformers on the policy being trained, in a loop of a few lines: prefill
    each prompt (with `share_prompt` once, its KV cache copied to its n rows; else once per row), then decode
    one token per row per step until every row has stopped.

    Six measured speed mechanisms (docs/speed.md has the figures), the first four below, the others in decode.py:
    - `merged_copy` (with `merged=True`): decode with a copy of the policy whose LoRA is merged
      into its weights, in `merged_dtype`, refreshed by `update_weights` after every update (how
      vLLM serves a LoRA on a GPU). Without it every forward runs peft's ~210 extra adapter
      matmuls.
    - `sample_tokens`: inverse-transform sampling, one random number per row instead of one per
      vocabulary entry.
    - `last_positions`: the prefill's LM head on the last position only, asked for by index.
    - `prefill` (with `share_prompt`): the prefix every prompt of a batch begins with (the system prompt) computed once.
    - `decode.reserve_cache`: the KV cache written in place, not grown by concatenation at every token.
    - `decode.CudaGraphDecode` (on a GPU, with `cuda_graph=True`): each decode step replayed as one CUDA graph
      instead of ~15 kernel launches per layer from Python.
    A bfloat16 copy's rounding makes the sampled distribution differ slightly from the one the update
    scores (a float32 copy's by float32 rounding only); the log-probabilities each rollout carries
    let update.policy_update measure that gap every step (`sampler_gap_mean`, `sampler_gap_max`). `merged=False`
    samples from the trained model itself.

    Each call generates whole groups: `batch_size` sequences, rounded down to a multiple of n (one group
    at least). With `share_prompt=False` every row prefills its own copy of the prompt (slower, the
    same tokens)."""

    def __init__(self, model, tokenizer, max_new_tokens: int, temperature: float, batch_size: int = 64,
                 autocast_bf16: bool = False, share_prompt: bool = True, merged: bool = False,
                 merged_dtype: torch.dtype = torch.bfloat16, cuda_graph: bool = True):
        self.tokenizer, self.max_new_tokens, self.temperature = tokenizer, max_new_tokens, temperature
        self.batch_size, self.share_prompt, self.cuda_graph = batch_size, share_prompt, cuda_graph
        self.model = merged_copy(model, merged_dtype) if merged else model
        self.merged, self.merged_dtype = merged, merged_dtype
        self.autocast_bf16 = autocast_bf16 and not merged  # the copy computes in its own dtype
        self.stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None))

    def set_adapter(self, path: str | None) -> None:
        """Nothing to do: the caller loads the adapter into the model and calls update_weights."""

    def update_weights(self, model) -> None:
        """The merged copy takes the new adapter (without a copy the model itself is sampled)."""
        if self.merged:
            refresh_merged_copy(self.model, model)

    def release_memory(self) -> None:
        """Nothing to free: there is no separate engine."""

    def wake_up(self) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        """Nothing to shut down."""

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int) -> list[list[Rollout]]:
        per_call = max(1, self.batch_size // n)  # prompts per batch, each with its n rollouts
        rollouts: list[Rollout] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(prompts), per_call):
                rollouts.extend(self._generate_batch(prompts[start : start + per_call], n))
        finally:  # (a Ctrl-C or an out-of-memory error leaves the policy as it was)
            self.model.train(was_training)
        return [rollouts[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], n: int) -> list[Rollout]:
        device, pad = next(self.model.parameters()).device, self.tokenizer.pad_token_id
        copies = 1 if self.share_prompt else n  # prompt copies prefilled; the cache is repeated to n rows
        stops = torch.tensor(sorted(self.stops), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16):
            rows = [p for p in prompts for _ in range(copies)]
            cache, logits, mask = prefill(self.model, rows, pad, share_prefix=self.share_prompt)  # every prompt token's cache
            logits, width = logits.repeat_interleave(n // copies, dim=0), mask.shape[1]
            cache.batch_repeat_interleave(n // copies)  # each prompt's cache copied to its n rows
            reserved = reserve_cache(cache, self.max_new_tokens)  # each decode step writes in place (no growing by concatenation)
            position = mask.sum(1).repeat_interleave(n // copies)
            mask = torch.cat([mask.repeat_interleave(n // copies, dim=0), mask.new_ones(len(position), self.max_new_tokens)], dim=1)
            graph = self.cuda_graph and reserved and device.type == "cuda"
            decode_step = (CudaGraphDecode if graph else EagerDecode)(self.model, cache, mask, position, width)
            tokens, logprobs = [], []
            stopped = torch.zeros(len(mask), dtype=torch.bool, device=device)
            for step in range(self.max_new_tokens):  # decode: one token per row
                token, logprob = sample_tokens(logits, self.temperature)
                token = token.masked_fill(stopped, pad)  # a stopped row only pads
                tokens.append(token)
                logprobs.append(logprob)
                stopped |= torch.isin(token, stops)
                if step == self.max_new_tokens - 1 or bool(stopped.all()):
                    break
                logits = decode_step(token)
            if graph and decode_step.graph is None:  # the capture failed (logged): decode eagerly from now on
                self.cuda_graph = False
            release_cache(cache)  # freed now, before the update, not whenever gc runs
        result = []
        rows, row_logprobs = torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist()
        for prompt, row, row_logprob in zip([p for p in prompts for _ in range(n)], rows, row_logprobs):
            completion, truncated = cut_at_stop(row, self.stops)
            text = self.tokenizer.decode(completion, skip_special_tokens=True)
            result.append(Rollout(prompt, completion, text, truncated, row_logprob[: len(completion)]))
        return result


def prefill(model, prompts: list[list[int]], pad: int, share_prefix: bool = False):
    """(KV cache of every prompt token, logits after each prompt's last token, attention mask): the prompts'
    forward, left-padded to one width. With `share_prefix`, the tokens that every prompt begins with (the system
    prompt and chat template: 92 of the ~116 tokens of an arith prompt for SmolLM2) are computed once and their cache
    copied to every row; then only the rest of each prompt, left-padded after the prefix. eval.py's 64 arith prompts
    a batch: 30 of a 46 s batch on a 2-core CPU was the prefill (measured); docs/speed.md has the figures."""
    if not all(prompts):  # nothing to predict the first token from (and the shared prefix came out as -1 tokens)
        raise ValueError("every prompt needs at least one token; build prompts with build_prompt")
    device = next(model.parameters()).device
    share_prefix = share_prefix and len(prompts) > 1 and not windowed_attention(model)  # (its padding would sit inside a window)
    shared = min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1) if share_prefix else 0
    past = {}
    if shared:  # one row, then copied to all: the cache of the same tokens at the same positions
        out = model(input_ids=torch.tensor([prompts[0][:shared]], device=device), use_cache=True,
                    logits_to_keep=last_positions(1, shared, device))
        past = {kv_cache_name(): getattr(out, kv_cache_name())}
        past[kv_cache_name()].batch_repeat_interleave(len(prompts))
    width = max(len(p) - shared for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p) + shared) + p[shared:] for p in prompts], device=device)
    mask = torch.tensor([[1] * shared + [0] * (width - len(p) + shared) + [1] * (len(p) - shared) for p in prompts], device=device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)[:, shared:], **past,
                use_cache=True, logits_to_keep=last_positions(1, width, device))
    return getattr(out, kv_cache_name()), out.logits[:, -1], mask


def last_positions(count: int, length: int, device) -> torch.Tensor:
    """`logits_to_keep` for the last `count` of `length` positions, given as indices rather than as
    the int `count`. With an int the model slices its hidden states into a non-contiguous view, and
    torch's matmul then runs the LM head on it as a batched product over a copy of the (frozen)
    head expanded to every row: for 64 prompts' prefill on a CPU, 3.6 GB and 5 of 7.5 seconds
    (measured). Indices give a contiguous copy of just those positions, and one matrix product."""
    return torch.arange(length - count, length, device=device)


def sample_tokens(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / temperature), and its log-probability.

    Inverse-transform sampling: one uniform number per row, placed in the row's cumulative
    probabilities. The same distribution as torch.multinomial (transformers' `generate` uses it), but
    multinomial draws an exponential per vocabulary entry: 32 x 49,152 numbers a step, 28 ms of a
    ~95 ms decode step on a 2-core CPU (measured). Draws from torch's global generator, so
    torch.manual_seed and a restored checkpoint replay the same tokens.

    The running sum and the uniform number are float64: in float32 the sum's steps near 1 are 6e-8
    wide, so every token rarer than ~3e-8 that follows most of the mass got no width and was never
    drawn (on SmolLM2's GSM8K completions, 46k of its 49k tokens a step, 5e-5 of the probability;
    measured). float64 adds 1% to a decode step of 32 rows on a 2-core AVX2 CPU (measured)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # float32, as the update scores
    cumulative = logp.exp().double().cumsum(dim=-1)
    u = torch.rand(len(logits), 1, device=logits.device, dtype=torch.float64) * cumulative[:, -1:]
    token = torch.searchsorted(cumulative, u, right=True).clamp_(max=logits.shape[-1] - 1)  # first with cdf > u
    return token.squeeze(1), logp.gather(1, token).squeeze(1)


def merged_copy(model, dtype: torch.dtype = torch.bfloat16):
    """A copy of `model` in `dtype` for generation, with its LoRA adapter merged into the weights:
    a plain transformers model, without peft's per-layer adapter matmuls or autocast's per-forward
    cast of float32 weights. Costs one copy of the weights in memory (270 MB in bfloat16 for
    SmolLM2-135M). With both, a decode step of 32 rows on a 2-core CPU took 200 ms; a bfloat16 copy
    brought it to ~95 ms (measured). On a CPU without bfloat16 arithmetic the copy is float32
    (docs/speed.md has both kinds of CPU).

    Only the parameters take `dtype`: buffers such as the rotary frequencies keep the dtype the
    model was built with, as in a model loaded in bfloat16. The adapter is written in by
    refresh_merged_copy, the same code that takes each later update."""
    import copy

    clone = copy.deepcopy(model)
    if hasattr(clone, "unload"):  # a peft model: its plain base model, the LoRA layers taken out
        clone = clone.unload()
    for param in clone.parameters():  # tied weights are one parameter, so they stay tied
        param.data = param.data.to(dtype)
    refresh_merged_copy(clone, model)
    return clone.requires_grad_(False).eval()


@torch.no_grad()
def refresh_merged_copy(clone, model) -> None:
    """Write the trained model's current LoRA weights into the merged copy: for every adapted
    layer, W + B A * scale (peft's get_delta_weight), rounded to the copy's dtype; W alone inside peft's
    `disable_adapter()`. W as the trained model holds it: under the CPU profile's autocast already
    rounded to bfloat16 (model.frozen_weights_for_autocast), as the update computes with it. Only LoRA
    layers are trained, so the rest of the copy never changes."""
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):  # a peft LoRA layer
            weight = module.base_layer.weight.float()
            for adapter in [] if module.disable_adapters else module.active_adapters:  # off: the base model
                weight = weight + module.get_delta_weight(adapter).float()
            clone.get_submodule(name.removeprefix("base_model.model.")).weight.copy_(weight)


if __name__ == "__main__":
    import model as models

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, tokenizer = models.load_policy(models.EMBEDDED, "cpu", torch.float32)
    sampler = HFSampler(model, tokenizer, max_new_tokens=32, temperature=0.9)
    prompt = build_prompt(tokenizer, "What is 7 + 5?")
    start = time.perf_counter()
    (group,) = sampler.generate([prompt], n=8)
    print(f"8 rollouts in {time.perf_counter() - start:.1f} s")
    for r in group:
        print(f"{'[truncated] ' if r.truncated else ''}{r.text!r}")
