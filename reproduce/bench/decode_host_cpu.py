"""The transformers sampler's decode step on a CPU, where it is bound by the host as it is by kernel launches on a GPU.

A model of Qwen2.5-3B-Instruct's depth and head layout (36 layers, 16 query heads on 2 key/value heads) but tiny
widths (hidden 64) leaves the decode step almost no arithmetic: what is left is Python, transformers and torch's
dispatch, the work that sets the pace of an eager decode step on a GPU. So this compares two commits' samplers
for host work, without a GPU: milliseconds per decode step at 32 rows, aten operations dispatched per step, and
reads of a tensor's value on the host per step (each one a synchronization on a GPU). Used for reproduce/gpu/runs.md's 27
November paragraph (whether the sampler's code explains a 3.4x slower GPU generation: it does not):

    git archive 5af2948 | tar -x -C /tmp/old                                      # an older commit's tree
    python reproduce/bench/decode_host_cpu.py --tree /tmp/old --label 5af2948    # its sampler
    python reproduce/bench/decode_host_cpu.py --label HEAD                       # this checkout's

Run them alternately a few times on an idle machine and compare medians: a shared machine's noise is +-30%.
Each process times `--repeats` pairs of generations of `--tokens` and half as many tokens; a step is their
difference over the tokens between (the prefill and the setup cancel).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = ("_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal")


class Dispatched(TorchDispatchMode):
    """Counts the aten operations run under it, and those that read a tensor's value on the host."""

    def __init__(self):
        super().__init__()
        self.ops = self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.host_reads += func.__name__.split(".")[0] in HOST_READS
        return func(*args, **(kwargs or {}))


def tiny_deep_model(path: Path, tokenizer_dir: Path) -> None:
    """Random weights: Qwen2.5-3B's 36 layers and 16/2 heads, hidden 64, SmolLM2's tokenizer and vocabulary."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=36, num_attention_heads=16,
                         num_key_value_heads=2, head_dim=4, tie_word_embeddings=True, max_position_embeddings=2048)
    Qwen2ForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default=".", help="the checkout whose sampling.py is timed (its other modules too)")
    parser.add_argument("--label", default=None)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model-dir", default="/tmp/pods-decode-host-model")
    args = parser.parse_args()
    tree = Path(args.tree).resolve()
    sys.path.insert(0, str(tree))
    os.chdir(tree)
    import sampling  # the tree's
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = Path(args.model_dir)
    if not (path / "config.json").exists():
        embedded = getattr(sampling, "embedded_model_dir", None) or __import__("model").embedded_model_dir  # moved to model.py
        tiny_deep_model(path, embedded())
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy = get_peft_model(policy, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    options = dict(batch_size=32, share_prompt=False, merged=True, merged_dtype=torch.float32)
    if "cuda_graph" in inspect.signature(sampling.HFSampler).parameters:
        options["cuda_graph"] = False  # a CPU decodes eagerly anyway
    sampler = sampling.HFSampler(policy, tokenizer, args.tokens, 1.0, **options)
    sampler.stops = set()  # random weights: every row runs to its limit
    prompt = list(range(100, 180))

    def generate(tokens: int) -> float:
        sampler.max_new_tokens = tokens
        start = time.perf_counter()
        sampler.generate([prompt], 32)
        return time.perf_counter() - start

    generate(4)
    counts = []
    for tokens in (8, 16):
        sampler.max_new_tokens = tokens
        with Dispatched() as seen:
            sampler.generate([prompt], 32)
        counts.append(seen)
    ops, reads = (counts[1].ops - counts[0].ops) / 8, (counts[1].host_reads - counts[0].host_reads) / 8
    half = args.tokens // 2
    steps = [(generate(args.tokens) - generate(half)) / (args.tokens - half) * 1e3 for _ in range(args.repeats)]
    import transformers

    print(f"{args.label or tree.name}: transformers {transformers.__version__}, torch {torch.__version__}: "
          f"decode step median {statistics.median(steps):.1f} ms ({' '.join(f'{s:.1f}' for s in steps)}), "
          f"{ops:.0f} aten operations and {reads:.1f} host reads a step")


if __name__ == "__main__":
    main()
