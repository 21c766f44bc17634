"""Statistics over seeds for the CPU reproduction (README.md here): how sure is a difference?

The paper reports one speed-up per comparison; the reproduction runs 4-13 paired seeds per setting
(the i-th runs of two settings are the same seed, as plot.group_curves orders them) and asks what
those seeds support. With so few seeds a percentile bootstrap is too narrow (over 6 seeds it spans
~1.8 standard errors a side where a t interval spans 2.57), so the intervals here hold for few seeds:

- a paired t interval for a mean difference over seeds (t_interval): the mean accuracy over the
  horizon (mean_accuracy_difference) and the accuracy at given times (paired_differences);
- an exact distribution-free interval for the median of the seeds' own speed-ups, from order
  statistics (order_statistic_ranks, median_interval, paired_speedup), with its achieved coverage;
  a seed that never reaches the target within its horizon gives a bound ("< x", "> x"), never a number;
- the authors' speed-up on seed-mean curves (speedup_of_means) as a point estimate with no interval,
  and how far leaving one seed out moves it (leave_one_out_speedups);
- whether a setting has plateaued (plateau_change, plateau_trend);
- a step's seconds and the machine's speed from a run's metrics.jsonl (step_seconds, early_step_seconds).

report.py prints them as tables; `python reproduce/report.py RUN_DIR ...` draws one comparison.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as scipy_stats

from plot import TARGET_FRAC, PlotError, across_seeds, mean_curve, run_up_to, time_to_reach

Runs = list[tuple[list[float], list[float]]]  # each run's (times in seconds, test accuracies), one run a seed


def speedup_of_means(base_runs: Runs, other_runs: Runs, frac: float = TARGET_FRAC) -> float | None:
    """The authors' speed-up on seed-mean curves (mean_curve): the time at which the baseline's mean
    curve first reaches frac x its own peak, over the time the other's first does. None when the other
    never reaches it within its evaluated time; inf when it starts there. A point estimate: near the
    ceiling one seed moves it far (leave_one_out_speedups), and no interval over few seeds is given for it."""
    base_t, base_acc, _ = mean_curve(base_runs)
    other_t, other_acc, _ = mean_curve(other_runs)
    target = frac * max(base_acc)
    t_base, t_other = time_to_reach(base_t, base_acc, target), time_to_reach(other_t, other_acc, target)
    if t_other is None:
        return None
    return math.inf if t_other == 0 else t_base / t_other


def leave_one_out_speedups(base_runs: Runs, other_runs: Runs, frac: float = TARGET_FRAC) -> list[float | None]:
    """speedup_of_means with each seed's pair left out in turn (the i-th runs of both lists): how far a
    single seed moves the authors' number. A sensitivity reading, not an interval."""
    if len(base_runs) != len(other_runs):
        raise PlotError(f"leaving a seed out needs the same seeds in both settings ({len(base_runs)} against {len(other_runs)} runs)")
    keep = [[j for j in range(len(base_runs)) if j != i] for i in range(len(base_runs))]
    return [speedup_of_means([base_runs[j] for j in kept], [other_runs[j] for j in kept], frac) for kept in keep]


def t_interval(values: list[float] | np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """The mean of k values (one per seed, e.g. paired differences) and its t interval:
    mean +- t_{(1 + level) / 2, k - 1} * s / sqrt(k), s the sample standard deviation (ddof 1).
    For differences other - base it is scipy.stats.ttest_rel(other, base).confidence_interval(level).
    Needs k >= 2."""
    values = np.asarray(values, dtype=float)
    k = len(values)
    if k < 2:
        raise PlotError(f"a t interval needs two seeds or more, not {k}")
    mean = float(values.mean())
    half = float(scipy_stats.t.ppf((1 + level) / 2, k - 1) * values.std(ddof=1) / math.sqrt(k))
    return mean, mean - half, mean + half


def paired_differences(base_runs: Runs, other_runs: Runs, times: list[float],
                       level: float = 0.95) -> list[tuple[float, float, float]]:
    """The mean over seeds of (other - baseline) test accuracy at each of `times`, each run's curve
    interpolated there, with its paired t interval (t_interval). The i-th runs of the two lists must be
    the same seed (group_curves orders them so). [(mean, low, high)] per time. Each time is a test of
    its own: a run of them is the reading, not any one."""
    difference = seed_differences(base_runs, other_runs, times)
    return [t_interval(difference[:, j], level) for j in range(len(times))]


def seed_differences(base_runs: Runs, other_runs: Runs, times) -> np.ndarray:
    """Each seed's (other - baseline) test accuracy at `times`, each run's curve interpolated there:
    [seeds, times]. The i-th runs of the two lists must be the same seed."""
    if len(base_runs) != len(other_runs):
        raise PlotError(f"paired differences need the same seeds in both settings ({len(base_runs)} against {len(other_runs)} runs)")
    return (np.array([np.interp(times, t, a) for t, a in other_runs])
            - np.array([np.interp(times, t, a) for t, a in base_runs]))


def mean_accuracy(run: tuple[list[float], list[float]], horizon: float) -> float:
    """A run's mean test accuracy over training seconds [0, horizon]: the area under its accuracy
    curve (linear between evaluations, as np.interp reads it) over the horizon. One number per run
    that uses every checkpoint, where a time to a target near the ceiling uses one."""
    if run[0][-1] < horizon:
        raise PlotError(f"a run that ends at {run[0][-1] / 60:.1f} min has no mean accuracy up to {horizon / 60:.1f} min")
    times, accuracies = run_up_to(run, horizon)
    grid = np.array([0.0] + [t for t in times if 0 < t < horizon] + [horizon])
    heights = np.interp(grid, times, accuracies)
    return float(np.sum((heights[1:] + heights[:-1]) / 2 * np.diff(grid)) / horizon)  # the trapezoid rule


def mean_accuracy_difference(base_runs: Runs, other_runs: Runs, horizon: float, level: float = 0.95) -> dict:
    """The paired difference in mean accuracy over [0, horizon] (mean_accuracy, other - baseline), its
    mean over seeds with a t interval (t_interval), the number of seeds where the other is higher,
    and the two-sided sign test of that count (scipy.stats.binomtest, ties left out)."""
    if len(base_runs) != len(other_runs):
        raise PlotError(f"a paired difference needs the same seeds in both settings ({len(base_runs)} against {len(other_runs)} runs)")
    differences = np.array([mean_accuracy(o, horizon) - mean_accuracy(b, horizon) for b, o in zip(base_runs, other_runs)])
    mean, low, high = t_interval(differences, level)
    higher, lower = int((differences > 0).sum()), int((differences < 0).sum())
    sign_p = float(scipy_stats.binomtest(higher, higher + lower).pvalue) if higher + lower else 1.0
    return {"mean": mean, "low": low, "high": high, "higher": higher, "seeds": len(differences),
            "sign_p": sign_p, "differences": differences.tolist(), "level": level}


def seed_speedups(base_runs: Runs, other_runs: Runs, target: float) -> list[tuple[float, float]]:
    """Each seed's own speed-up at an accuracy target, the baseline's first time at it over the other
    setting's in the same seed, as bounds (low, high) on the ratio: (r, r) when both reach it; when
    only one does, what the other run's end says: the other never, so its time is past its last time
    H and the ratio below t_base / H: (0, t_base / H); the baseline never: above H_base / t_other,
    (H_base / t_other, inf); neither: (0, inf), nothing known. A seed that never reaches is never a number."""
    bounds = []
    for (base_t, base_acc), (other_t, other_acc) in zip(base_runs, other_runs, strict=True):
        t_base, t_other = time_to_reach(base_t, base_acc, target), time_to_reach(other_t, other_acc, target)
        if t_base is None and t_other is None:
            bounds.append((0.0, math.inf))
        elif t_other is None:
            bounds.append((0.0, t_base / other_t[-1]))
        elif t_other == 0:
            bounds.append((1.0, 1.0) if t_base == 0 else (math.inf, math.inf))
        elif t_base is None:
            bounds.append((base_t[-1] / t_other, math.inf))
        else:
            bounds.append((t_base / t_other, t_base / t_other))
    return bounds


def order_statistic_ranks(k: int, level: float = 0.95) -> tuple[int, int, float]:
    """The distribution-free interval for the median of k values: the 1-based ranks (j, k + 1 - j) of
    the sorted values whose span covers the median with probability 1 - 2 P(Binomial(k, 1/2) <= j - 1),
    whatever the values' distribution; j the largest whose coverage is >= level. Returns the ranks and
    that coverage. k = 6: (1, 6), [min, max], 1 - 2 / 64 = 0.969; k = 10: (2, 9), 0.979. Below 6 values
    no ranks reach 95%: (1, k) with its lower coverage (k = 5: 0.938)."""
    def coverage(j: int) -> float:
        return float(1 - 2 * scipy_stats.binom.cdf(j - 1, k, 0.5))
    j = max((j for j in range(1, k // 2 + 1) if coverage(j) >= level), default=1)
    return j, k + 1 - j, coverage(j)


def median_interval(bounds: list[tuple[float, float]], level: float = 0.95) -> dict:
    """The median of k seeds' values and its distribution-free interval (order_statistic_ranks), where
    each value is known as bounds (low, high) (seed_speedups: exact values have low = high). The i-th
    smallest of the true values lies between the i-th smallest low and the i-th smallest high, so the
    median and the interval's ends are given as such bounds: a censored seed widens them only where
    it could change the rank. Returns median_low, median_high, low (the interval's lower end, the
    j-th smallest low), high ((k + 1 - j)-th smallest high), the ranks and the coverage."""
    k = len(bounds)
    if k == 0:
        raise PlotError("a median needs one seed or more")
    lows, highs = sorted(b[0] for b in bounds), sorted(b[1] for b in bounds)
    middle = [(k - 1) // 2, k // 2]  # 0-based: one middle value, or the two of an even k (their mean)
    j, upper_rank, coverage = order_statistic_ranks(k, level)
    return {"median_low": float(np.mean([lows[i] for i in middle])), "median_high": float(np.mean([highs[i] for i in middle])),
            "low": lows[j - 1], "high": highs[upper_rank - 1], "ranks": (j, upper_rank), "coverage": coverage, "level": level}


def paired_speedup(base_runs: Runs, other_runs: Runs, frac: float = TARGET_FRAC, level: float = 0.95) -> dict:
    """The speed-up seed by seed: each seed's own ratio (seed_speedups) to the authors' target, frac x
    the peak of the baseline's seed-mean curve, and their median with its exact distribution-free
    interval (median_interval). Also how many seeds favour the other setting (ratio surely above 1)
    and the baseline (surely below 1), and the two-sided sign test of those counts (ties left out).

    A seed whose runs all ran on a machine k times slower has every time scaled by k and its ratio
    unchanged, where the seed-mean curves of speedup_of_means mix fast and slow seeds minute by minute.
    Each seed's two runs are read up to the shorter one's end, so that a ratio compares times both
    were observed for (a slower machine scales that end too)."""
    if len(base_runs) != len(other_runs):
        raise PlotError(f"a speed-up seed by seed needs the same seeds in both settings ({len(base_runs)} against {len(other_runs)} runs)")
    ends = [min(base[0][-1], other[0][-1]) for base, other in zip(base_runs, other_runs)]  # each pair: its shorter run's end
    base_runs = [run_up_to(run, end) for run, end in zip(base_runs, ends)]
    other_runs = [run_up_to(run, end) for run, end in zip(other_runs, ends)]
    target = frac * max(mean_curve(base_runs)[1])
    seeds = seed_speedups(base_runs, other_runs, target)
    # surely faster or slower: a censored bound is strict (never reached by the end: the time is past it)
    favour = sum(low > 1 or (low == 1 < high) for low, high in seeds)
    against = sum(high < 1 or (low < 1 == high) for low, high in seeds)
    sign_p = float(scipy_stats.binomtest(favour, favour + against).pvalue) if favour + against else 1.0
    return {**median_interval(seeds, level), "seeds": seeds, "target": target, "favour": favour, "against": against,
            "sign_p": sign_p}


def common_minutes(groups: dict[str, list[tuple[list[float], list[float]]]]) -> int:
    """The last whole minute of training that every run reached (its last evaluation or after)."""
    return int(min(t[-1] for runs in groups.values() for t, _ in runs) // 60)


def last_minutes(runs: list[tuple[list[float], list[float]]], span: int) -> tuple[list[int], list[float]]:
    """The last `span` + 1 whole minutes that every run reached (fewer if they trained less), and the
    seed-mean accuracy at each: what the plateau readings below look at."""
    last = common_minutes({"": runs})
    minutes = list(range(max(0, last - span), last + 1))
    return minutes, across_seeds(runs, [60.0 * k for k in minutes])[0]


def plateau_change(runs: list[tuple[list[float], list[float]]], checkpoints: int = 2) -> tuple[int, int, float]:
    """Whether a setting has plateaued: its seed-mean accuracy at the last `checkpoints` + 1 whole
    minutes that all its runs reached, and how far it moved among them (max - min). Returns (the
    first and last of those minutes, the change). The reproduction's plateau rule: a change below 0.02."""
    minutes, means = last_minutes(runs, checkpoints)
    return minutes[0], minutes[-1], max(means) - min(means)


def plateau_trend(runs: list[tuple[list[float], list[float]]], minutes: int = 5) -> tuple[int, int, float, float]:
    """A steadier plateau reading than plateau_change, whose max - min of three noisy points grows with
    the checkpoint noise: the least-squares line through the seed-mean accuracy at the last `minutes` + 1
    whole minutes. Returns (first and last minute, the change the line makes over them, the spread of
    the points around it). A rising curve has a change well above the spread; a plateau, one within it."""
    times, means = last_minutes(runs, minutes)
    first, last = times[0], times[-1]
    if len(times) < 3:
        return first, last, means[-1] - means[0], 0.0
    slope, intercept = np.polyfit(times, means, 1)
    residuals = np.array(means) - (slope * np.array(times) + intercept)
    return first, last, float(slope * (last - first)), float(np.sqrt(np.sum(residuals**2) / (len(times) - 2)))


def step_seconds(row: dict) -> float:
    """A step's generation + update seconds (train.py's elapsed_s sums whole steps: these, and the
    scoring and selection between them)."""
    return row["generation_s"] + row["update_s"]


SLOW_MACHINE = 1.25  # a run whose steps 2-6 took this many times its setting's median ran on a slower machine


def early_step_seconds(rows: list[dict]) -> float:
    """The median generation + update seconds of steps 2-6 (metrics.jsonl rows): the machine's speed,
    as before any run has learned every run of a setting writes ~max-new-tokens (step 1 warms up)."""
    return float(np.median([step_seconds(r) for r in rows[1:6] or rows]))
