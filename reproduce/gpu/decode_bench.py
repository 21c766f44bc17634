"""The transformers sampler's decode step, timed on a GPU: milliseconds per decode step at the GPU profile's
32 rows, for the CUDA-graph step (the default), the eager step (--no-cuda-graph) and an older commit's sampler
(.gpu/old, prepare.sh with OLD=COMMIT), on one model loaded once, back to back; then each one's busiest CUDA
kernels (torch.profiler), which name the attention kernel that runs; and the graph with transformers' sdpa in
place of decode.decode_attention. Last, eval.py's batch on the transformers backend (64 different questions, one
rollout each): their prompts prefilled whole, each left-padded (as before 29 November), against sampling.prefill's
shared prefix (the system prompt and chat template, computed once; eval.py's default since then). check.sh's `decode` stage:
    python3 reproduce/gpu/decode_bench.py --model DIR [--old .gpu/old] [--tokens 128] [--rows 32] [--questions 64]
Each variant generates once at 16 tokens (CUDA's first calls), then `--tokens` tokens per row, timed; random
weights never stop early, so every step decodes every row and ms/step = seconds / tokens (the prefill included,
and for the graph its capture, once per generate call: printed apart, with torch.cuda.graph's empty_cache in it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())
import data  # noqa: E402 - the checkout's, from the repository root
import decode  # noqa: E402
import sampling  # noqa: E402
from model import load_policy  # noqa: E402


def old_sampling(tree: Path):
    """The older commit's sampling.py, as a module of its own, with its decode.py where it has one (since the decode
    step moved there); its other imports are the checkout's."""
    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"old_{name}", tree / f"{name}.py")
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    if not (tree / "decode.py").exists():
        return load("sampling")
    checkout = sys.modules["decode"]
    sys.modules["decode"] = load("decode")  # what the old sampling.py's `from decode import ...` finds
    try:
        return load("sampling")
    finally:
        sys.modules["decode"] = checkout


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def transformers_sdpa(on: bool):
    """While on, CudaGraphDecode attends with transformers' own sdpa instead of decode.decode_attention: what
    folding the grouped-query heads saves under transformers 5.19 (repeat_kv under the mask; 5.24's sdpa folds
    them itself, so there the two variants run the same kernels)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    folded = decode.decode_attention
    if on:
        decode.decode_attention = sdpa_attention_forward
    try:
        yield
    finally:
        decode.decode_attention = folded


@contextlib.contextmanager
def capture_times(record: list[float]):
    """While on, the seconds each CudaGraphDecode the sampler builds takes go to `record`: a warm-up forward and the
    capture, with what torch.cuda.graph does first (a synchronize and empty_cache), once per generate call."""
    build = sampling.CudaGraphDecode

    def timed_build(*args, **kwargs):
        synchronize()
        start = time.perf_counter()
        step = build(*args, **kwargs)
        synchronize()
        record.append(time.perf_counter() - start)
        return step

    sampling.CudaGraphDecode = timed_build
    try:
        yield
    finally:
        sampling.CudaGraphDecode = build


def timed(sampler, prompts: list[list[int]], n: int, tokens: int) -> float:
    """Seconds for one generate call of n rollouts of `tokens` tokens per prompt (after one of 16: CUDA's first calls)."""
    sampler.max_new_tokens = 16
    sampler.generate(prompts, n)
    sampler.max_new_tokens = tokens
    synchronize()
    start = time.perf_counter()
    groups = sampler.generate(prompts, n)
    synchronize()
    seconds = time.perf_counter() - start
    if any(len(r.completion_ids) < tokens for group in groups for r in group):
        print(f"note: some rows stopped before {tokens} tokens: ms/step overstates the step")
    return seconds


def busiest_kernels(sampler, prompt: list[int], rows: int, top: int = 8) -> list[str]:
    """The CUDA kernels that took the most time over a generation of 8 tokens, with their share."""
    from torch.profiler import ProfilerActivity, profile

    sampler.max_new_tokens = 8
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:  # acc_events: no warning when profiled twice
        sampler.generate([prompt], rows)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) or 1
    events.sort(key=lambda e: -e.self_device_time_total)
    return [f"{100 * e.self_device_time_total / total:5.1f}%  {e.count:5d} calls  {e.key[:110]}" for e in events[:top]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--old", default=None, help="an older commit's tree (its sampling.py is timed too)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--questions", type=int, default=64, help="eval.py's batch: prompts of different questions")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU only to try the script
    model, tokenizer = load_policy(args.model, device, torch.bfloat16 if device == "cuda" else torch.float32)
    model.requires_grad_(False).eval()
    prompt = sampling.build_prompt(tokenizer, "Natalia sold clips to 48 of her friends in April, and then she sold half "
                                              "as many clips in May. How many clips did Natalia sell altogether?")
    variants = {"graph": sampling.HFSampler(model, tokenizer, 16, 0.9, share_prompt=False, cuda_graph=True),
                "eager": sampling.HFSampler(model, tokenizer, 16, 0.9, share_prompt=False, cuda_graph=False)}
    if args.old and Path(args.old, "sampling.py").exists():  # before the sdpa graph: the regression's baseline comes first
        commit = Path(args.old, "commit").read_text().strip() if Path(args.old, "commit").exists() else "old"
        variants[f"old {commit}"] = old_sampling(Path(args.old)).HFSampler(model, tokenizer, 16, 0.9, share_prompt=False)
    variants["graph, sdpa"] = sampling.HFSampler(model, tokenizer, 16, 0.9, share_prompt=False, cuda_graph=True)
    print(f"decode: {args.rows} rows, {len(prompt)} prompt tokens, {args.tokens} new tokens, {model.dtype}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch {torch.__version__}")
    seconds, captures = {}, []
    for name, sampler in variants.items():
        with transformers_sdpa(name == "graph, sdpa"), capture_times(captures if name == "graph" else []):
            seconds[name] = timed(sampler, [prompt], args.rows, args.tokens)
        print(f"decode: {name:14s} {1000 * seconds[name] / args.tokens:7.2f} ms/step  ({seconds[name]:.2f} s), "
              f"CUDA peak allocated {torch.cuda.max_memory_allocated() / 2**30 if device == 'cuda' else 0:.2f} GiB so far", flush=True)
    if captures:  # the timed call's, after the first call's
        print(f"decode: the graph's setup and capture {1000 * captures[-1]:.0f} ms of its {seconds['graph']:.2f} s (once per generate call)")
    for name in ("graph", "eager"):
        print(f"decode: {name} / {', '.join(f'{other} {seconds[name] / seconds[other]:.2f}' for other in seconds if other != name)}")
    prompts = [sampling.build_prompt(tokenizer, e.question) for e in data.arith_examples(args.questions, seed=0)]
    whole, shared = (timed(sampling.HFSampler(model, tokenizer, 16, 0.9, share_prompt=share), prompts, 1, args.tokens)
                     for share in (False, True))
    print(f"eval batch: {len(prompts)} questions x 1, {args.tokens} new tokens, graph: prompts prefilled whole {whole:.2f} s, "
          f"after their shared prefix {shared:.2f} s ({len(os.path.commonprefix(prompts))} tokens): {whole / shared:.2f}x", flush=True)
    for name, sampler in variants.items():
        if device == "cuda":
            with transformers_sdpa(name == "graph, sdpa"):
                print(f"kernels, {name}:", *busiest_kernels(sampler, prompt, args.rows), sep="\n  ", flush=True)


if __name__ == "__main__":
    main()
