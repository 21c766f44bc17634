"""The update: log-probabilities of the kept completions under the policy, and one GRPO step on them.

Algorithm 1's update, "one clipped policy-gradient step on the kept rollouts": the loss is
grpo.grpo_loss, averaged over the kept rollouts in micro-batches (each micro-batch weighted by its
share, so the accumulated gradient is that of the loss over all of them). PODS's saving is here:
the forward and backward passes run on m of the n rollouts of each prompt.

- `completion_logprobs`: log pi_theta of each completion token, prompts left-padded and completions
  right-padded so the LM head runs only on the positions that predict completion tokens.
- `shared_prompt_logprobs`: the same numbers with each prompt forwarded once per micro-batch (a 4-D
  attention mask lets each completion see only the prompt and itself); exact, and cheaper on a CPU.
- `policy_update`: the step, with an explicit `UpdateSettings`, so it can be lifted into another trainer.

Run `python update.py` to take one step on the embedded model and print its statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import distributed
import grpo
from decode import windowed_attention
from model import SetupError
from sampling import Rollout, last_positions


@dataclass
class UpdateSettings:
    """The update's hyperparameters (train.py's flags of the same names)."""

    micro_batch: int = 8  # rollouts per forward/backward pass
    temperature: float = 0.9  # the sampling temperature: the update scores the tempered policy that was sampled
    clip_eps: float = 0.2  # PPO clip range, [1 - clip_eps, 1 + clip_eps_high]
    clip_eps_high: float | None = None  # None: clip_eps
    beta: float = 0.0  # KL penalty against the base model (the adapter switched off); the paper uses 0
    tis_cap: float = 0.0  # truncated importance sampling against the sampler's log-probs; 0 = off
    max_grad_norm: float = 0.1  # gradient clipping
    share_prompt: bool = False  # shared_prompt_logprobs instead of completion_logprobs
    bf16_autocast: bool = False  # bfloat16 autocast for the forward passes


def completion_logprobs(model, rollouts: list[Rollout], temperature: float, pad_id: int):
    """log pi_theta of each completion token: ([B, C] log-probs, [B, C] mask).

    Prompts are left-padded and completions right-padded, so every completion starts at the
    same column and the LM head runs only on the last C + 1 positions: the C that predict completion tokens, and
    the last one (dropped).
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
                   logits_to_keep=last_positions(C + 1, P + C, device), use_cache=False).logits
    logits = logits[:, :-1].float() / temperature  # position t predicts token t + 1; softmax in float32 (autocast: bf16 logits)
    logprobs = grpo.token_logprobs(logits, torch.tensor(targets, dtype=torch.long, device=device))
    return logprobs, torch.tensor(mask, dtype=torch.long, device=device)  # (dtypes given: all completions empty is [B, 0])


def prompt_groups(rollouts: list[Rollout]) -> list[list[int]]:
    """Indices of the rollouts in runs of consecutive rollouts with the same prompt (a prompt's group)."""
    groups: list[list[int]] = []
    for i, r in enumerate(rollouts):
        if groups and rollouts[groups[-1][0]].prompt_ids == r.prompt_ids:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def shared_prompt_logprobs(model, rollouts: list[Rollout], temperature: float, pad_id: int):
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
    if windowed_attention(distributed.unwrap(model)):  # the packed row's 4D mask has no sliding window: not exact there
        return completion_logprobs(model, rollouts, temperature, pad_id)
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
            if c == 0:  # an empty completion (its EOS stripped, as TRL does): no token to score, masked out
                continue
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
        raise SetupError(f"--share-prompt needs sdpa or eager attention, not {attention_kind}; pass --no-share-prompt")
    logits = model(input_ids=ids.to(device), attention_mask=attention, position_ids=position.to(device),
                   logits_to_keep=last_positions(L - P + 1, L, device), use_cache=False).logits
    logits = logits.float() / temperature  # column k holds the logits at packed column P - 1 + k
    normalizer = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])  # one row at a time, as grpo.token_logprobs
    row_of, column_of, targets = row_of.to(device), column_of.to(device) - (P - 1), targets.to(device)
    logprobs = logits[row_of, column_of, targets] - normalizer[row_of, column_of]
    return logprobs, mask.to(device)


def sampler_logprobs(batch: list[Rollout], like: torch.Tensor) -> torch.Tensor | None:
    """The sampling engine's log-probs of each completion token, padded like the trainer's [B, C]
    log-probs `like`; None when the sampler does not return them."""
    if any(r.logprobs is None for r in batch):
        return None
    padded = torch.zeros_like(like)
    for i, r in enumerate(batch):
        padded[i, : len(r.logprobs)] = torch.tensor(r.logprobs, dtype=like.dtype)
    return padded


def micro_batches(kept: list[Rollout], size: int) -> list[list[int]]:
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


def policy_update(model, optimizer, scheduler, kept: list[Rollout], advantages: torch.Tensor, settings: UpdateSettings, pad_id: int,
                  rows_in_mean: float | None = None) -> dict:
    """One GRPO step on the kept rollouts only, accumulating gradients over micro-batches; `settings`
    are the update's hyperparameters (UpdateSettings), `advantages` one per kept rollout.

    Each micro-batch loss is weighted by its rows / rows_in_mean (by default its share of the kept
    rollouts), so the accumulated gradient is that of grpo_loss over all of them (the mean over
    completions of per-token means).
    With share_prompt, micro-batches follow the prompt groups and each prompt in one is
    forwarded once (shared_prompt_logprobs).
    One update per batch: pi_old = pi_theta (detached), so no extra forward pass is needed.
    When the sampler returned its own log-probs (vLLM, and transformers generation), the mean and max |log pi_sampler - log pi_theta|
    over the completion tokens are reported (`sampler_gap_mean`, `sampler_gap_max`), and tis_cap
    weights each token by the truncated ratio of the two (grpo.truncated_importance_weights).
    With beta > 0 the reference policy is the base model (the LoRA adapter switched off), one
    extra forward pass without gradients per micro-batch, again on the kept rollouts only.
    Under torchrun `model` is wrapped in DDP, which averages the gradients across ranks in the
    last micro-batch's backward (distributed.py); when every rank holds as many kept rollouts, the
    average is this same mean over all ranks' rollouts.
    `rows_in_mean` is the number of rows the loss is a mean over, on this rank: None = len(kept).
    Where ranks hold different numbers of rows, each passes the global count / world size, so that
    DDP's average is the mean over all ranks' rows; math.inf weighs every row 0 (a rank with nothing
    to learn from still runs a forward and backward, which DDP's all-reduce needs). The statistics
    (loss, clip_frac, ratio_mean, kl) are weighted as the loss, so their mean over ranks
    (distributed.reduce_row) is the mean over all rows, and a row of weight 0 adds nothing to them
    (sampler_gap_* are the sampler's, not the update's: measured on every row given).
    """
    model.train()
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    rows_in_mean = len(kept) if rows_in_mean is None else rows_in_mean
    totals = {"loss": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0, "kl": 0.0}
    gap_sum, gap_max, gap_tokens = 0.0, 0.0, 0
    logprobs_of = shared_prompt_logprobs if settings.share_prompt else completion_logprobs
    batches = micro_batches(kept, settings.micro_batch)
    for step, indices in enumerate(batches):
        batch = [kept[i] for i in indices]
        ref_logprobs = None
        with distributed.gradient_sync(model, sync=step == len(batches) - 1):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.bf16_autocast):
                if settings.beta > 0:
                    policy = distributed.unwrap(model)
                    with torch.no_grad(), policy.disable_adapter():
                        ref_logprobs, _ = logprobs_of(policy, batch, settings.temperature, pad_id)
                logprobs, mask = logprobs_of(model, batch, settings.temperature, pad_id)
            adv = advantages[indices].to(logprobs.device)
            sampled = sampler_logprobs(batch, logprobs)
            weights = None
            if sampled is not None and mask.any():  # vLLM: how far its log-probs are from the trainer's, and optionally a correction
                gap = (logprobs.detach() - sampled).abs() * mask  # (a micro-batch of empty completions has no token to measure)
                gap_sum, gap_max, gap_tokens = gap_sum + gap.sum().item(), max(gap_max, gap.max().item()), gap_tokens + int(mask.sum())
                if settings.tis_cap:
                    weights = grpo.truncated_importance_weights(logprobs, sampled, settings.tis_cap)
            loss, stats = grpo.grpo_loss(logprobs, logprobs.detach(), adv, mask, settings.clip_eps, settings.clip_eps_high,
                                         ref_logprobs=ref_logprobs, beta=settings.beta, token_weights=weights)
            weight = len(batch) / rows_in_mean
            (loss * weight).backward()
        totals["loss"] += loss.item() * weight
        for k in ("clip_frac", "ratio_mean", "kl"):
            totals[k] += stats[k] * weight
    if gap_tokens:
        totals["sampler_gap_mean"], totals["sampler_gap_max"] = gap_sum / gap_tokens, gap_max
    params = [p for p in model.parameters() if p.requires_grad]
    totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm))
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


if __name__ == "__main__":
    import model as models
    from sampling import HFSampler, build_prompt

    policy, tokenizer = models.load_trainable_policy(models.EMBEDDED, "cpu", lora_rank=16, lora_alpha=32)
    prompts = [build_prompt(tokenizer, q) for q in ("What is 7 + 5?", "What is 12 - 4?")]
    kept = [r for group in HFSampler(policy, tokenizer, max_new_tokens=16, temperature=0.9).generate(prompts, n=4) for r in group]
    rewards = torch.tensor([float(len(r.text) % 3) for r in kept]).view(-1, 4)  # a stand-in reward, uneven across rollouts
    advantages = grpo.group_advantages(rewards).flatten()
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stats = policy_update(policy, optimizer, scheduler, kept, advantages, UpdateSettings(share_prompt=True), tokenizer.pad_token_id)
    print({k: round(v, 4) for k, v in stats.items()})
