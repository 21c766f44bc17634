"""GRPO's group-normalized advantages and clipped objective, as used by PODS.

For a prompt q with m kept rollouts o_1..o_m (after down-sampling) and rewards r_1..r_m:

    A_i = (r_i - mean(r)) / (std(r) + eps)                    advantages from the kept rewards

    J(theta) = 1/m sum_i 1/|o_i| sum_t [ min(rho_it A_i, clip(rho_it, 1-eps_low, 1+eps_high) A_i)
                                         - beta KL_it ]
    rho_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)

`grpo_loss` returns -J. PODS changes only which rollouts enter: the mean and std are those of
the m *kept* rewards (`group_advantages` on the down-sampled groups), not of all n.

A group whose kept rewards are all equal has advantages exactly 0: with beta = 0 it adds nothing
to the gradient, only rows to the mean. Leaving such groups out of the batch (train.py
--uniform-groups skip or refill) keeps the gradient's direction and multiplies it by kept rows /
informative rows. AdamW is nearly invariant to that scale (each step's direction barely changes,
and eps matters less), but a step with fewer informative rows weighs relatively more in its moment
estimates; and the norm before clipping grows as much, so clipping at --max-grad-norm binds more
often (where it binds in both, the clipped gradients are nearly the same).

Torch only. Run `python grpo.py` for a tiny worked example.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i - mean) / (std + eps) within each group; rewards shaped [groups, m] (a tensor, or nested lists or a
    numpy array), advantages a float32 tensor of that shape.

    std is the sample standard deviation (torch's default, as in TRL and the authors' code),
    so m must be at least 2. A group whose rewards are all equal gets advantages exactly 0: in
    float32 the mean of [1.2] * 16 is not exactly 1.2, and the formula would give 1.19e-3 to every
    rollout. Such a group is detected by exact comparison, every reward equal to the group's first,
    so a group that differs by any amount (one float32 step) is normalized as before.
    """
    rewards = torch.as_tensor(rewards).float()
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be shaped [groups, m], got {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"each group needs m >= 2 rewards for a standard deviation, got m={rewards.shape[1]}")
    if not torch.isfinite(rewards).all():  # NaN would make its whole group's advantages NaN, and the loss
        raise ValueError(f"rewards must be finite, got {rewards[~torch.isfinite(rewards)].tolist()}; check the reward function")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    uniform = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(uniform, 0.0, (rewards - mean) / (std + eps))


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log pi(token_ids) under `logits`: [B, T, V] logits and [B, T] ids -> [B, T] log-probs. The logits at position t
    must be those that predict token t: a causal language model's outputs shifted by one (logits[:, :-1] for
    ids[:, 1:]).

    log softmax(x)_y = x_y - logsumexp(x), in float32 whatever the logits' dtype (in bfloat16 the
    logsumexp of a large vocabulary is off by up to ~0.05). Computed one sequence at a time, so no
    full log-softmax [B, T, V] is made; with gradient, autograd keeps each row's float32 copy for the backward
    (bfloat16 logits cost a float32 [B, T, V] there after all; float32 ones nothing more).
    """
    if token_ids.shape != logits.shape[:2]:  # ([1, T] ids would broadcast over the batch)
        raise ValueError(f"token_ids must be shaped [B, T] = {tuple(logits.shape[:2])} like the logits, got {tuple(token_ids.shape)}")
    picked = logits.gather(dim=-1, index=token_ids.unsqueeze(-1)).squeeze(-1).float()
    normalizer = torch.stack([torch.logsumexp(row.float(), dim=-1) for row in logits])
    return picked - normalizer


def truncated_importance_weights(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_theta / pi_sampler, cap) per token, without gradient (truncated importance sampling).

    The rollouts come from a sampling engine (vLLM: bfloat16 kernels, a bfloat16 copy of the adapter)
    whose probabilities differ slightly from the trainer's; weighting each token's surrogate by this
    ratio corrects the policy gradient for that gap, and the cap bounds the variance. Not part of the
    paper (its code treats the rollouts as on-policy); TRL offers it with vLLM (its default masks whole sequences instead).
    """
    return torch.exp(logprobs.detach() - sampler_logprobs).clamp(max=cap)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped GRPO surrogate, negated for minimisation. Shapes: [B, T] except advantages [B].

    Per completion token: min(rho A, clip(rho, 1 - clip_eps, 1 + clip_eps_high) A), averaged over
    the completion's unmasked tokens (1/|o_i|) and then over completions. `clip_eps_high`
    defaults to `clip_eps` (symmetric clipping). With beta > 0 and `ref_logprobs`, the k3
    estimator of KL(pi_theta || pi_ref), exp(ref - logp) - (ref - logp) - 1, is subtracted
    per token with weight beta. The paper trains with beta = 0.

    With one update per batch, old_logprobs = logprobs.detach(): rho = 1, nothing is clipped
    and the gradient is that of REINFORCE with the group baseline,
    -1/B sum_i A_i 1/|o_i| sum_t grad log pi(o_it), over the B completions given: m per prompt, so the
    mean of the prompts' J (each 1/m sum_i ...) when every prompt has its m.

    `token_weights` ([B, T], no gradient) multiply each token's surrogate: the truncated importance
    weights of `truncated_importance_weights` when the rollouts were sampled by another engine.

    Returns (loss, stats) with stats "clip_frac" (share of tokens where the clipped term is
    the one the min picks and the ratio lies outside the clip range), "ratio_mean" and "kl", each
    averaged as the loss is, over a completion's tokens and then over completions: so a mean of
    them over micro-batches weighted by their completions is the batch's, however it was split.
    """
    if advantages.shape != logprobs.shape[:1]:  # [groups, m] would broadcast over the tokens instead
        raise ValueError(f"advantages must have one entry per completion, shape {tuple(logprobs.shape[:1])}, "
                         f"got {tuple(advantages.shape)}; flatten group_advantages' [groups, m]")
    for name, given in (("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs), ("token_weights", token_weights)):
        if given is not None and given.shape != logprobs.shape:  # (it would broadcast: a [B, 1] mask weighs every token)
            raise ValueError(f"{name} must be shaped like logprobs, {tuple(logprobs.shape)}, got {tuple(given.shape)}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError(f"beta={beta} needs ref_logprobs, the reference policy's log-probs, for the KL term")
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    # the sampling policy's and the reference's log-probs, and the weights, are constants of the objective: passing
    # logprobs itself as old_logprobs would otherwise cancel its gradient to exactly 0 (rho = exp(logp - logp))
    old_logprobs, ref_logprobs = old_logprobs.detach(), None if ref_logprobs is None else ref_logprobs.detach()
    token_weights = None if token_weights is None else token_weights.detach()
    keep = mask.bool()
    mask = mask.to(logprobs.dtype)
    # rho = exp(logp - logp_old); padded positions get rho = 1 so no inf/NaN leaks through them
    ratio = torch.exp(torch.where(keep, logprobs - old_logprobs, torch.zeros_like(logprobs)))
    adv = advantages.to(logprobs).unsqueeze(1)  # (logprobs' dtype and device)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high) * adv
    per_token = -torch.min(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * torch.where(keep, token_weights.to(per_token.dtype), 1.0)  # (NaN at padding: NaN gradients)

    kl = None
    if ref_logprobs is not None:
        delta = torch.where(keep, ref_logprobs - logprobs, torch.zeros_like(logprobs))
        kl = torch.exp(delta) - delta - 1.0
        if beta > 0:
            per_token = per_token + beta * kl

    tokens = mask.sum(dim=1).clamp(min=1.0)  # |o_i|; an empty completion contributes 0
    loss = ((per_token * mask).sum(dim=1) / tokens).mean()

    with torch.no_grad():
        def mean(per_token):  # as the loss averages: 1/|o_i| over tokens, then over completions
            return float(((per_token * mask).sum(dim=1) / tokens).mean())

        is_clipped = ((ratio < 1.0 - clip_eps) & (adv < 0)) | ((ratio > 1.0 + clip_eps_high) & (adv > 0))
        stats = {
            "clip_frac": mean(is_clipped.to(mask.dtype)),
            "ratio_mean": 1.0 + mean(ratio - 1.0),  # an empty completion counts as ratio 1, not 0
            "kl": mean(kl) if kl is not None else 0.0,
        }
    return loss, stats


if __name__ == "__main__":
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    advantages = group_advantages(rewards)
    print("rewards   ", rewards.tolist())
    print("advantages", [[round(a, 3) for a in row] for row in advantages.tolist()])
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-1.0, -1.0], [-0.1, -3.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    loss, stats = grpo_loss(logprobs, logprobs.detach(), advantages[0], mask)
    loss.backward()
    print(f"loss {loss.item():.4f}, stats {stats}")
    print("d loss / d logprob (REINFORCE: -A_i / (m |o_i|))", logprobs.grad.tolist())
