"""Down-sampling rules of PODS: which m of the n rollouts of a prompt enter the update.

Paper: Xu, Savani, Fang, Kolter, "Not All Rollouts are Useful: Down-Sampling Rollouts in
LLM Reinforcement Learning" (arXiv 2504.13818).

- Definition 3.1: a down-sampling rule maps the n rewards of one prompt's rollouts to a subset
  of m of them. Three rules: `random_downsample`, `max_reward_downsample` and
  `max_variance_downsample` (the one PODS recommends).
- Lemma 3.1: the variance-maximizing subset is always the k highest plus the m - k lowest
  rewards for some k, so one sort and a scan over k find it in O(n log n):
  `max_variance_downsample`.
- `downsample` applies a rule to a flat batch of groups (one group of n per prompt).
- Groups with nothing to learn from: a group whose kept rewards are all equal gets advantages
  exactly 0 (grpo.group_advantages). `informative_groups` finds the others, and `dynamic_sampling`
  picks a step's groups from several rounds of them (DAPO's dynamic sampling; not in the paper).

Numpy only; accepts lists, numpy arrays and torch tensors. Every rule returns m distinct
indices, sorted ascending. Ties are broken deterministically: among equal rewards
max_reward keeps the lowest indices; max_variance, which takes its high rewards from the top of
an ascending stable sort, keeps the highest indices among equal high rewards and the lowest
among equal low ones, and when several candidates have the same variance (to rounding) the one
with the smallest k (fewest "high" rollouts) wins.

Run `python pods.py` for a demonstration and a timing table against brute-force enumeration.
"""

from __future__ import annotations

import math
import operator
import time
from itertools import combinations
from typing import Callable, Sequence

import numpy as np


def _rewards_array(rewards) -> np.ndarray:
    """A 1-D float64 copy of `rewards` (list, numpy array or torch tensor on any device)."""
    if hasattr(rewards, "detach"):  # a torch tensor; numpy cannot read bf16 or CUDA memory
        rewards = rewards.detach().cpu().double().numpy()
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be one-dimensional (one group, or groups back to back for downsample()), got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        bad = r[~np.isfinite(r)]
        raise ValueError(f"rewards must be finite, got {bad.tolist()}; check the reward function")
    return r


def _whole_number(value, name: str) -> int:
    """value as a Python int: an integer of any kind (numpy's, a 0-d integer tensor), not a bool (2.0 failed as
    an index, and True kept 1)."""
    boolean, scalar = "bool" in str(getattr(value, "dtype", type(value))), getattr(value, "shape", ()) == ()
    try:
        whole = operator.index(value) if scalar and not boolean else None
    except TypeError:  # 2.0, "2"
        whole = None
    if whole is None:
        raise ValueError(f"{name}={value!r} must be a whole number")
    return whole


def _check_m(m: int, n: int) -> int:
    """m as a Python int (_whole_number), 1 <= m <= n."""
    whole = _whole_number(m, "m")
    if whole < 1:
        raise ValueError(f"m={m} must be >= 1")
    if whole > n:
        raise ValueError(f"m={m} must be <= n={n}")
    return whole


def random_downsample(rewards, m: int, rng: np.random.Generator | int | None = None) -> list[int]:
    """Definition 3.1, random rule: m indices drawn uniformly without replacement, by `rng`: a numpy Generator, a seed,
    or None for fresh entropy from the operating system (np.random.seed and torch.manual_seed do not reach it)."""
    r = _rewards_array(rewards)
    m = _check_m(m, len(r))
    rng = np.random.default_rng(rng)  # (a Generator is used as it is)
    return sorted(rng.choice(len(r), size=m, replace=False).tolist())


def max_reward_downsample(rewards, m: int) -> list[int]:
    """Definition 3.1, max-reward rule: the m highest rewards (equal rewards: lower index first)."""
    r = _rewards_array(rewards)
    m = _check_m(m, len(r))
    order = np.argsort(-r, kind="stable")
    return sorted(order[:m].tolist())


def max_variance_downsample(rewards, m: int) -> list[int]:
    """Definition 3.1, max-variance rule, computed as Lemma 3.1 prescribes, in O(n log n).

    Lemma 3.1: some subset of size m with the largest variance consists of the k highest
    and the m - k lowest rewards, for some k in 0..m.

    Proof (exchange argument). Let S be an optimal subset with mean mu. Swapping a chosen
    r_i for an unchosen r_j changes the variance by
        (b - a) * ((m - 1) b + (m + 1) a) / m^2,   with a = r_i - mu, b = r_j - mu.
    If r_i >= mu and r_j > r_i, both factors are positive; if r_i <= mu and r_j < r_i, both
    are negative. Either way the swap would raise the variance, so in S no unchosen reward
    lies above a chosen one at or above the mean, nor below a chosen one at or below it:
    the chosen rewards above the mean are the k largest, the rest the m - k smallest.

    The code is the proof: sort once, then for each k the candidate is sorted[:m-k] (lowest)
    plus sorted[n-k:] (highest). Prefix sums of r and r^2 give each candidate's variance
    E[r^2] - E[r]^2 in O(1). Rewards are centred first, which leaves every variance unchanged
    and keeps that difference accurate, and scaled to at most 1 in size, which scales every variance
    alike and keeps r^2 in float range (rewards of 1e200 or 1e-200 picked wrong subsets before). The
    mean is taken after an exact power-of-two scaling, where it cannot overflow (1e308 could).
    """
    r = _rewards_array(rewards)
    n = len(r)
    m = _check_m(m, n)
    order = np.argsort(r, kind="stable")  # ascending; equal rewards keep index order
    r = np.ldexp(r, -int(np.frexp(np.abs(r).max())[1]))  # times 2^-e: at most 1 in size, the same digits
    x = r[order] - r.mean()
    x = x / max(np.abs(x).max(), np.finfo(np.float64).tiny)  # (all equal: x is all 0, and stays so)
    s1 = np.concatenate(([0.0], np.cumsum(x)))  # s1[j] = sum of the j lowest
    s2 = np.concatenate(([0.0], np.cumsum(x * x)))
    k = np.arange(m + 1)  # number taken from the top
    low, high = m - k, n - k  # candidate k: sorted[:low] and sorted[high:]
    sum1 = s1[low] + (s1[n] - s1[high])
    sum2 = s2[low] + (s2[n] - s2[high])
    variance = sum2 / m - (sum1 / m) ** 2
    # the first maximum (smallest k), counting variances within rounding of it as equal: mirror-image
    # candidates, e.g. [0, .025, 1.025] and [0, 1, 1.025], tie exactly in reals but not always in floats.
    # "Within rounding": 1e-12 of the centred rewards' sum of squares / m, above the prefix sums' own error
    # (up to ~n x 1.1e-16 of it) for n up to thousands; a subset better by less than that may lose to a smaller k
    best = int(np.argmax(variance >= variance.max() - 1e-12 * s2[n] / m))
    chosen = np.concatenate((order[: m - best], order[n - best :]))
    return sorted(chosen.tolist())


Rule = Callable[..., list[int]]
RULES: dict[str, Rule] = {
    "random": random_downsample,
    "max_reward": max_reward_downsample,
    "max_variance": max_variance_downsample,
}


def downsample(
    rewards,
    m: int,
    rule: str = "max_variance",
    group_size: int | None = None,
    rng: np.random.Generator | int | None = None,
) -> list[int]:
    """Apply a Definition 3.1 rule to each group of a flat batch and return flat indices.

    With `group_size=n`, `rewards` holds B groups of n rewards back to back (one group per
    prompt); the rule keeps m of each group. The result lists the kept indices into the flat
    batch, group by group, ascending. Without `group_size` the whole vector is one group.
    `rng` (a numpy Generator, a seed or None, as random_downsample takes) is used only by the random rule.
    """
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; known rules: {', '.join(sorted(RULES))}")
    r = _rewards_array(rewards)
    if len(r) == 0:
        raise ValueError("rewards is empty: give each prompt's n rewards")
    n = len(r) if group_size is None else _whole_number(group_size, "group_size")
    rng = np.random.default_rng(rng) if rule == "random" else rng  # one stream for all groups (a seed per group would repeat)
    if n < 1:
        raise ValueError(f"group_size={n} must be >= 1")
    if len(r) % n != 0:
        raise ValueError(f"a batch of {len(r)} rewards is not a whole number of groups of group_size={n}")
    m = _check_m(m, n)
    kept: list[int] = []
    for start in range(0, len(r), n):
        group = r[start : start + n]
        picked = RULES[rule](group, m, rng=rng) if rule == "random" else RULES[rule](group, m)
        kept.extend(start + i for i in picked)
    return kept


def informative_groups(kept_rewards) -> np.ndarray:
    """Which groups have something to learn from: [groups, m] kept rewards -> [groups] bool.

    A group is uniform (False) when every kept reward equals its first. grpo.group_advantages gives
    such a group advantages exactly 0, so with no KL term it adds nothing to the gradient; the
    rewards are compared in float32, as there, so the two always agree. DAPO's dynamic sampling
    (Yu et al. 2025, "DAPO", arXiv 2503.14476, Section 3.2) filters out such groups (there by all of
    a prompt's rewards; composed with PODS, by the m kept).
    """
    if hasattr(kept_rewards, "detach"):
        kept_rewards = kept_rewards.detach().float().cpu().numpy()
    r = np.asarray(kept_rewards, dtype=np.float32)
    if r.ndim != 2:
        raise ValueError(f"kept rewards must be shaped [groups, m], got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite, got {r[~np.isfinite(r)].tolist()}; check the reward function")
    return ~np.all(r == r[:, :1], axis=1)


def dynamic_sampling(informative, target: int) -> list[int]:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, Section 3.2): of the groups drawn so
    far, round after round and in order (`informative`, from `informative_groups`), the first `target`
    informative ones; fewer when there are not that many yet (draw another round, or train on these).
    """
    if _whole_number(target, "target") < 0:
        raise ValueError(f"target={target} must be >= 0")
    if hasattr(informative, "detach"):  # a torch tensor, perhaps on a GPU
        informative = informative.detach().cpu().numpy()
    return np.flatnonzero(np.asarray(informative, dtype=bool))[:target].tolist()


def brute_force_max_variance(rewards: Sequence[float], m: int) -> float:
    """The largest variance over all C(n, m) subsets: the reference Lemma 3.1 is checked against."""
    r = _rewards_array(rewards)
    m = _check_m(m, len(r))
    subsets = np.array(list(combinations(range(len(r)), m)))
    return float(r[subsets].var(axis=1).max())


def _demo() -> None:
    rewards = np.array([1.0, 0.0, 0.2, 1.2, 0.0, 1.0, 0.1, 0.0])
    m = 4
    print(f"rewards (n={len(rewards)}): {rewards.tolist()}, keep m={m}")
    rng = np.random.default_rng(0)
    for name in RULES:
        kept = downsample(rewards, m, name, rng=rng)
        print(f"  {name:<13} keeps {kept} -> rewards {rewards[kept].tolist()}, variance {rewards[kept].var():.4f}")
    print(f"  brute force best variance over C({len(rewards)},{m}) subsets: {brute_force_max_variance(rewards, m):.4f}")

    rounds = [np.array([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]), np.array([[1.0, 0.0], [0.0, 1.0], [1.2, 0.0]])]
    informative = np.concatenate([informative_groups(kept) for kept in rounds])
    print(f"\ndynamic sampling (DAPO), 3 groups a step: kept rewards {[g.tolist() for kept in rounds for g in kept]}")
    print(f"  informative {informative.astype(int).tolist()}: round 1 has {int(informative[:3].sum())}, "
          f"so round 2 is drawn and the step trains on groups {dynamic_sampling(informative, 3)} (the last dropped)")

    print("\nmax_variance_downsample (Lemma 3.1, O(n log n)) against brute-force enumeration, m = n/2:")
    print(f"  {'n':>6}  {'lemma 3.1':>11}  {'brute force':>14}")
    for n in (16, 64, 256, 1024, 4096, 16384, 65536):
        r = np.random.default_rng(n).random(n)
        start = time.perf_counter()
        max_variance_downsample(r, n // 2)
        fast = time.perf_counter() - start
        if n <= 16:
            start = time.perf_counter()
            brute_force_max_variance(r, n // 2)
            naive = f"{time.perf_counter() - start:12.4f} s"
        else:
            naive = f"C(n,m)=1e{math.log10(math.comb(n, n // 2)):.0f}"
        print(f"  {n:>6}  {fast * 1e3:8.3f} ms  {naive:>14}")


if __name__ == "__main__":
    _demo()
