"""The paper's figure and its speed-up rule: test accuracy over training time, from evaluated runs.

The paper's claim is about time: GRPO-PODS reaches vanilla GRPO's test accuracy at least 1.7x
sooner (Figure 1 / Section 5). This file reads runs that eval.py has evaluated (RUN/eval-DATASET.json)
and measures that with the authors' rule (their scripts/plot.py): the target is 0.99 x the baseline's
peak mean accuracy, and the speed-up is the baseline's first time at the target over the other
run's (--target-frac 1 gives the time to the baseline's peak itself). Runs of one setting (rule, n,
m, --uniform-groups) that differ only in their seed are one curve, their mean with its standard error, and every run
is read up to the shortest run's end. eval.py's command line runs it:

    python eval.py --plot runs/grpo-s0 runs/grpo-s1 runs/pods-s0 runs/pods-s1 --out fig.png
    python eval.py --plot-train runs/pods runs/grpo     # training curves from metrics.jsonl, no evaluation needed

The CPU reproduction's statistics over seeds (t intervals, exact median intervals, plateaus, the
reference clock) build on these curves in reproduce/report.py.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import checkpoint
import run_dir

TARGET_FRAC = 0.99  # the authors' speed-up target: this share of the baseline's peak accuracy


class PlotError(ValueError):
    """Runs that cannot be compared; the message says what to pass instead."""


# ----------------------------------------------------------------------------- time to target


def time_to_reach(times: list[float], accuracies: list[float], target: float) -> float | None:
    """The first time of the curve at which accuracy >= target, or None if it never gets there. The curve's times
    are evaluations; on a mean over seeds (mean_curve), each seed's, the others interpolated there, and the end of
    the window read (up_to), interpolated between the evaluations around it."""
    for t, a in zip(times, accuracies):
        if a >= target - 1e-12:
            return t
    return None


def speedups(curves: dict[str, tuple[list[float], list[float]]], baseline: str,
             frac: float = TARGET_FRAC) -> tuple[float, float, dict[str, float | None]]:
    """The paper's headline, by the authors' rule (scripts/plot.py): the target is frac x the
    baseline's peak accuracy. Returns the peak, the baseline's first time at the target, and each
    other curve's first time at it (None: never reached); speed-up = baseline's time / other's.
    frac = 1 is the time to the peak itself, which a lone lucky checkpoint can decide."""
    times, accs = curves[baseline]
    peak = max(accs)
    target = frac * peak
    t_base = time_to_reach(times, accs, target)
    return peak, t_base, {label: time_to_reach(t, a, target) for label, (t, a) in curves.items() if label != baseline}


# ----------------------------------------------------------------------------- curves over seeds


def label_of(config: dict) -> str:
    """A run's legend label from its config.json: rule, n and m, and --uniform-groups where it is not keep."""
    groups = "" if config.get("uniform_groups", "keep") == "keep" else f" {config['uniform_groups']}"
    if config["rule"] == "none":
        return f"GRPO n={config['n']}{groups}"
    return f"PODS {config['rule']} n={config['n']} m={config['m']}{groups}"


# What may differ between seeds of one setting: the seed, where and on what it ran, and how long it trained and
# how often it saved (the curves are read up to the shortest run; on the reference clock, a run trains to a
# number of steps, reproduce/cpu_reproduction.sh CLOCK=reference)
SEED_FIELDS = {"seed", "out_dir", "resume", "torch", "device", "steps", "time_budget", "save_every_steps", "save_every_minutes",
               "model"}  # (--model as typed: "auto" and "embedded" are one model_resolved, which TASK_FIELDS compares)
PRECISION_FIELDS = {"bf16_autocast", "bf16_weights"}  # may differ between seeds, not within one (run_precision)


def setting_text(config: dict, key: str) -> str:
    """A setting in a message: as written in its file, or "(not set)" where the file has no such key."""
    return json.dumps(config[key]) if key in config else "(not set)"


def run_precision(config: dict, eval_settings: dict) -> str:
    """The arithmetic a run trained and was evaluated in. Seeds may differ in it (a series trained on a CPU
    without bfloat16 arithmetic, in float32), a seed's runs may not: they are compared pair by pair."""
    trained = ("bfloat16 weights" if config.get("bf16_weights") else "bfloat16 autocast" if config.get("bf16_autocast")
               else "float32")
    return f"trained in {trained}, evaluated in {eval_settings.get('precision', 'bfloat16')}"


# The digests in eval.py's settings (results.results_key), named in a message by what they stand for
DIGESTS = {"test_set": " (a digest of the questions and reference answers)", "grader": " (a digest of rewards.py)"}


def setting_change(key: str, first: dict, second: dict) -> str:
    """How an evaluation setting differs between two settings dicts, for a message: `limit 200 against 4`."""
    return f"{key}{DIGESTS.get(key, '')} {setting_text(first, key)} against {setting_text(second, key)}"


def differing_keys(a: dict, b: dict, ignore: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Keys whose values differ between a and b (missing counts as different), sorted."""
    return sorted(k for k in a.keys() | b.keys() if k not in ignore and not same_setting(k, a.get(k), b.get(k)))


def same_setting(key: str, a, b) -> bool:
    """Equal, or for model_resolved two names of one directory: runs begun before 30 November 2026 recorded a local
    --model as typed ("m"), later ones as its absolute path."""
    return a == b or (key == "model_resolved" and isinstance(a, str) and isinstance(b, str) and run_dir.same_path(a, b))


def backend_as_resolved(config: dict) -> dict:
    """A run's settings with --backend as it resolved: before 1 December 2026 train.py recorded "auto", which on a CPU
    is transformers ("hf": vLLM is picked only with a GPU), so that a run of then and one of now compare as alike."""
    return config | {"backend": "hf"} if config.get("backend") == "auto" and config.get("device") == "cpu" else config


def read_json(path: Path, fix: str) -> dict:
    """A run's JSON file (config.json, eval-*.json) as a dict; a damaged one stops with `fix`."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):  # (a directory in its place, no permission)
        found = None
    if not isinstance(found, dict):
        raise PlotError(f"{path} is damaged (not a JSON object); {fix}")
    return found


def read_results(path: Path, fix: str) -> dict:
    """eval.py's results file: JSON with its settings and results; anything else (damaged, another file) stops with `fix`."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):  # (a directory in its place, no permission)
        stored = None
    if not (isinstance(stored, dict) and isinstance(stored.get("settings"), dict) and isinstance(stored.get("results"), list)):
        raise PlotError(f"{path} is not eval.py's results (JSON with settings and results); {fix}")
    for row in stored["results"]:
        if problem := row_problem(row):  # NaN accuracy: a wrong peak
            raise PlotError(f"{path} has a result {problem} (edited, or another tool's); {fix}")
    return stored


def row_problem(row) -> str | None:
    """What makes a row of results unusable ("whose accuracy is not a number"), or None."""
    if not isinstance(row, dict):
        return "that is not a JSON object"
    if not isinstance(row.get("checkpoint"), str):
        return "without a checkpoint name"
    for key, kind in (("step", int), ("elapsed_s", (int, float)), ("accuracy", (int, float))):
        if not checkpoint.is_number(row.get(key), kind):
            return f"whose {key} is not a number"
    return None


# What the settings of one comparison share: the model and the task (other ones are refused), the objective and
# its optimisation, and what sets the clock that a speed-up reads (the machine, the engine and its speed settings;
# the precision is named seed by seed, run_precision). Other values of those are named beside the table: the labels
# show the rule, n, m and --uniform-groups only.
TASK_FIELDS = ("model_resolved", "dataset")
OBJECTIVE_FIELDS = ("prompts_per_step", "max_prompt_tokens", "max_new_tokens", "temperature", "lr", "adam_beta1", "adam_beta2",
                    "weight_decay", "max_grad_norm", "warmup_ratio", "lora_rank", "lora_alpha", "clip_eps", "clip_eps_high", "beta",
                    "tis_cap")
CLOCK_FIELDS = ("device", "world_size", "torch", "backend", "gen_batch", "micro_batch", "gradient_checkpointing", "share_prompt",
                "merged_sampler", "cuda_graph", "gpu_memory_utilization", "vllm_kv_cache_gb", "vllm_enforce_eager", "vllm_sleep")


def check_same_task(run: Path, config: dict, first_run: Path, first: dict) -> None:
    """Refuse a run of another model or task than the first run's: a speed-up compares settings on one model and task.
    Checked as each run is read, before its evaluation's settings: told to evaluate both alike, a user re-evaluated
    them with --force, and was refused this then."""
    for key in TASK_FIELDS:
        if not same_setting(key, config.get(key), first.get(key)):
            raise PlotError(f"{run} ({label_of(config)}) and {first_run} ({label_of(first)}) trained with {key} "
                            f"{setting_text(config, key)} against {setting_text(first, key)}; a speed-up compares settings "
                            f"on one model and task")


def setting_differences(first_config: dict[str, tuple[Path, dict]]) -> list[str]:
    """Each setting's first run against the first setting's (all its runs agree, group_curves; model and task are
    one, check_same_task): the OBJECTIVE_FIELDS and CLOCK_FIELDS that differ, as text."""
    (base_label, (base_run, base)), *others = first_config.items()
    return [f"{key} {setting_text(config, key)} in {label} against {setting_text(base, key)} in {base_label}"
            for label, (run, config) in others for key in OBJECTIVE_FIELDS + CLOCK_FIELDS if config.get(key) != base.get(key)]


def group_curves(run_dirs: list[Path], results_file: str | None, clock=None
                 ) -> tuple[dict[str, list[tuple[list[float], list[float]]]], dict[str, list[int]], dict[int, str], list[str]]:
    """Accuracy curves grouped by label (rule, n, m), each group's runs in the order of their seeds,
    each group's seeds in that order (so the i-th runs of two groups with the same seeds are a pair),
    and each seed's precision (run_precision). Runs of one label must differ only in their seed and
    precision, every run must have been evaluated with the same settings but precision, and a seed's
    runs in one precision. `results_file` names the file each run's evaluation is read from (results.results_name
    of a dataset; None: the run's only eval-*.json). Times are each run's own training seconds, or those
    of `clock.at_steps` (the reproduction's reference clock, reproduce/reference_clock.py). Last, how the settings
    differ beyond their labels (setting_differences)."""
    groups: dict[str, list[tuple[list[float], list[float]]]] = {}
    seeds: dict[str, list[int]] = {}
    precisions: dict[int, tuple[str, Path]] = {}
    first_config: dict[str, tuple[Path, dict]] = {}
    eval_settings: tuple[Path, dict] | None = None
    seen: dict[tuple[str, int], Path] = {}
    for run in run_dirs:
        if not (run / "config.json").exists():
            raise PlotError(f"{run} is not a run directory (no config.json)")
        config = backend_as_resolved(read_json(run / "config.json", "it is the run's settings, written by train.py: copy the run again"))
        if "model_resolved" not in config:  # a model's own config.json
            raise PlotError(f"{run / 'config.json'} is not a training run's (train.py writes model_resolved, rule, n and m there)")
        check_same_task(run, config, *next(iter(first_config.values()), (run, config)))
        files = sorted(run.glob("eval-*.json"))
        if results_file is not None:
            files = [f for f in files if f.name == results_file]
        if results_file is not None and not files:
            raise PlotError(f"{run} has no {results_file}, the results for that --dataset; evaluate it first: "
                            f"python eval.py {run} with that --dataset")
        if not files:
            raise PlotError(f"{run} has no eval-*.json; run `python eval.py {run}` first")
        if len(files) > 1:
            raise PlotError(f"{run} has several results files ({', '.join(f.name for f in files)}); pass --dataset to pick one")
        stored = read_results(files[0], f"evaluate again: python eval.py {run} --force")
        if not any(r.get("step", 0) > 0 for r in stored["results"]):
            raise PlotError(f"{files[0]} holds no evaluated checkpoint (at most the base model); finish it: python eval.py {run}")
        if eval_settings is None:
            eval_settings = (run, stored["settings"])
        elif differing := differing_keys(stored["settings"], eval_settings[1], ignore={"precision"}):
            first_run, first = eval_settings
            values = "; ".join(setting_change(key, stored["settings"], first) for key in differing)
            flags = "".join(f" --{key.replace('_', '-')} {'all' if first.get(key) is None else first[key]}"
                            for key in differing if key not in DIGESTS)
            redo = [run, first_run] if DIGESTS.keys() & set(differing) else [run]  # another grader: both, with this one
            raise PlotError(f"{run} and {first_run} were evaluated with different settings ({values}); evaluate them alike "
                            f"before comparing: {' and '.join(f'python eval.py {r}{flags} --force' for r in redo)}")
        label = label_of(config)
        if label in first_config:
            other, other_config = first_config[label]
            differing = differing_keys(config, other_config, ignore=SEED_FIELDS | PRECISION_FIELDS)
            if differing:
                values = "; ".join(f"{key} {setting_text(config, key)} against {setting_text(other_config, key)}"
                                   for key in differing)
                raise PlotError(f"{run} and {other} are both {label} but differ in more than the seed ({values}); "
                                f"plot them separately")
        first_config.setdefault(label, (run, config))
        seed, precision = config.get("seed", 0), run_precision(config, stored["settings"])
        if (label, seed) in seen:  # the same run twice, or a copy: one seed counted as two
            raise PlotError(f"{run} and {seen[label, seed]} are both seed {seed} of {label}; pass each seed once")
        seen[label, seed] = run
        if precisions.setdefault(seed, (precision, run))[0] != precision:
            other_precision, other = precisions[seed]
            raise PlotError(f"{run} and {other}, both seed {seed}, differ in precision ({precision}; {other_precision}); "
                            f"a seed's runs are compared pair by pair: train and evaluate them alike")
        results = sorted(stored["results"], key=lambda r: r["elapsed_s"])
        times = [r["elapsed_s"] for r in results] if clock is None else clock.at_steps(run, label, [r["step"] for r in results])
        groups.setdefault(label, []).append((times, [r["accuracy"] for r in results]))
        seeds.setdefault(label, []).append(seed)
    order = {label: sorted(range(len(runs)), key=lambda i: seeds[label][i]) for label, runs in groups.items()}
    return ({label: [runs[i] for i in order[label]] for label, runs in groups.items()},
            {label: [seeds[label][i] for i in order[label]] for label in groups},
            {seed: precision for seed, (precision, _) in sorted(precisions.items())}, setting_differences(first_config))


def run_up_to(run: tuple[list[float], list[float]], end: float) -> tuple[list[float], list[float]]:
    """A run's curve up to `end` seconds: its evaluations before it, and its accuracy at `end` (its
    evaluation there, or interpolated between the two around it)."""
    times, accuracies = run
    before = [i for i, t in enumerate(times) if t < end]
    return [times[i] for i in before] + [end], [accuracies[i] for i in before] + [float(np.interp(end, times, accuracies))]


def up_to(groups: dict[str, list[tuple[list[float], list[float]]]], end: float) -> dict[str, list[tuple[list[float], list[float]]]]:
    """Every run up to `end` seconds (run_up_to). The comparison is read in one window, the shortest
    run's, so that no setting's peak, target or first time is read where another setting was never
    observed."""
    return {label: [run_up_to(run, end) for run in runs] for label, runs in groups.items()}


def mean_curve(runs: list[tuple[list[float], list[float]]]) -> tuple[list[float], list[float], list[float]]:
    """Seeds of one setting on a common time grid (linear interpolation, up to the shortest run):
    (times, mean accuracy, standard error)."""
    if len(runs) == 1:
        return runs[0][0], runs[0][1], [0.0] * len(runs[0][0])
    end = min(t[-1] for t, _ in runs)
    grid = sorted({x for t, _ in runs for x in t if x <= end})
    return grid, *across_seeds(runs, grid)


def across_seeds(runs: list[tuple[list[float], list[float]]], times: list[float]) -> tuple[list[float], list[float]]:
    """Each run's accuracy interpolated at `times`, then the mean and standard error over the runs
    (0 for a single run)."""
    stacked = np.array([np.interp(times, t, a) for t, a in runs])
    se = stacked.std(axis=0, ddof=1) / math.sqrt(len(runs)) if len(runs) > 1 else np.zeros(len(times))
    return stacked.mean(axis=0).tolist(), se.tolist()


@dataclass
class Comparison:
    """Runs of several settings read for the figure and the speed-up table."""

    whole: dict[str, list[tuple[list[float], list[float]]]]  # each setting's runs (group_curves), whole
    groups: dict[str, list[tuple[list[float], list[float]]]]  # the same, up to the shortest run's end
    curves: dict[str, tuple[list[float], list[float], list[float]]]  # each setting's mean curve over seeds (mean_curve)
    seeds: dict[str, list[int]]
    precisions: dict[int, str]
    horizon: float  # the shortest run's end, seconds
    baseline: str
    differences: list[str]  # settings that differ beyond the labels (setting_differences)


def compare(run_dirs: list[Path], results_file: str | None, baseline: str | None, clock=None) -> Comparison:
    """The runs grouped by setting and read up to the shortest run's end; the baseline is the one given,
    else the GRPO setting (the one without --uniform-groups skip or refill, DAPO's variants, where there is one)."""
    whole, seeds, precisions, differences = group_curves(run_dirs, results_file, clock)
    horizon = min(t[-1] for runs in whole.values() for t, _ in runs)
    groups = up_to(whole, horizon)
    curves = {label: mean_curve(runs) for label, runs in groups.items()}
    if len(curves) < 2:
        raise PlotError(f"nothing to compare: all runs are {next(iter(curves))}; pass runs of at least two settings")
    if baseline is None:
        grpo = [label for label in curves if label.startswith("GRPO")]
        vanilla = [label for label in grpo if not label.endswith((" skip", " refill"))] or grpo
        if len(vanilla) > 1:
            raise PlotError(f"several GRPO settings ({', '.join(vanilla)}); pass --baseline to name the one to compare with")
        baseline = vanilla[0] if vanilla else None
    if baseline not in curves:
        raise PlotError(f"baseline {baseline!r} is not among the runs ({', '.join(curves)}); pass --baseline")
    return Comparison(whole, groups, curves, seeds, precisions, horizon, baseline, differences)


# ----------------------------------------------------------------------------- figures and the speed-up table


def make_parent(out: Path) -> None:
    """--out's directory, made before any work, so that a path under a file or without permission costs nothing."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # FileExistsError, NotADirectoryError: a file on the way
        raise PlotError(f"--out {out}: cannot make its directory ({err.strerror}); choose another --out") from None
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise PlotError(f"--out {out}: its directory is not writable; choose another --out")


def check_figure_path(out: Path) -> None:
    """Refuse, before any work, a figure path matplotlib would not write as given: a directory, no extension
    (it would add ".png"), or a format it does not know; and make its directory."""
    import matplotlib.figure

    formats = set(matplotlib.figure.Figure().canvas.get_supported_filetypes()) - {"pgf"}  # pgf needs a LaTeX install
    if out.is_dir():
        raise PlotError(f"--out {out} is a directory; name the figure, e.g. {out / 'figure.png'}")
    if out.suffix[1:].lower() not in formats:
        raise PlotError(f"--out {out}: name a figure ending in .png, .pdf or .svg (matplotlib writes {', '.join(sorted(formats))})")
    make_parent(out)


def draw(comparison: Comparison, out: Path, frac: float = TARGET_FRAC, xlabel: str = "training time (minutes)") -> None:
    """The paper's Figure 1: test accuracy over training time, each setting's mean over seeds with its
    standard error, and the speed-up target as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (t, mean, se) in comparison.curves.items():
        minutes, mean, se = np.array(t) / 60, np.array(mean), np.array(se)
        seeds, hollow_end = len(comparison.groups[label]), interpolated_at_end(comparison, label)
        line, = ax.plot(minutes, mean, marker="o", markersize=3, label=f"{label} ({seeds} seed{'s' if seeds > 1 else ''})",
                        linewidth=2.2 if label == comparison.baseline else 1.5, markevery=slice(0, len(t) - hollow_end))
        if hollow_end:
            ax.plot(minutes[-1:], mean[-1:], linestyle="none", marker="o", markersize=5, markerfacecolor="white", color=line.get_color())
        ax.fill_between(minutes, mean - se, mean + se, alpha=0.2)
    if any(interpolated_at_end(comparison, label) for label in comparison.curves):
        ax.plot([], [], linestyle="none", marker="o", markersize=5, markerfacecolor="white", color="gray",
                label="read between evaluations at the window's end")
    peak = max(comparison.curves[comparison.baseline][1])
    ax.axhline(frac * peak, color="gray", linestyle=":", linewidth=1, label=f"target: {frac:g} x {comparison.baseline} peak")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy")
    ax.set_title("Test accuracy over training time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def interpolated_at_end(comparison: Comparison, label: str) -> bool:
    """Whether a run of `label` was not evaluated at the window's end (the shortest run's): its curve's last point is
    read between its evaluations around it (run_up_to), the one after the window included. The figure draws it hollow."""
    return any(comparison.horizon not in times for times, _ in comparison.whole[label])


def speedup_table(comparison: Comparison, frac: float = TARGET_FRAC) -> list[str]:
    """The authors' table: the baseline's peak and target, and each setting's time to it and speed-up; and which of these
    fall on a point read between evaluations at the window's end (interpolated_at_end)."""
    peak, t_base, others = speedups({k: (v[0], v[1]) for k, v in comparison.curves.items()}, comparison.baseline, frac)
    lines = [f"baseline {comparison.baseline}: peak {peak:.3f}, target {frac:g} x peak = {frac * peak:.3f}, "
             f"first reached at {t_base / 60:.1f} min",
             f"{'run':<36}{'time to target':>24}{'speed-up':>10}"]
    if t_base == 0:  # the untrained model already scores the target: there is no time to shorten
        lines.insert(1, "(the baseline is at its target before training: no speed-up can be measured; "
                        "train longer, or lower --target-frac)")
    for label, t in others.items():
        if t is None:
            lines.append(f"{label:<36}{'never reached':>24}{'-':>10}")
        else:
            speed = "-" if t_base == 0 else f"{t_base / t:.2f}x" if t > 0 else "at start"
            lines.append(f"{label:<36}{t / 60:>20.1f} min{speed:>10}")
    times, accuracies = comparison.curves[comparison.baseline][:2]
    read = [("the baseline's peak", comparison.baseline, times[-1] if peak not in accuracies[:-1] else None),
            (f"{comparison.baseline}'s time to target", comparison.baseline, t_base),
            *((f"{label}'s time to target", label, t) for label, t in others.items())]
    at_end = [what for what, label, t in read if t == comparison.horizon and interpolated_at_end(comparison, label)]
    if at_end:
        lines.append(f"(interpolated at the window's end between two evaluations of a run that went on past it, the figure's "
                     f"hollow point: {', '.join(at_end)})")
    return lines


def plot(run_dirs: list[Path], out: Path, results_file: str | None, baseline: str | None, frac: float = TARGET_FRAC) -> str:
    """Draw the figure into `out` and return the speed-up table, every run read up to the shortest one's end."""
    comparison = compare(run_dirs, results_file, baseline)
    draw(comparison, out, frac)
    differ = [f"the settings differ beyond their labels: {'; '.join(comparison.differences)}"] if comparison.differences else []
    return "\n".join([f"every run is read up to the shortest run's end, {comparison.horizon / 60:.1f} min", *differ, "",
                      *speedup_table(comparison, frac)])


def read_metrics(run: Path) -> list[dict]:
    """A run's metrics.jsonl rows (empty when it has none)."""
    try:
        return run_dir.read_rows(run / "metrics.jsonl")
    except checkpoint.CheckpointError as err:  # (a directory in its place, a damaged copy)
        raise PlotError(str(err)) from None


def trailing_mean(values, window: int) -> np.ndarray:
    """At each step, the mean of the last `window` values up to it (fewer at the start; NaNs ignored)."""
    values = np.asarray(values, dtype=float)
    return np.array([np.nanmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))])


TRAINING_PANELS = (("reward_mean", "reward (all n)"), ("accuracy", "train accuracy (all n)"),
                   ("kept_accuracy", "train accuracy (kept m)"), ("completion_len", "completion tokens"),
                   ("step_s", "seconds per step"), ("uniform_share", "uniform groups (share, before refill)"))


def plot_training(run_dirs: list[Path], out: Path, smooth: int = 5) -> str:
    """Training curves from metrics.jsonl alone, no evaluation needed: one panel per metric of
    TRAINING_PANELS over training minutes, one line per run (the mean of the last `smooth` steps, the
    raw values faint behind it; a run whose rows lack a metric, e.g. uniform_share before it was logged, is left
    out of that panel). Returns a one-line summary per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7))  # (one row of six was 24 inches wide: unreadable on a screen)
    axes = axes.flatten()
    lines = [f"{'run':<36}{'steps':>7}{'minutes':>9}{'s/step':>8}{'accuracy, first -> last 10%':>30}"]
    for number, run in enumerate(run_dirs):
        if not run.is_dir():
            raise PlotError(f"{run} is not a directory: pass a run's --out-dir")
        rows = read_metrics(run)
        if not rows:
            raise PlotError(f"{run} has no metrics.jsonl rows: pass a run's --out-dir")
        minutes = np.array([r["elapsed_s"] for r in rows]) / 60
        label = run.name
        for ax, (key, title) in zip(axes, TRAINING_PANELS):
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("training minutes")
            ax.grid(alpha=0.3)
            if key != "step_s" and not any(key in r for r in rows):
                continue
            values = np.array([r["elapsed_s"] - prev["elapsed_s"] if key == "step_s" else r.get(key, np.nan)
                               for prev, r in zip([{"elapsed_s": 0.0}] + rows[:-1], rows)], dtype=float)
            color = f"C{number % 10}"  # the run's colour in every panel, also where it is left out of one
            ax.plot(minutes, trailing_mean(values, smooth), label=label, linewidth=1.5, color=color)
            ax.plot(minutes, values, color=color, alpha=0.25, linewidth=0.8)
        tenth = max(1, len(rows) // 10)
        first, last = (float(np.mean([r.get("accuracy", np.nan) for r in part])) for part in (rows[:tenth], rows[-tenth:]))
        lines.append(f"{label:<36}{len(rows):>7}{minutes[-1]:>9.1f}{60 * minutes[-1] / len(rows):>8.1f}{f'{first:.3f} -> {last:.3f}':>30}")
    axes[0].legend(fontsize=8)
    for ax in axes:
        if not ax.lines:  # a metric none of the runs logged (uniform_share, in runs older than it)
            ax.text(0.5, 0.5, "not in these runs' metrics.jsonl", ha="center", va="center", color="gray", transform=ax.transAxes)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return "\n".join(lines)
