"""eval.py's results file: what it stores for each checkpoint, and when a stored result is reused.

RUN/eval-DATASET.json holds the evaluation's settings (dataset, limit, samples, repeats, temperature,
completion length, seed) and one row per checkpoint: its step and training time, the accuracy of each
repeat with their mean and standard error, and the format rate. eval-DATASET.csv holds the same rows
for a spreadsheet, and plot.py reads the JSON (plot.read_results) to draw the paper's figure. A file
made with other settings is refused, not mixed in. The base model's row (step 0, time 0) is the same for
every run of one model, so it is kept once in BASE_CACHE, keyed on the settings, the test set's contents
and the code that generates and grades (a new sampler draws another random stream).
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import math
from pathlib import Path

import numpy as np

import checkpoint
import decode
import model as models
import plot
import rewards
import sampling
import vllm_sampler

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


def load_results(out: Path, settings: dict, force: bool) -> list[dict]:
    """The results already in `out`, made with `settings` (eval.Settings.key()). A file that is not eval.py's
    results is refused, --force or not: --out pointed at a run's metrics.jsonl or config.json would otherwise
    replace it."""
    if out.is_dir():
        raise ResultsError(f"--out {out} is a directory; name the results file, e.g. {out / results_name(settings['dataset'])}")
    if not out.exists():
        return []
    stored = plot.read_results(out, "choose another --out, or delete it if it is a damaged one")
    if force:
        return []
    if stored["settings"] != settings:
        differing = {k: v for k, v in stored["settings"].items() if settings.get(k) != v}
        raise ResultsError(f"{out} holds results made with other settings {differing}; pass --force to redo them or choose --out")
    return stored["results"]


def write_results(out: Path, settings: dict, results: list[dict]) -> None:
    """`results` in step order, as JSON with their `settings` and as CSV beside it; each file replaced whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    # (rows stored or cached before one repeat had no standard error said 0.0: every row's is recomputed)
    results = sorted(({**r, "accuracy_se": standard_error(r["accuracies"])} if "accuracies" in r else r for r in results),
                     key=lambda r: r["step"])
    checkpoint.write_atomic(out, json.dumps({"settings": settings, "results": results}, indent=2))
    table = io.StringIO()
    writer = csv.writer(table)
    writer.writerow(["checkpoint", "step", "elapsed_s", "accuracy", "accuracy_se", "format_rate"])
    for r in results:
        writer.writerow([r["checkpoint"], r["step"], r["elapsed_s"], r["accuracy"], r["accuracy_se"], r["format_rate"]])
    checkpoint.write_atomic(out.with_suffix(".csv"), table.getvalue())


def evaluation_code() -> dict:
    """What, besides the settings, decides a result: the source of sampling.py, decode.py and vllm_sampler.py and the
    versions of the libraries that generate (a new sampler draws another random stream from the same seed), and the
    source of rewards.py, which grades the answers."""
    from importlib import metadata

    versions = {}
    for package in ("torch", "transformers", "vllm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    sources = {Path(module.__file__).name: hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:16]
               for module in (sampling, decode, vllm_sampler, rewards)}
    return {**sources, **versions}


def base_cache_file(base: str, settings: dict) -> Path:
    """Where the base model's result for these settings (eval.Settings.key()) is kept: every run of one model
    starts from the same weights, so its step-0 point is evaluated once, not once per run, and again after
    the code that samples or grades changes (so that a run's base point comes from the code its checkpoints do)."""
    dataset = Path(settings["dataset"])  # a file: its contents too (another folder's test.jsonl, an edited one)
    contents = {"dataset_sha256": hashlib.sha256(dataset.read_bytes()).hexdigest()} if dataset.is_file() else {}
    key = json.dumps({"model": base, **settings, **contents, **evaluation_code()}, sort_keys=True)
    return BASE_CACHE / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
