"""The reference clock: training time as one machine would have taken it, for runs trained on others.

A wall-clock comparison needs every run on one idle machine, and the machine this reproduction ran
on was shared: its speed drifted, and later seeds ran on slower ones (README.md here). The clock
times every step of a run as the reference runs' machine took such a step: per setting, a step's
seconds are a least-squares line in what makes steps of one setting differ (the mean completion
length and the share of completions cut at max-new-tokens), fit on the reference runs' metrics.jsonl.
report.py --reference-runs reads every run's curve on it, and cpu_reproduction.sh CLOCK=reference
trains a run to a budget of its minutes (ReferenceClock.steps_left).

The clock's minutes are modelled, not measured: the line explains 46-81% of the reference steps'
variance, and pricing a step by its completions' length favours a run that learns early (its
completions shorten sooner). PRICINGS lists the other ways to price a step that report.py reads the
comparison on, to show how much of a speed-up the pricing makes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import eval as evaluation  # eval.py; `eval` is a builtin name
from plot import PlotError, label_of, read_metrics
from stats import step_seconds


PRICINGS = {
    "line": "each step by the line in its completion length and truncated share (the reference clock)",
    "constant": "each step of a setting at that setting's mean reference step (first step: its mean first step)",
    "steps": "every step of every setting at 1 s: training steps, not time",
}


class ReferenceClock:
    """Training time as the reference runs' machine would have taken it, to compare runs trained on
    machines of different speeds (a wall-clock comparison needs one idle machine; a shared one drifts).

    Per setting (label_of), a step's seconds are a least-squares line in what makes steps of one
    setting differ, its mean completion length and its share of completions cut at max-new-tokens
    (features), fit on the reference runs' metrics.jsonl from their second step on; the first step,
    which warms up, counts their mean first step. elapsed() sums them over a run's own rows.
    pricing (PRICINGS) prices steps otherwise, for reading how much the line itself decides."""

    def __init__(self, run_dirs: list[Path], pricing: str = "line"):
        if pricing not in PRICINGS:
            raise PlotError(f"pricing {pricing!r} is not one of {', '.join(PRICINGS)}")
        self.pricing = pricing
        self.reference: list[tuple[str, list[dict]]] = []  # (label, metrics rows) of each reference run
        for run in run_dirs:
            config, rows = evaluation.run_config(run), read_metrics(run)
            if not config or not rows:
                raise PlotError(f"reference run {run} has no config.json or no metrics.jsonl: pass trained runs")
            self.reference.append((label_of(config), rows))
        rows_by_label: dict[str, list[list[dict]]] = {}
        for label, rows in self.reference:
            rows_by_label.setdefault(label, []).append(rows)
        self.first: dict[str, float] = {}
        self.line: dict[str, np.ndarray] = {}
        self.fit: dict[str, tuple[int, float]] = {}
        self.mean_step: dict[str, float] = {}  # the reference runs' mean step after their first
        self.max_step: dict[str, float] = {}  # and the costliest of them on the line (long, truncated completions)
        for label, runs in rows_by_label.items():
            later = [row for rows in runs for row in rows[1:]]
            if len(later) < 10:
                raise PlotError(f"the reference runs of {label} have {len(later)} steps after their first; a clock needs more")
            x, y = np.array([self.features(r) for r in later]), np.array([step_seconds(r) for r in later])
            self.line[label] = np.linalg.lstsq(x, y, rcond=None)[0]
            self.first[label] = float(np.mean([step_seconds(rows[0]) for rows in runs]))
            self.mean_step[label] = float(y.mean())
            self.max_step[label] = float((x @ self.line[label]).max())
            residual, spread = y - x @ self.line[label], float(((y - y.mean()) ** 2).sum())
            self.fit[label] = (len(runs), 1 - float(residual @ residual) / spread if spread > 0 else 1.0)  # R^2

    @staticmethod
    def features(row: dict) -> list[float]:
        return [1.0, row["completion_len"], row["truncated_frac"]]

    def setting(self, label: str) -> str:
        """The reference setting that times a run of `label`: its own, or, for another selection rule at the
        same n and m (the rules ablation), max-variance's. A rule changes which m of the n rollouts are
        updated, not how many, so a step does the same work; how long its completions are, which the rules
        do change, is in the features."""
        same_work = label.replace(label.split(" ")[1], "max_variance", 1) if label.startswith("PODS ") else label
        for setting in (label, same_work):
            if setting in self.line:
                return setting
        raise PlotError(f"no reference runs of {label} (the reference runs are {', '.join(self.line)}): pass some to --reference-runs")

    def costs(self, label: str, rows: list[dict]) -> list[float]:
        """Seconds of each of a run's steps (rows from step 1) on the reference clock."""
        setting = self.setting(label)
        if [r["step"] for r in rows] != list(range(1, len(rows) + 1)):
            raise PlotError("its metrics.jsonl rows do not hold every step from 1 on, so the reference clock cannot time them")
        if self.pricing == "steps":
            return [1.0] * len(rows)
        if self.pricing == "constant":
            return ([self.first[setting]] + [self.mean_step[setting]] * (len(rows) - 1)) if rows else []
        return ([self.first[setting]] + [float(self.line[setting] @ self.features(r)) for r in rows[1:]]) if rows else []

    def elapsed(self, label: str, rows: list[dict]) -> list[float]:
        """Seconds of training on the reference clock at the end of each of a run's steps (rows from step 1)."""
        return np.cumsum(self.costs(label, rows)).tolist()

    def at_steps(self, run: Path, label: str, steps: list[int]) -> list[float]:
        """The reference-clock time at each of a run's (of setting `label`) steps (0: the base model, time 0)."""
        rows = read_metrics(run)
        try:
            times = [0.0] + self.elapsed(label, rows)
        except PlotError as e:
            raise PlotError(f"{run}: {e}") from None
        if max(steps, default=0) > len(rows):
            raise PlotError(f"{run} was evaluated at step {max(steps)}, past its metrics.jsonl's last ({len(rows)})")
        return [times[k] for k in steps]

    def steps_left(self, label: str, rows: list[dict], seconds: float) -> int:
        """How many more steps a run of setting `label` with these metrics.jsonl rows (none: not started)
        should train to reach `seconds` on the clock, 0 when it has. The time left is divided by the clock's
        cost of the run's last 10 steps and rounded down, but at least 1: trained in chunks of it (train.py
        --steps N --resume), a run ends about a step past `seconds` (less, unless its later steps cost more
        than its last 10), in a few chunks. Before a run has any steps past its first, the divisor is the reference
        runs' costliest step, not their mean: a run that learns later than they did has costlier steps (long,
        truncated completions), and a first chunk at the mean took one such run 4.5 minutes past 20."""
        costs, setting = self.costs(label, rows), self.setting(label)
        if not rows:  # the first step warms up
            return 1 + max(0, int((seconds - self.first[setting]) // self.max_step[setting]))
        done = sum(costs)
        if done >= seconds:
            return 0
        recent = costs[1:][-10:]
        cost = float(np.mean(recent)) if recent else self.max_step[setting]  # only its first step: as if not started
        return max(1, int((seconds - done) // max(cost, 1e-9)))

    def describe(self) -> list[str]:
        """How well the clock fits, and how well it reproduces the reference runs' own clocks."""
        lines = [f"reference clock: each step timed as the reference runs' machine took such a step "
                 f"({len(self.reference)} runs; a line in completion length and truncated share, per setting)"
                 + ("" if self.pricing == "line" else f"; here priced otherwise: {PRICINGS[self.pricing]}")]
        for label, (runs, r2) in self.fit.items():
            ratios = [self.elapsed(label, rows)[-1] / rows[-1]["elapsed_s"] for other, rows in self.reference if other == label]
            lines.append(f"  {label:<34} {runs} runs, step-time R^2 {r2:.2f}; each run's whole time on the clock "
                         f"over its own: {min(ratios):.3f}-{max(ratios):.3f}")
        return lines


