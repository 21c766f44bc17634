"""The CPU reproduction's report: the paper's figure and speed-up table, and the statistics beside them.

What `python eval.py --plot` prints for your runs (plot.py: the time to 0.99 x the baseline's peak,
on seed-mean curves) is one number per setting. The reproduction (README.md here) adds how far
that number moves between seeds (stats.py), whether the baseline has plateaued, what a step cost
each run, when each run started to learn, and, with --reference-runs, every run timed on the
reference clock (reference_clock.py): one table each. cpu_reproduction.sh's report stage draws every
comparison with it (STAGES=report bash reproduce/cpu_reproduction.sh); one comparison by hand:

    python reproduce/report.py reproduce/cpu-plateau/grpo-n8-s[0-3] reproduce/cpu-plateau/pods-n8-m4-s[0-3] \\
        --dataset arith:2 --out /tmp/equal_rollouts.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's results.py and plot.py, wherever this runs from

from results import results_name
from plot import (
    TARGET_FRAC, PlotError, across_seeds, compare, draw, mean_curve, read_metrics, speedup_table, trailing_mean)
from reference_clock import ReferenceClock
from stats import (
    SLOW_MACHINE, common_minutes, early_step_seconds, leave_one_out_speedups, mean_accuracy, mean_accuracy_difference,
    paired_differences, paired_speedup, plateau_change, plateau_trend, speedup_of_means)

# ----------------------------------------------------------------------------- the tables


def paired_labels(groups: dict[str, list], seeds: dict[str, list[int]], baseline: str) -> list[str]:
    """The settings run with the baseline's seeds, so that their runs pair with its seed by seed."""
    return [label for label in groups if label != baseline and seeds.get(label) == seeds.get(baseline)]


def ratio_text(low: float, high: float) -> str:
    """A speed-up known as bounds (stats.seed_speedups, stats.median_interval): "1.44x" when exact,
    "> 1.20x" or "< 0.80x" when a seed never reached the target, "never reached" when neither did."""
    if low == high:
        return f"{low:.2f}x"
    if low == 0 and math.isinf(high):
        return "neither reached"
    if math.isinf(high):
        return f"> {low:.2f}x"
    return f"< {high:.2f}x" if low == 0 else f"{low:.2f}-{high:.2f}x"


def interval_text(low: float, high: float) -> str:
    """An interval for a speed-up: an end that a never-reaching seed leaves open (0 or inf) reads "open"."""
    def end(x: float) -> str:
        return "open" if x == 0 or math.isinf(x) else f"{x:.2f}"
    return f"[{end(low)}, {end(high)}]"


def mean_accuracy_lines(groups: dict[str, list[tuple[list[float], list[float]]]], seeds: dict[str, list[int]], baseline: str,
                        horizon: float) -> list[str]:
    """Each paired setting's mean test accuracy over the horizon (stats.mean_accuracy: the area under
    its curve over the horizon) against the baseline's, seed by seed: the mean difference with its 95%
    t interval, how many seeds the setting is higher in, and the sign test of that count. None for one seed."""
    if len(groups[baseline]) < 2:  # a t interval needs two seeds
        return []
    lines = [f"mean test accuracy over 0-{horizon / 60:.1f} min (area under the curve / horizon), difference from {baseline} "
             f"seed by seed: mean [95% t interval over seeds]; seeds higher; two-sided sign test",
             f"{'run':<36}{baseline:>14}{'this run':>10}{'difference':>26}{'seeds higher':>14}{'sign p':>8}"]
    base_mean = float(np.mean([mean_accuracy(run, horizon) for run in groups[baseline]]))
    for label in paired_labels(groups, seeds, baseline):
        d = mean_accuracy_difference(groups[baseline], groups[label], horizon)
        other_mean = float(np.mean([mean_accuracy(run, horizon) for run in groups[label]]))
        difference, higher = f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]", f"{d['higher']} of {d['seeds']}"
        lines.append(f"{label:<36}{base_mean:>14.3f}{other_mean:>10.3f}{difference:>26}{higher:>14}{d['sign_p']:>8.3f}")
    return lines


def seed_statistics(groups: dict[str, list[tuple[list[float], list[float]]]], seeds: dict[str, list[int]], baseline: str) -> list[str]:
    """The paired accuracy difference (setting - baseline, same seeds) at every whole minute that all
    runs reached, mean over seeds with its 95% t interval (stats.paired_differences), and the minutes
    whose interval lies above or below zero. Each minute is a test of its own: read the run of them."""
    paired = paired_labels(groups, seeds, baseline)
    if not paired or len(groups[baseline]) < 2:  # a t interval needs two seeds
        return []
    minutes = list(range(1, common_minutes(groups) + 1))
    lines = [f"paired accuracy difference from {baseline} (same seeds) at each minute, mean [95% t interval over seeds]",
             f"{'run':<36}" + "".join(f"{f'{k} min':>22}" for k in minutes)]
    for label in paired:
        cells = paired_differences(groups[baseline], groups[label], [60.0 * k for k in minutes])
        lines.append(f"{label:<36}" + "".join(f"{f'{m:+.3f} [{lo:+.2f}, {hi:+.2f}]':>22}" for m, lo, hi in cells))
        above = [k for k, (_, lo, _) in zip(minutes, cells) if lo > 0]
        below = [k for k, (_, _, hi) in zip(minutes, cells) if hi < 0]
        lines.append(f"  interval above zero at {len(above)} of {len(minutes)} minutes ({', '.join(map(str, above)) or 'none'}), "
                     f"below zero at {len(below)} ({', '.join(map(str, below)) or 'none'})")
    return lines


SENSITIVITY_FRACS = (0.8, 0.9, 0.95, TARGET_FRAC)


def speedup_by_target(groups: dict[str, list[tuple[list[float], list[float]]]], seeds: dict[str, list[int]], baseline: str,
                      fracs: tuple[float, ...] = SENSITIVITY_FRACS) -> list[str]:
    """The authors' speed-up on seed-mean curves (stats.speedup_of_means) at several targets (shares of
    the baseline's peak), a point estimate with no interval: near the ceiling a checkpoint's noise decides
    which run first reaches 0.99 x a peak that is itself the highest of noisy checkpoints. For settings
    paired with the baseline, the range it takes when any one seed is left out (stats.leave_one_out_speedups)."""
    def speed(x: float | None) -> str:
        return "never" if x is None else f"{x:.2f}x"

    lines = [f"speed-up on seed-mean curves (the authors' rule) by target (a share of {baseline}'s peak): a point estimate, "
             f"no interval; (min-max leaving one seed out)",
             f"{'run':<36}" + "".join(f"  {f'{frac:g} x peak':>30}" for frac in fracs)]
    paired = paired_labels(groups, seeds, baseline)
    for label, runs in groups.items():
        if label == baseline:
            continue
        cells = []
        for frac in fracs:
            cell = speed(speedup_of_means(groups[baseline], runs, frac))
            if label in paired and len(runs) > 2:
                left_out = leave_one_out_speedups(groups[baseline], runs, frac)
                reached = [x for x in left_out if x is not None]
                never = len(left_out) - len(reached)
                span = f"{min(reached):.2f}-{max(reached):.2f}" if reached else ""
                cell += f" ({span}{', ' if span and never else ''}{f'{never} never' if never else ''})"
            cells.append(cell)
        lines.append(f"{label:<36}" + "".join(f"  {cell:>30}" for cell in cells))
    return lines


def paired_speedup_by_target(groups: dict[str, list[tuple[list[float], list[float]]]], seeds: dict[str, list[int]],
                             baseline: str, fracs: tuple[float, ...] = SENSITIVITY_FRACS) -> list[str]:
    """The speed-up seed by seed (stats.paired_speedup) for the settings run with the baseline's seeds:
    the median of the seeds' own ratios with its exact distribution-free interval (order statistics, its
    coverage printed), the seeds favouring each setting with the sign test, and each seed's ratio. A
    machine that ran one seed's runs slower than another's does not move these."""
    paired = paired_labels(groups, seeds, baseline)
    if not paired:
        return []
    lines = [f"speed-up seed by seed (each seed's {baseline} time to the target over its own), median over seeds "
             f"[distribution-free interval from order statistics, its coverage]; an end a never-reaching seed leaves open reads 'open'",
             f"{'run':<36}" + "".join(f"  {f'{frac:g} x peak':>32}" for frac in fracs)]
    for label in paired:
        speedups = [paired_speedup(groups[baseline], groups[label], frac) for frac in fracs]
        cells = [f"{ratio_text(p['median_low'], p['median_high'])} {interval_text(p['low'], p['high'])} {p['coverage']:.1%}"
                 for p in speedups]
        lines.append(f"{label:<36}" + "".join(f"  {cell:>32}" for cell in cells))
        counts = [f"{p['favour']} / {p['against']}, p = {p['sign_p']:.3f}" for p in speedups]
        lines.append(f"{'  seeds faster / slower, sign p':<36}" + "".join(f"  {count:>32}" for count in counts))
        for frac, p in zip(fracs, speedups):
            ratios = "  ".join(f"{seed}: {ratio_text(*bounds)}" for seed, bounds in zip(seeds[label], p["seeds"]))
            lines.append(f"  seeds at {frac:g} x peak: {ratios}")
    return lines


def accuracy_by_minute(groups: dict[str, list[tuple[list[float], list[float]]]]) -> list[str]:
    """Each setting's accuracy at every whole minute that all runs of every setting reached (each run's curve
    interpolated there, then the mean and standard error over its seeds), and the peak of the mean curve."""
    minutes = range(common_minutes(groups) + 1)
    lines = [f"{'run':<36}{'seeds':>6}" + "".join(f"{f'{k} min':>16}" for k in minutes) + f"{'peak':>8}"]
    for label, runs in groups.items():
        cells = [f"{mean:.3f} +- {se:.3f}" for mean, se in zip(*across_seeds(runs, [60 * k for k in minutes]))]
        lines.append(f"{label:<36}{len(runs):>6}" + "".join(f"{c:>16}" for c in cells) + f"{max(mean_curve(runs)[1]):>8.3f}")
    return lines



def learning_onsets(run_dirs: list[Path], threshold: float = 0.5, window: int = 3) -> list[str]:
    """When each run started to learn, from metrics.jsonl alone, to tell seeds that learn late from
    seeds that never learn: the first training minute at which train accuracy (the mean over the
    last `window` steps) reached `threshold`, the share of completions cut at --max-new-tokens over
    the first `window` steps, at that moment and over the last 10% of steps, and the train accuracy then."""
    lines = [f"{'run':<28}{'onset min':>10}{'truncated: start -> onset -> end':>34}{'end accuracy':>14}"]
    for run in run_dirs:
        rows = read_metrics(run)
        if not rows or not {"accuracy", "truncated_frac"} <= rows[0].keys():
            continue
        accuracy, truncated = (trailing_mean([r[key] for r in rows], window) for key in ("accuracy", "truncated_frac"))
        onset = next((i for i, a in enumerate(accuracy) if i >= window - 1 and a >= threshold), None)  # a whole window
        tenth = max(1, len(rows) // 10)
        start, end = (float(np.mean([r["truncated_frac"] for r in part])) for part in (rows[:window], rows[-tenth:]))
        at_onset = "-" if onset is None else f"{truncated[onset]:.2f}"
        when = "never" if onset is None else f"{rows[onset]['elapsed_s'] / 60:.1f}"
        final = float(np.mean([r["accuracy"] for r in rows[-tenth:]]))
        lines.append(f"{run.name:<28}{when:>10}{f'{start:.2f} -> {at_onset} -> {end:.2f}':>34}{final:>14.2f}")
    return lines if len(lines) > 1 else []



def step_costs(run_dirs: list[Path]) -> list[str]:
    """What a step cost in each run (means over its metrics.jsonl): the time side of the comparison.

    `steps 2-6 s` (early_step_seconds) reads the machine's speed: a run whose steps 2-6
    took longer than the other runs doing the same work (`x median`, over the runs given that generate
    n and update m rollouts a step with the same --uniform-groups, whatever their rule: a rules ablation's single run is read against
    max-variance's seeds) ran on a slower or busier machine; above SLOW_MACHINE it is marked, as its
    minutes are not those of the other runs (a wall-clock comparison needs the same idle machine)."""
    costs = []
    for run in run_dirs:
        rows = read_metrics(run)
        if rows:
            config = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
            work = (config["n"], config["m"], config.get("uniform_groups", "keep")) if config else run.name  # m = n for GRPO
            generation, update = (float(np.mean([r[k] for r in rows])) for k in ("generation_s", "update_s"))
            early = early_step_seconds(rows)
            costs.append((run.name, work, len(rows), generation, update, rows[-1]["elapsed_s"] / len(rows), early))
    if not costs:
        return []
    medians = {work: float(np.median([c[-1] for c in costs if c[1] == work])) for work in {c[1] for c in costs}}
    lines = [f"{'run':<28}{'steps':>7}{'generation s':>14}{'update s':>10}{'step s':>8}{'steps 2-6 s':>13}{'x median':>10}"]
    for name, work, steps, generation, update, step, early in costs:
        ratio = early / medians[work]
        lines.append(f"{name:<28}{steps:>7}{generation:>14.1f}{update:>10.1f}{step:>8.1f}{early:>13.1f}{ratio:>10.2f}"
                     + ("  slower machine" if ratio > SLOW_MACHINE else ""))
    return lines




# ----------------------------------------------------------------------------- the report


def report(run_dirs: list[Path], out: Path, results_file: str | None, baseline: str | None, frac: float = TARGET_FRAC,
           reference: list[Path] | None = None) -> str:
    """Draw plot.py's figure into `out` and return the report's tables. With `reference` (runs), every
    time is on the reference clock fit on them, but the step costs' and learning onsets', each run's own."""
    clock = ReferenceClock(reference) if reference else None
    comparison = compare(run_dirs, results_file, baseline, clock)
    draw(comparison, out, frac, "training time (minutes)" if clock is None else "training time on the reference clock (minutes)")
    baseline, groups, seeds, precisions = comparison.baseline, comparison.groups, comparison.seeds, comparison.precisions
    lines = ([] if clock is None else clock.describe()) + [
        f"every run is read up to the shortest run's end, {comparison.horizon / 60:.1f} min" + ("" if clock is None else " on the reference clock")
        + " (seed by seed: each seed's two runs up to the shorter one's end)"
        + ("" if clock is None else "; every time below is on the reference clock (the step-cost and learning-onset tables: each run's own)")]
    if len(set(precisions.values())) > 1:  # named only when seeds differ: each seed's runs share one (group_curves)
        for precision in sorted(set(precisions.values())):
            lines.append(f"seeds {', '.join(str(s) for s, p in precisions.items() if p == precision)}: {precision}")
    lines += ["", *speedup_table(comparison, frac)]
    first, last, change = plateau_change(groups[baseline])
    lines.append(f"{baseline}'s seed mean moved {change:.3f} over its last whole minutes ({first}-{last} min): "
                 + ("a plateau by the rule (< 0.02)" if change < 0.02 else "still moving (the plateau rule is < 0.02)"))
    first, last, trend, spread = plateau_trend(groups[baseline])
    lines.append(f"{baseline}'s seed mean, least-squares line over minutes {first}-{last}: {trend:+.3f} "
                 f"(points scatter {spread:.3f} around it)")
    costs, onsets = step_costs(run_dirs), learning_onsets(run_dirs)
    paired = paired_speedup_by_target(comparison.whole, seeds, baseline)  # (each pair cut to its own shorter run)
    averages, minutes = mean_accuracy_lines(groups, seeds, baseline, comparison.horizon), seed_statistics(groups, seeds, baseline)
    return "\n".join(lines + ["", "test accuracy (mean +- standard error over seeds)", *accuracy_by_minute(groups)]
                     + ([""] + averages if len(averages) > 2 else []) + ([""] + minutes if minutes else [])
                     + ["", *speedup_by_target(groups, seeds, baseline)]
                     + ([""] + paired if paired else []) + ([""] + costs if costs else [])
                     + (["", "when each run started to learn (train accuracy over 3 steps first >= 0.5)", *onsets] if onsets else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    home = os.path.expanduser  # a path's leading "~", as eval.py: the shell leaves "--out=~/f.png" as typed
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", type=home, help="evaluated runs (python eval.py RUN_DIR) of two settings or more")
    parser.add_argument("--dataset", default=None, help="whose evaluation to read, as eval.py's --dataset [each run's only eval-*.json]")
    parser.add_argument("--out", default="accuracy_vs_time.png", type=home, help="figure PNG")
    parser.add_argument("--baseline", default=None, help="label of the baseline curve [the GRPO run]")
    parser.add_argument("--target-frac", type=float, default=TARGET_FRAC,
                        help="speed-up target, a share of the baseline's peak accuracy; 1 = the peak itself [0.99, the authors']")
    parser.add_argument("--reference-runs", nargs="+", metavar="RUN_DIR", default=None, type=home,
                        help="time every step as these runs' machine took such a step (per setting, fit on "
                             "their metrics.jsonl), not by each run's own clock: for runs trained on machines of different speeds")
    args = parser.parse_args(argv)
    try:
        if not 0 < args.target_frac <= 1:
            raise PlotError(f"--target-frac {args.target_frac} must be in (0, 1]: a share of the baseline's peak accuracy")
        results_file = results_name(args.dataset) if args.dataset else None
        print(report([Path(p) for p in args.runs], Path(args.out), results_file, args.baseline, args.target_frac,
                     [Path(p) for p in args.reference_runs] if args.reference_runs else None))
        print(f"figure: {args.out}")
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
