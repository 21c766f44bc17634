"""The CPU reproduction's primary reading: the README's headline figure and the numbers behind its table.

Each of the paper's two comparisons is read once as primary (README.md here, "The primary reading":
which reading, why, and that it was chosen on 27 November 2026, after every result had been seen).
For each comparison given, on the reference clock (reference_clock.py), this prints:

- the paired difference in mean test accuracy over the horizon (the area under each run's curve over
  the horizon), mean over seeds with its 95% t interval, and the seeds where PODS is higher;
- the paired difference at minutes 2, 5 and 10, with t intervals;
- the authors' rule seed by seed: the median of the seeds' own speed-ups to 0.99 x and 0.9 x GRPO's
  peak, with its exact distribution-free interval and coverage;
- the authors' speed-up on seed-mean curves, a point estimate, and its range leaving one seed out;
- the mean-accuracy difference and the seed-by-seed speed-ups again with each step priced otherwise
  (reference_clock.PRICINGS: a constant cost per setting, and plain steps), as a check of how much
  of a difference the clock's pricing makes;

and draws one panel per comparison: each seed's accuracy difference over the minutes (PODS - GRPO)
as a thin line, their mean, and its 95% t interval at each time. cpu_reproduction.sh's report stage
runs it (PLAN=plateau STAGES=report); by hand:

    python reproduce/headline.py --dataset arith:2 --out reproduce/cpu_paired_differences.png \\
        --reference-runs REF_RUN... --comparison "equal rollouts" RUN_DIR... --comparison "equal updates" RUN_DIR...
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's results.py and plot.py, wherever this runs from

from results import results_name
from plot import PlotError, Comparison, compare
from reference_clock import PRICINGS, ReferenceClock
from report import interval_text, ratio_text
from stats import (
    leave_one_out_speedups, mean_accuracy_difference, paired_differences, paired_speedup, seed_differences, speedup_of_means)

MINUTES = (2, 5, 10)  # the fixed minutes at which the paired difference is read
FRACS = (0.99, 0.9)  # the authors' target, and a lower one further from the checkpoint noise at the ceiling


def pair(comparison: Comparison) -> tuple[str, str]:
    """The baseline's label and the one other setting's: a headline comparison is two settings."""
    others = [label for label in comparison.groups if label != comparison.baseline]
    if len(others) != 1 or comparison.seeds[others[0]] != comparison.seeds[comparison.baseline]:
        raise PlotError(f"a headline comparison is two settings on the same seeds, not {', '.join(comparison.groups)}")
    return comparison.baseline, others[0]


def reading(name: str, comparison: Comparison) -> list[str]:
    """The primary numbers of one comparison, as lines."""
    base, other = pair(comparison)
    b, o, horizon = comparison.groups[base], comparison.groups[other], comparison.horizon
    d = mean_accuracy_difference(b, o, horizon)
    lines = [f"{name}: {other} against {base}, seeds {', '.join(map(str, comparison.seeds[base]))} "
             f"({len(b)}), read to the shortest run's end, {horizon / 60:.1f} min on the reference clock",
             f"  mean accuracy over the horizon, {other} - {base}: {d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] "
             f"(95% t interval), higher in {d['higher']} of {d['seeds']} seeds (sign test p = {d['sign_p']:.3f})"]
    cells = [f"{k} min {m:+.3f} [{lo:+.3f}, {hi:+.3f}]"
             for k, (m, lo, hi) in zip(MINUTES, paired_differences(b, o, [60.0 * k for k in MINUTES])) if 60 * k <= horizon]
    lines.append(f"  paired difference at fixed minutes (95% t intervals): {'; '.join(cells)}")
    for frac in FRACS:
        p = paired_speedup(comparison.whole[base], comparison.whole[other], frac)
        left_out = [x for x in leave_one_out_speedups(b, o, frac) if x is not None]
        means = speedup_of_means(b, o, frac)
        lines.append(f"  to {frac:g} x {base}'s peak, seed by seed: median {ratio_text(p['median_low'], p['median_high'])} "
                     f"{interval_text(p['low'], p['high'])} (order statistics {p['ranks'][0]} and {p['ranks'][1]}, coverage "
                     f"{p['coverage']:.1%}), {p['favour']} of {len(p['seeds'])} seeds faster (sign test p = {p['sign_p']:.3f}); "
                     f"seeds: {', '.join(ratio_text(*s) for s in p['seeds'])}")
        lines.append(f"  to {frac:g} x, on seed-mean curves (the authors' rule, no interval): "
                     + ("never" if means is None else f"{means:.2f}x")
                     + (f", {min(left_out):.2f}x-{max(left_out):.2f}x leaving one seed out" if left_out else ""))
    return lines


def pricing_lines(name: str, run_dirs: list[Path], results_file: str | None, reference: list[Path]) -> list[str]:
    """The comparison read again with each step priced otherwise (reference_clock.PRICINGS): its mean-accuracy
    difference and its seed-by-seed speed-ups, to show what the clock's pricing decides."""
    lines = [f"{name}, each step priced otherwise (reference_clock.PRICINGS):"]
    for pricing in PRICINGS:
        comparison = compare(run_dirs, results_file, None, ReferenceClock(reference, pricing))
        base, other = pair(comparison)
        d = mean_accuracy_difference(comparison.groups[base], comparison.groups[other], comparison.horizon)
        horizon = f"{comparison.horizon:.0f} steps" if pricing == "steps" else f"{comparison.horizon / 60:.1f} min"
        ratios = []
        for frac in FRACS:
            p = paired_speedup(comparison.whole[base], comparison.whole[other], frac)
            means = speedup_of_means(comparison.groups[base], comparison.groups[other], frac)
            ratios.append(f"{frac:g} x: {ratio_text(p['median_low'], p['median_high'])} {interval_text(p['low'], p['high'])}, "
                          f"seed-mean " + ("never" if means is None else f"{means:.2f}x"))
        lines.append(f"  {pricing:<9} to {horizon}: mean accuracy {d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}], "
                     f"higher in {d['higher']} of {d['seeds']}; " + "; ".join(ratios))
    return lines


def draw(panels: list[tuple[str, Comparison]], out: Path) -> None:
    """One panel per comparison: each seed's test-accuracy difference (PODS - GRPO) over the minutes as a
    thin line, the mean over seeds, and its 95% t interval at each time as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.9), sharey=True, squeeze=False)
    for ax, (name, comparison) in zip(axes[0], panels):
        base, other = pair(comparison)
        grid = np.linspace(0, comparison.horizon, 200)
        for seed_difference in seed_differences(comparison.groups[base], comparison.groups[other], grid):
            ax.plot(grid / 60, seed_difference, color="tab:blue", linewidth=0.7, alpha=0.45)
        mean, low, high = np.array(paired_differences(comparison.groups[base], comparison.groups[other], grid)).T
        ax.fill_between(grid / 60, low, high, color="tab:blue", alpha=0.2, linewidth=0, label="95% t interval of the mean")
        ax.plot(grid / 60, mean, color="tab:blue", linewidth=2.2, label="mean over seeds")
        ax.plot([], [], color="tab:blue", linewidth=0.7, alpha=0.45, label="one seed")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_title(f"{name}: {other.replace('max_variance ', '')} - {base}\n{len(comparison.groups[base])} seeds, "
                     f"{comparison.horizon / 60:.1f} min", fontsize=10)
        ax.set_xlabel("training time on the reference clock (modelled minutes)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy, PODS - GRPO (same seed)")
    axes[0][0].legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    home = os.path.expanduser  # a path's leading "~", as eval.py: the shell leaves "--out=~/f.png" as typed
    parser.add_argument("--comparison", nargs="+", action="append", required=True, metavar=("NAME", "RUN_DIR"),
                        help="a comparison's name, then its evaluated runs (two settings, the same seeds; none: it waits); "
                             "once per comparison")
    parser.add_argument("--reference-runs", nargs="+", metavar="RUN_DIR", required=True, type=home,
                        help="the reference clock's runs (report.py --reference-runs)")
    parser.add_argument("--dataset", default=None, help="whose evaluation to read, as eval.py's --dataset [each run's only eval-*.json]")
    parser.add_argument("--out", default="paired_differences.png", type=home, help="figure PNG")
    args = parser.parse_args(argv)
    try:
        waiting = [name for name, *runs in args.comparison if not runs]  # part-way: no evaluated pair yet
        given = [(name, [Path(home(p)) for p in runs]) for name, *runs in args.comparison if runs]  # (NAME shares the flag)
        if not given:
            raise PlotError(f"no runs to read for {', '.join(waiting)}: pass each --comparison its evaluated runs")
        results_file = results_name(args.dataset) if args.dataset else None
        reference = [Path(p) for p in args.reference_runs]
        clock = ReferenceClock(reference)
        panels = [(name, compare(runs, results_file, None, clock)) for name, runs in given]
        lines = [f"{name}: no evaluated runs yet" for name in waiting]
        for (name, comparison), (_, runs) in zip(panels, given):
            lines += [*reading(name, comparison), *pricing_lines(name, runs, results_file, reference), ""]
        draw(panels, Path(args.out))
        print("\n".join(lines) + f"figure: {args.out}")
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
