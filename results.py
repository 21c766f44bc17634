"""eval.py's results file: what it stores for each checkpoint, and when a stored result is reused.

RUN/eval-DATASET.json holds the evaluation's settings (dataset, limit, samples, repeats, temperature,
completion length, seed, and digests of the test set and of the grader: results_key) and one row per checkpoint:
its step and training time, the accuracy of each repeat with their mean and standard error, and the format rate.
eval-DATASET.csv holds the same rows for a spreadsheet, and plot.py reads the JSON (plot.read_results) to draw the
paper's figure. A file made with other settings, another test set or another grader is refused, not mixed in.
The base model's row (step 0, time 0) is the same for every run of one model, so it is kept once in BASE_CACHE,
keyed on those and on the code that generates (a new sampler draws another random stream). The repeats of a
checkpoint that an interrupt cut short are kept in RUN/eval-DATASET.json.partial until its row is written.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import logging
import math
import os
from pathlib import Path

import numpy as np

import checkpoint
import decode
import model as models
import plot
import rewards
import run_dir
import sampling
import vllm_sampler

log = logging.getLogger("pods")
BASE_CACHE = models.CACHE_DIR / "eval"  # base-model results, shared by every run of the same model


class ResultsError(ValueError):
    """A results file that cannot be used as asked; the message says what to pass instead."""


def standard_error(accuracies: list[float]) -> float | None:
    """The standard error of the mean over repeats; None for one repeat, which has no spread to measure
    (0 would claim an exact accuracy)."""
    return float(np.std(accuracies, ddof=1) / math.sqrt(len(accuracies))) if len(accuracies) > 1 else None


def results_name(dataset: str) -> str:
    """eval-arith.json, eval-arith-1.json (for arith:1), eval-test.json (for path/test.jsonl)."""
    return f"eval-{Path(dataset).stem.replace(':', '-')}.json"


def load_results(out: Path, settings: dict, force: bool, model: str) -> list[dict]:
    """The results already in `out`, made with `settings` (results_key) from `model`. A file that is not eval.py's
    results is refused, --force or not: --out pointed at a run's metrics.jsonl or config.json would otherwise
    replace it. So is one of another model's results (two base models evaluated from one directory: the second's
    "base" row replaced the first's), unless either is a local directory that has gone (a run's model moved)."""
    if out.is_dir():
        raise ResultsError(f"--out {out} is a directory; name the results file, e.g. {out / results_name(settings['dataset'])}")
    if out.suffix.lower() == ".csv":  # the table written beside the results would replace them
        raise ResultsError(f"--out {out} names the .csv table eval.py writes beside its results; name the results, e.g. "
                           f"{out.with_suffix('.json')}")
    if out.suffix.lower() in (".png", ".pdf", ".svg", ".jpg", ".jpeg"):  # a figure's name: the JSON results were written into it
        raise ResultsError(f"--out {out} names a figure, and an evaluation writes JSON results: name them, e.g. "
                           f"{out.with_suffix('.json')}, or draw a figure with --plot RUN_DIR ... --out {out}")
    if not out.exists():
        return []
    stored = plot.read_results(out, "choose another --out, or delete it if it is a damaged one")
    if force:
        return []
    if differing := plot.differing_keys(stored["settings"], settings):
        changes = "; ".join(plot.setting_change(key, stored["settings"], settings) for key in differing)
        raise ResultsError(f"{out} holds results made with other settings (stored against asked: {changes}); "
                           f"pass --force to redo them or choose --out")
    for other in {r["model"] for r in stored["results"] if isinstance(r.get("model"), str)}:
        if not run_dir.same_path(other, model) and not models.missing_path(other) and not models.missing_path(model):
            raise ResultsError(f"{out} holds the results of {other}, and this evaluates {model}: choose another --out "
                               f"(or pass --force to replace them)")
    return stored["results"]


def is_result_of(result: dict, target, model: str) -> bool:
    """A stored result belongs to this target (an eval.Target) of `model`: same model, same checkpoint name, step and
    training time (a checkpoint retrained under the same name is a different one)."""
    return (result.get("model") == model and result["checkpoint"] == target.name and result["step"] == target.step
            and math.isclose(result["elapsed_s"], target.elapsed_s, abs_tol=1e-6))


def write_results(out: Path, settings: dict, results: list[dict]) -> None:
    """`results` in step order, as JSON with their `settings` and as CSV beside it; each file replaced whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    # (rows stored or cached before one repeat had no standard error said 0.0: every row's is recomputed)
    results = sorted(({**r, "accuracy_se": standard_error(r["accuracies"])} if "accuracies" in r else r for r in results),
                     key=lambda r: r["step"])
    table = io.StringIO()
    writer = csv.writer(table)
    writer.writerow(["checkpoint", "step", "elapsed_s", "accuracy", "accuracy_se", "format_rate"])
    for r in results:
        writer.writerow([r["checkpoint"], r["step"], r["elapsed_s"], r["accuracy"], r["accuracy_se"], r["format_rate"]])
    run_dir.write_atomic(out.with_suffix(".csv"), table.getvalue())
    run_dir.write_atomic(out, json.dumps({"settings": settings, "results": results}, indent=2))  # last: the JSON decides what is done


def partial_file(out: Path) -> Path:
    """Where the finished repeats of the checkpoint being evaluated are kept (RUN/eval-DATASET.json.partial) until its
    row is written: a Ctrl-C in its 5th repeat lost four (7 CPU minutes each on the embedded model). Repeat r samples
    with seed + r whatever came before, so a resumed checkpoint's result is the one it would have had."""
    return out.with_name(out.name + ".partial")  # (not eval-*.json: plot.py reads a run's only such file)


def read_partial(path: Path, identity: dict) -> list[list[float]]:
    """The [accuracy, format rate] of each repeat finished for `identity` (the checkpoint, model, results_key, backend
    and generating code); none when the file holds another's, or cannot be read (only time is lost)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return saved["repeats"] if isinstance(saved, dict) and saved.get("identity") == identity else []


def keep_repeats(path: Path, identity: dict, repeats: list[list[float]]) -> None:
    """The repeats a checkpoint has finished, each [accuracy, format rate], where a rerun finds them (read_partial)."""
    keep(path, json.dumps({"identity": identity, "repeats": repeats}), "finished repeats not kept")


def keep(path: Path, text: str, refused: str) -> None:
    """Write a file that only saves time (finished repeats, the base model's cached result); a write the file system
    refuses is a warning that begins with `refused`, not the end of an evaluation."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        run_dir.write_atomic(path, text)
    except (OSError, checkpoint.CheckpointError) as err:
        log.warning("%s (%s): %s", refused, path, str(err).splitlines()[0])


def partial_repeats(path: Path) -> tuple[str, int] | None:
    """(checkpoint, repeats finished) of the partial file at `path`, for the line an interrupt prints."""
    try:
        saved = json.loads(path.read_text())
        return saved["identity"]["checkpoint"], len(saved["repeats"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def source_digest(module) -> str:
    return hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:16]


def results_key(settings: dict, examples: list) -> dict:
    """What must match for a stored result to be reused, and for runs to be compared in one plot: the settings
    (eval.Settings.key()), the test set itself (a digest of its questions and reference answers: another file of
    the same name, an edited one, or a changed reader of it gives another) and the grader (rewards.py's source).
    The sampler's code is not in it: another sampler draws another random stream of the same accuracy."""
    test_set = json.dumps([[example.question, example.answer] for example in examples])
    return {**settings, "test_set": hashlib.sha256(test_set.encode()).hexdigest()[:16], "grader": source_digest(rewards)}


def generation_code(backend: str) -> dict:
    """What generates: the `backend` ("vllm" or "hf"), the source of sampling.py, decode.py and vllm_sampler.py and the
    versions of the libraries that generate. Other code draws another random stream from the same seed."""
    from importlib import metadata

    versions = {}
    for package in ("torch", "transformers", "vllm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {"backend": backend, **{Path(m.__file__).name: source_digest(m) for m in (sampling, decode, vllm_sampler)}, **versions}


def base_cache_file(base: str, key: dict, code: dict) -> Path:
    """Where the base model's result for this results_key is kept: every run of one model starts from the same
    weights, so its step-0 point is evaluated once, not once per run, and again when the generating `code`
    (generation_code: the backend too) changes, so that a run's base point comes from the code its checkpoints do."""
    local = os.path.abspath(base) if base != models.EMBEDDED and os.path.isdir(base) else base  # "." in two directories: two models
    text = json.dumps({"model": local, **key, **code}, sort_keys=True)
    return BASE_CACHE / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def read_base_cache(cache: Path) -> dict:
    """The base model's cached result (base_cache_file); a damaged one stops in one line naming it (a NaN accuracy
    was taken into every results file made from it, each then refused)."""
    fix = "delete it, or pass --force to evaluate the base model again"
    cached = plot.read_json(cache, fix)
    problem = plot.row_problem(cached)
    if problem is None and not ("format_rate" in cached and ("accuracies" in cached or "accuracy_se" in cached)):
        problem = "without its format rate and standard error"
    if problem:
        raise ResultsError(f"{cache}, the base model's cached result, is a row {problem}; {fix}")
    return cached
