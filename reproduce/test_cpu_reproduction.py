"""reproduce/cpu_reproduction.sh and its tools: the plans as a user runs them (train.py stubbed, on records
constructed in a copy of the project), the report stage, replay_run.py and take_turns.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import replay_run
import take_turns
import torch

import checkpoint
import rewards
import train
from testkit import length_reward, read_metrics, timed_run, tiny_args, write_constructed_run

HERE = Path(__file__).parent  # reproduce/
PROJECT = HERE.parent


def project_copy(root: Path) -> Path:
    """The project's Python files and reproduce/'s programs in `root`, for running the script there."""
    (root / "reproduce" / "cpu-plateau").mkdir(parents=True)
    for py in PROJECT.glob("*.py"):
        (root / py.name).write_text(py.read_text())
    for program in (*HERE.glob("*.py"), *HERE.glob("*.sh")):
        (root / "reproduce" / program.name).write_text(program.read_text())
    return root


def run_reproduction(root: Path, **env: str) -> subprocess.CompletedProcess:
    """bash reproduce/cpu_reproduction.sh in a project copy, with this interpreter as `python` (and, train.py
    stubbed, on any CPU: CHECK_CPU=0 unless a test passes it)."""
    inherited = {k: v for k, v in os.environ.items() if k != "OUT"}  # the script's OUT= knob, not the caller's
    env = {**inherited, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "CHECK_CPU": "0", **env}
    return subprocess.run(["bash", str(root / "reproduce" / "cpu_reproduction.sh")], env=env, capture_output=True, text=True, timeout=300)


STUB_TRAIN = """import json, os, sys
def write_row(metrics_file, row):  # train.py writes through progress.write_row, which take_turns.py (importing it first) hooks
    progress = sys.modules.get("progress")
    if progress is not None:
        return progress.write_row(metrics_file, row)
    metrics_file.write(json.dumps(row) + "\\n")
def main(args):  # metrics rows for --steps steps or the time budget, without training
    out, steps = args[args.index("--out-dir") + 1], int(args[len(args) - 1 - args[::-1].index("--steps") + 1])
    budget_s = 60 * float(args[args.index("--time-budget") + 1])
    calls = open(os.environ["STUB_LOG"]).read().count("\\n") if os.path.exists(os.environ["STUB_LOG"]) else 0
    open(os.environ["STUB_LOG"], "a").write(" ".join(args) + "\\n")
    os.makedirs(out, exist_ok=True)
    times = os.environ["STUB_STEP_S"].split(",")  # the k-th call's seconds a step (the last one for later calls)
    step_s = float(times[min(calls, len(times) - 1)])
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for k in range(1, steps + 1):
            row = {"step": k, "elapsed_s": k * step_s, "generation_s": step_s / 2, "update_s": step_s / 2}
            write_row(f, row | json.loads(os.environ.get("STUB_ROW", "{}")))  # STUB_ROW: what this machine computes
            if k * step_s >= budget_s:
                break
    return 0
if __name__ == "__main__":  # take_turns.py imports it and calls main
    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.pure
def test_reproduction_stops_at_once_on_a_cpu_that_emulates_bfloat16_but_redraws_there(tmp_path):
    """The kept runs computed in bfloat16: on a CPU without its arithmetic (models.computes_bfloat16
    stubbed to say so) training and evaluation stop before any run, in one line; the report stage, which
    computes nothing, runs; CHECK_CPU=0 trains anyway, with the kept runs' bfloat16 flags. PRECISION=float32
    trains new seeds there in float32, but not a run begun in bfloat16, and not on a CPU with bfloat16 arithmetic
    (eval.py would evaluate its runs in bfloat16)."""
    root = project_copy(tmp_path)
    (root / "train.py").write_text(STUB_TRAIN)
    model_py = (root / "model.py").read_text()
    (root / "model.py").write_text(model_py + "\n\ndef computes_bfloat16(device):\n    return False\n")
    log = tmp_path / "calls.log"
    env = dict(PLAN="plateau", SEEDS="0", ABLATION_SEEDS="", CHECK_SPEED="0", STUB_LOG=str(log), STUB_STEP_S="60")
    for stages in ("train", "eval", "train eval report"):
        stopped = run_reproduction(root, STAGES=stages, CHECK_CPU="1", **env)
        assert stopped.returncode == 1 and not log.exists()
        assert stopped.stdout.strip().startswith("this CPU has no bfloat16 arithmetic (no AVX-512 BF16 or AMX)")
        assert "CHECK_CPU=0 to run anyway" in stopped.stdout and "Traceback" not in stopped.stderr
    assert "this CPU" not in run_reproduction(root, STAGES="report", CHECK_CPU="1", **env).stdout
    anyway = run_reproduction(root, STAGES="train", CHECK_CPU="0", **env)
    assert anyway.returncode == 0, anyway.stdout + anyway.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 4 and all("--bf16-autocast --merged-sampler" in c for c in calls)

    f32 = run_reproduction(root, STAGES="train", CHECK_CPU="1", PRECISION="float32", **{**env, "SEEDS": "1"})
    assert f32.returncode == 0, f32.stdout + f32.stderr
    f32_calls = log.read_text().splitlines()[len(calls):]
    assert len(f32_calls) == 4 and all("--bf16-autocast" not in c and "--warmup-ratio 0 --merged-sampler" in c for c in f32_calls)
    begun = root / "runs" / "cpu-plateau" / "grpo-n8-s2"
    begun.mkdir(parents=True)
    (begun / "config.json").write_text(json.dumps({"bf16_autocast": True}))
    mixed = run_reproduction(root, STAGES="train", CHECK_CPU="1", PRECISION="float32", **{**env, "SEEDS": "2"})
    assert mixed.returncode == 1 and mixed.stdout.startswith("grpo-n8-s2 in runs/cpu-plateau did not train in float32 (its config.json: bf16_autocast true)")
    assert len(log.read_text().splitlines()) == len(calls) + 4  # nothing trained
    assert run_reproduction(root, PRECISION="half", **env).stdout.startswith("PRECISION=half: pass bfloat16")
    (root / "model.py").write_text(model_py + "\n\ndef computes_bfloat16(device):\n    return True\n")
    native = run_reproduction(root, STAGES="train", CHECK_CPU="1", PRECISION="float32", **{**env, "SEEDS": "3"})
    assert native.returncode == 1 and native.stdout.startswith("PRECISION=float32 is for a CPU without bfloat16 arithmetic")


@pytest.mark.pure
def test_plateau_plan_skips_runs_kept_from_another_machine_and_stops_on_a_slower_one(tmp_path):
    """PLAN=plateau in a fresh checkout (no runs/): seed 0's runs, kept in reproduce/cpu-plateau, are neither
    trained nor evaluated again; before each run of a new seed, the script repeats the first 6 steps of
    seed 0 of that run's setting (train.py stubbed: it writes a metrics.jsonl whose steps take
    STUB_STEP_S), and stops if they take > 1.25x its record, also when the machine slows between two runs
    of an invocation."""
    root = project_copy(tmp_path)
    (root / "train.py").write_text(STUB_TRAIN)
    for name in ("grpo-n8-s0", "pods-n8-m4-s0", "grpo-n4-s0", "pods-n16-m4-s0"):
        kept = timed_run(root / "reproduce" / "cpu-plateau" / name, {"seed": 0}, [8.0] * 120)  # 8 s a step, 16 minutes
        (kept / "eval-arith-2.json").write_text("{}")
    log = tmp_path / "train-calls.txt"
    done = run_reproduction(root, PLAN="plateau", SEEDS="0", ABLATION_SEEDS="", STAGES="train eval", STUB_LOG=str(log), STUB_STEP_S="8")
    assert done.returncode == 0, done.stderr
    assert not log.exists()  # nothing trained, nothing evaluated

    slow = run_reproduction(root, PLAN="plateau", SEEDS="1", ABLATION_SEEDS="", STAGES="train", STUB_LOG=str(log), STUB_STEP_S="12")
    assert slow.returncode == 1
    assert "speed check: grpo-n8-s0's steps 2-6 take 12.0 s a step here, 8.0 s in its record (1.50x)" in slow.stdout
    assert "this machine is slower than the one the kept runs were timed on" in slow.stdout
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and "--steps 6" in calls[0] and "--seed 0" in calls[0]  # the check only, no run of seed 1

    log.unlink()
    idle = run_reproduction(root, PLAN="plateau", SEEDS="1", ABLATION_SEEDS="", STAGES="train", STUB_LOG=str(log), STUB_STEP_S="9")
    assert idle.returncode == 0, idle.stderr
    assert "(1.12x)" in idle.stdout
    calls = log.read_text().splitlines()
    assert len(calls) == 8 and all("--steps 6" in call for call in calls[::2])  # a check before each of seed 1's four runs
    assert all("--seed 1" in call and "--steps 1000" in call for call in calls[1::2])
    setting = lambda call: re.search(r"--rule \S+ --n \d+( --m \d+)?", call).group(0)  # noqa: E731
    assert [setting(check) for check in calls[::2]] == [setting(run) for run in calls[1::2]]  # each with its own work

    log.unlink()  # seed 2: the machine is at speed for its first run, then slows
    drift = run_reproduction(root, PLAN="plateau", SEEDS="2", ABLATION_SEEDS="", STAGES="train", STUB_LOG=str(log), STUB_STEP_S="9,9,12")
    assert drift.returncode == 1 and "(1.12x)" in drift.stdout
    assert "speed check: pods-n8-m4-s0's steps 2-6 take 12.0 s a step here, 8.0 s in its record (1.50x)" in drift.stdout
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and "grpo-n8-s2" in calls[1] and "--steps 6" in calls[2]  # stopped before pods-n8-m4-s2


@pytest.mark.pure
def test_plateau_plan_stops_on_a_machine_that_computes_differently_and_can_take_another_seed_as_reference(tmp_path):
    """The speed check's six steps must also give the record's numbers: a machine at speed whose steps
    come out otherwise (train.py stubbed: STUB_ROW adds a reward the record does not have) is another
    machine, and the script stops before training; REF_SEED=1 checks against seed 1's records instead."""
    root = project_copy(tmp_path)
    (root / "train.py").write_text(STUB_TRAIN)
    for name in ("grpo-n8-s0", "pods-n8-m4-s0", "grpo-n4-s0", "pods-n16-m4-s0"):
        timed_run(root / "reproduce" / "cpu-plateau" / name, {"seed": 0}, [8.0] * 120)
    log = tmp_path / "train-calls.txt"
    other = run_reproduction(root, PLAN="plateau", SEEDS="2", ABLATION_SEEDS="", STAGES="train", STUB_LOG=str(log),
                             STUB_STEP_S="8", STUB_ROW='{"reward_mean": 0.25}')
    assert other.returncode == 1
    assert ("speed check: this machine computes differently from the one grpo-n8-s0 trained on "
            "(step 1: reward_mean: 0.25 here, None recorded)") in other.stdout
    assert len(log.read_text().splitlines()) == 1  # the check only

    log.unlink()
    for name in ("grpo-n8-s1", "pods-n8-m4-s1", "grpo-n4-s1", "pods-n16-m4-s1"):  # seed 1, trained on this machine
        run = timed_run(root / "reproduce" / "cpu-plateau" / name, {"seed": 1}, [8.0] * 120)
        (run / "metrics.jsonl").write_text("".join(json.dumps(json.loads(line) | {"reward_mean": 0.25}) + "\n"
                                                   for line in (run / "metrics.jsonl").read_text().splitlines()))
    own = run_reproduction(root, PLAN="plateau", SEEDS="2", ABLATION_SEEDS="", STAGES="train", STUB_LOG=str(log),
                           STUB_STEP_S="8", STUB_ROW='{"reward_mean": 0.25}', REF_SEED="1")
    assert own.returncode == 0, own.stdout + own.stderr
    assert "speed check: grpo-n8-s1's steps 2-6 take 8.0 s a step here, 8.0 s in its record (1.00x)" in own.stdout
    calls = log.read_text().splitlines()
    assert len(calls) == 8 and all("--seed 1" in check for check in calls[::2]) and all("--seed 2" in run for run in calls[1::2])


def test_replay_rebuilds_a_recorded_runs_checkpoints_bit_for_bit(tiny_model_dir, tmp_path, monkeypatch):
    """reproduce/replay_run.py on a run whose checkpoints are gone: training its recorded settings again
    gives the recorded metrics row for row and the same adapters at the recorded checkpoints, whose
    trainer_state carries the record's clock; a record it cannot match stops it at that step."""
    from safetensors.torch import load_file

    monkeypatch.setattr(rewards, "reward", length_reward)
    trained = tmp_path / "trained"
    assert train.main(tiny_args(tiny_model_dir, trained, "--steps", "5", "--save-every-steps", "2")) == 0
    kept = tmp_path / "kept"  # what git keeps of a run: its config and metrics
    kept.mkdir()
    for name in ("config.json", "metrics.jsonl"):
        (kept / name).write_bytes((trained / name).read_bytes())
    rows = read_metrics(kept)

    out = replay_run.replay(kept, tmp_path / "replayed")
    assert [p.name for p in checkpoint.find(out)] == [p.name for p in checkpoint.find(trained)] == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]
    for original, again in zip(checkpoint.find(trained), checkpoint.find(out)):
        a, b = load_file(original / "adapter_model.safetensors"), load_file(again / "adapter_model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        state = json.loads((again / "trainer_state.json").read_text())
        recorded = json.loads((original / "trainer_state.json").read_text())
        assert state["step"] == recorded["step"] and state["data_position"] == recorded["data_position"]
        assert state["elapsed_s"] == rows[state["step"] - 1]["elapsed_s"]  # the record's clock, not the replay's
    assert (out / "metrics.jsonl").read_bytes() == (kept / "metrics.jsonl").read_bytes()
    assert (out / "config.json").read_bytes() == (kept / "config.json").read_bytes()

    rows[2]["reward_mean"] += 0.5  # a record this machine does not reproduce from step 3 on
    (kept / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(replay_run.ReplayError, match=r"step 3 differs .* \(reward_mean: "):
        replay_run.replay(kept, tmp_path / "mismatch")
    assert [p.name for p in checkpoint.find(tmp_path / "mismatch")] == ["checkpoint-2"]  # nothing after the difference
    with pytest.raises(replay_run.ReplayError, match="is not empty"):
        replay_run.replay(kept, out)
    assert replay_run.main([str(tmp_path / "nothing"), str(tmp_path / "x")]) == 1


@pytest.mark.pure
def test_replay_compares_the_fields_logged_since_uniform_groups_only_where_the_record_has_them():
    """The records kept in reproduce/ predate uniform_share and its fellows: a replay that logs them still matches them."""
    recorded = {"step": 1, "reward_mean": 0.5, "elapsed_s": 9.0}
    replayed = {"step": 1, "reward_mean": 0.5, "elapsed_s": 7.0, "uniform_share": 0.25, "generation_rounds": 1, "prompts_drawn": 4,
                "informative_rows": 12}
    assert replay_run.differences(replayed, recorded) == []
    assert replay_run.differences(replayed, recorded | {"uniform_share": 0.5}) == ["uniform_share: 0.25 here, 0.5 recorded"]


@pytest.mark.pure
def test_replay_puts_checkpoints_where_train_py_saved_them_in_the_kept_records():
    """replay_run.checkpoint_steps on the records in reproduce/cpu-plateau: train.py's one-a-minute rule gives
    exactly the checkpoints that were evaluated, but for the two runs stopped and resumed (the stop
    saved a checkpoint the metrics do not show); a run trained on the reference clock (CLOCK=reference:
    no time budget) also has its chunks' last steps, which the metrics do not show either."""
    resumed = {"grpo-n4-s0", "pods-n8-m4-s2"}
    kept = sorted((HERE / "cpu-plateau").glob("*/eval-arith-2.json"))
    assert len(kept) >= 30
    for evaluation_file in kept:
        run = evaluation_file.parent
        config, rows = json.loads((run / "config.json").read_text()), read_metrics(run)
        steps = replay_run.checkpoint_steps(rows, config["save_every_minutes"], config["save_every_steps"])
        evaluated = {r["step"]: r["elapsed_s"] for r in json.loads(evaluation_file.read_text())["results"] if r["checkpoint"] != "base"}
        if run.name in resumed:
            assert set(steps) != set(evaluated), run.name
        elif config["time_budget"] == 0:
            assert set(steps) <= set(evaluated) and all(evaluated[k] == pytest.approx(t, abs=1e-3) for k, t in steps.items()), run.name
        else:
            assert steps == pytest.approx(evaluated, abs=1e-3), run.name


def assert_least_trained_goes_next(turns: list[dict]) -> None:
    """Every turn of reproduce/take_turns.py went to a run with the fewest seconds trained among those not done."""
    clock, done = {t["run"]: -1.0 for t in turns}, set()
    for t in turns:
        assert clock[t["run"]] == min(c for run, c in clock.items() if run not in done), t
        if t["step"] is None:
            done.add(t["run"])
        else:
            clock[t["run"]] = t["elapsed_s"]


WAITING_RUN = """import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import take_turns
take_turns.LIVENESS_S = 600.0  # it can only learn of its turn from the hand-off
turns = take_turns.Turns(Path(sys.argv[2]), None)
turns.join()
turns.wait()
turns.hand_on(1, 1.0, leave=True)
"""


@pytest.mark.pure
def test_take_turns_a_waiting_run_sleeps_until_handed_the_turn(tmp_path):
    """A run waiting for its turn does not poll (on 2 cores, polling every 10 ms slowed the computing run's
    steps 1.16-1.31x): over 2 s of waiting it is scheduled a handful of times, not ~200, and the hand-off
    alone wakes it (it would otherwise sleep LIVENESS_S, here 10 minutes)."""

    turn_dir = tmp_path / "turns"
    holder = take_turns.Turns(turn_dir, None)
    holder.join()  # this test process holds the turn
    waiter = subprocess.Popen([sys.executable, "-c", WAITING_RUN, str(HERE), str(turn_dir)],
                              stderr=subprocess.PIPE, text=True)
    state = turn_dir / "state.json"
    for _ in range(300):  # until it has joined and is waiting
        if state.exists() and waiter.pid in json.loads(state.read_text())["order"]:
            break
        time.sleep(0.1)
    time.sleep(0.5)

    def switches() -> int:
        status = Path(f"/proc/{waiter.pid}/status").read_text()
        return int(status.split("voluntary_ctxt_switches:")[1].split()[0])

    try:
        before = switches()
        time.sleep(2.0)
        assert switches() - before < 10
        holder.hand_on(1, 5.0)  # the waiter has trained less (nothing yet): its turn
        assert waiter.wait(timeout=30) == 0, waiter.stderr.read()
    finally:  # a failed assertion must not leave it waiting for 10 minutes
        waiter.kill()
    assert json.loads(state.read_text())["turn"] == holder.pid  # it took its turn, left, and handed it back
    holder.hand_on(None, leave=True)
    assert list(turn_dir.glob("*.wake")) == []


LENGTH_REWARD_LAUNCHER = """import runpy, sys
sys.path.insert(0, sys.argv.pop(1))  # the project
import rewards
import testkit
rewards.reward = testkit.length_reward  # a reward a random model earns unevenly
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def wait_until_joined(turn_dir: Path, runs: int, timeout_s: float = 120.0) -> None:
    """Until `runs` processes have joined reproduce/take_turns.py's rotation in turn_dir (a fixed sleep was
    too short on a loaded machine)."""

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if len(json.loads((turn_dir / "state.json").read_text())["order"]) >= runs:
                return
        except (OSError, ValueError):  # not written yet, or caught mid-write
            pass
        time.sleep(0.05)
    raise AssertionError(f"{runs} run(s) did not join {turn_dir} within {timeout_s} s")


def test_take_turns_runs_one_step_at_a_time_and_changes_nothing_but_the_clock(tiny_model_dir, tmp_path):
    """reproduce/take_turns.py, as reproduce/cpu_reproduction.sh starts it (one process a run, together): two runs'
    turns never overlap, start-ups come first in order, every turn goes to the run with the fewest seconds
    trained, each run's metrics and adapter are those of the same run made alone, and its elapsed_s counts
    its own turns only."""

    from safetensors.torch import load_file

    launcher = tmp_path / "launch.py"
    launcher.write_text(LENGTH_REWARD_LAUNCHER)
    turn_dir = tmp_path / "turns"

    def start(name: str, seed: int, *wrapper: str) -> subprocess.Popen:
        argv = tiny_args(tiny_model_dir, tmp_path / name, "--steps", "3", "--seed", str(seed))
        return subprocess.Popen([sys.executable, str(launcher), str(PROJECT), *wrapper, str(PROJECT / "train.py"), *argv],
                                cwd=PROJECT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    alone = start("alone", 0)
    assert alone.wait(timeout=300) == 0, alone.stderr.read()
    wrapper = (str(HERE / "take_turns.py"), str(turn_dir))
    first = start("a", 0, *wrapper)
    wait_until_joined(turn_dir, 1)  # a joins the rotation before b
    second = start("b", 1, *wrapper)
    wait_until_joined(turn_dir, 2)
    (turn_dir / "start").touch()
    for process in (first, second):
        assert process.wait(timeout=300) == 0, process.stderr.read()

    turns = [json.loads(line) for line in (turn_dir / "turns.jsonl").read_text().splitlines()]
    assert [(t["run"], t["step"]) for t in turns[:2]] == [("a", 1), ("b", 1)]  # start-ups first, in order
    assert sorted(t["step"] or 9 for t in turns if t["run"] == "a") == [1, 2, 3, 9]  # 9: the last turn
    assert all(earlier["end"] <= later["start"] for earlier, later in zip(turns, turns[1:]))  # one at a time
    assert_least_trained_goes_next(turns)
    assert [json.loads(line) for line in (tmp_path / "a" / "turns.jsonl").read_text().splitlines()] == [
        t for t in turns if t["run"] == "a"]
    timing = {"elapsed_s", "generation_s", "update_s"}
    strip = lambda rows: [{k: v for k, v in row.items() if k not in timing} for row in rows]  # noqa: E731
    assert strip(read_metrics(tmp_path / "a")) == strip(read_metrics(tmp_path / "alone"))
    adapter = load_file(tmp_path / "a" / "checkpoint-3" / "adapter_model.safetensors")
    assert adapter.keys() == (alone_adapter := load_file(tmp_path / "alone" / "checkpoint-3" / "adapter_model.safetensors")).keys()
    assert all(torch.equal(adapter[key], alone_adapter[key]) for key in adapter)
    for name in ("a", "b"):  # its steps only: less than its own turns, which also hold its start-up and checkpoints
        own = sum(t["end"] - t["start"] for t in turns if t["run"] == name)
        assert 0 < read_metrics(tmp_path / name)[-1]["elapsed_s"] < own


@pytest.mark.pure
def test_plateau_plan_taking_turns_starts_a_seeds_runs_together_and_keeps_their_clocks_together(tmp_path):
    """TAKE_TURNS=1: after one speed check, a seed's four runs start together under reproduce/take_turns.py,
    take turns so that their training clocks stay within a step (train.py stubbed: 9 s a step, PODS n=8
    m=4's 12 s, so 100 and 75 steps to the 15-minute budget), and the script returns when all four have
    finished; run again, it has nothing left to do."""
    root = project_copy(tmp_path)
    (root / "train.py").write_text(STUB_TRAIN)
    timed_run(root / "reproduce" / "cpu-plateau" / "grpo-n8-s0", {"seed": 0}, [9.0] * 120)
    log = tmp_path / "train-calls.txt"
    env = dict(PLAN="plateau", SEEDS="1", ABLATION_SEEDS="", STAGES="train", TAKE_TURNS="1", STUB_LOG=str(log), STUB_STEP_S="9,9,12,9")
    done = run_reproduction(root, **env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(1.00x)" in done.stdout
    calls = log.read_text().splitlines()
    assert len(calls) == 5 and "--steps 6" in calls[0]  # one check, then the group
    assert all("--seed 1" in call and "--steps 1000" in call for call in calls[1:])
    names = ["grpo-n8-s1", "pods-n8-m4-s1", "grpo-n4-s1", "pods-n16-m4-s1"]
    turns = [json.loads(line) for line in (root / "runs" / "cpu-plateau" / "turns" / "turns.jsonl").read_text().splitlines()]
    assert [t["run"] for t in turns[:4]] == names  # start-ups first, in the plan's order
    assert [sum(t["run"] == name for t in turns) for name in names] == [101, 76, 101, 101]  # steps, then the last turn
    assert all(earlier["end"] <= later["start"] for earlier, later in zip(turns, turns[1:]))
    assert_least_trained_goes_next(turns)
    for name in names:
        assert read_metrics(root / "runs" / "cpu-plateau" / name)[-1]["elapsed_s"] == 900
    again = run_reproduction(root, **env)
    assert again.returncode == 0 and len(log.read_text().splitlines()) == 5


@pytest.mark.pure
def test_plateau_report_leaves_out_the_seeds_listed_as_run_on_a_slower_machine(tmp_path):
    """STAGES=report of reproduce/cpu_reproduction.sh, as a user redraws it, on constructed records in a
    copy of the project: seed 2 ran twice as slow and is listed in slower-machine-seeds.txt, so the
    tables hold seeds 0-1, the *_all_seeds tables all three, its runs marked, and the *_reference_clock
    tables all three timed as seeds 0-1's machine would; seed 3, listed and trained but not evaluated, waits.
    Seed 4, listed, trained on the reference clock (CLOCK=reference: no time budget) on a machine 1.5x as
    slow, joins seeds 0-1 in the *_clock_to_budget tables, which leave out seed 2's wall-clock runs, and in the
    primary reading (cpu_primary.txt, cpu_paired_differences.png: reproduce/headline.py). Seed 5,
    on the clock too, has its GRPO run evaluated and its PODS run only trained (the session ended during its
    evaluation): it waits in every table, which stay paired seed by seed."""
    keep = project_copy(tmp_path) / "reproduce" / "cpu-plateau"
    rows = [{"completion_len": 20.0, "truncated_frac": 0.0}] * 40  # 10 s, then 3 s a step (x 2 at seed 2)
    for seed, speed in ((0, 1.0), (1, 1.0), (2, 2.0), (4, 1.5)):
        for name, config, curve in (("grpo-n8", {"rule": "none", "n": 8, "m": 8}, [0.1, 0.5, 0.7, 0.95]),
                                    ("pods-n8-m4", {"rule": "max_variance", "n": 8, "m": 4}, [0.1, 0.95, 0.95, 0.95])):
            how_long = {"time_budget": 0.0, "steps": 40} if seed == 4 else {"time_budget": 15.0, "steps": 1000}
            write_constructed_run(keep / f"{name}-s{seed}", {**config, "seed": seed, **how_long}, rows, list(zip((0, 10, 20, 30), curve)), speed)
    for name in ("grpo-n8-s3", "pods-n8-m4-s3"):  # a listed seed trained but not yet evaluated waits
        (keep / name).mkdir()
        shutil.copy(keep / name.replace("s3", "s2") / "config.json", keep / name)
        shutil.copy(keep / name.replace("s3", "s2") / "metrics.jsonl", keep / name)
    for name, config in (("grpo-n8-s5", {"rule": "none", "n": 8, "m": 8}), ("pods-n8-m4-s5", {"rule": "max_variance", "n": 8, "m": 4})):
        curve = [0.1, 0.2, 0.3, 0.4] if name.startswith("grpo") else None  # PODS's run: trained, not evaluated
        write_constructed_run(keep / name, {**config, "seed": 5, "time_budget": 0.0, "steps": 40}, rows,
                              None if curve is None else list(zip((0, 10, 20, 30), curve)))
    (keep / "slower-machine-seeds.txt").write_text("# seed  why\n2       constructed: twice as slow\n3       constructed\n"
                                                   "4       constructed: on the reference clock\n5       constructed: on the clock\n")
    done = run_reproduction(tmp_path, PLAN="plateau", STAGES="report")
    assert done.returncode == 0, done.stderr
    idle, every, clock, to_budget = ((tmp_path / "reproduce" / f"cpu_plateau_equal_rollouts{kind}.txt").read_text()
                                     for kind in ("", "_all_seeds", "_reference_clock", "_clock_to_budget"))
    assert re.search(r"^GRPO n=8 +2 ", idle, re.M) and "-s2" not in idle and "-s4" not in idle
    assert re.search(r"^GRPO n=8 +4 ", every, re.M) and re.search(r"^GRPO n=8 +4 ", clock, re.M)
    assert re.search(r"^GRPO n=8 +3 ", to_budget, re.M) and "grpo-n8-s4" in to_budget and "grpo-n8-s2" not in to_budget
    assert "seeds at 0.99 x peak: 0: 2.62x  1: 2.62x  4: 2.62x" in to_budget
    assert re.search(r"^grpo-n8-s2 .* 6\.0 +1\.60  slower machine$", every, re.M)  # 6 s against a median of 3.75 (3, 3, 4.5, 6)
    # GRPO first reaches 0.99 x its mean curve's peak at step 30 (97 s), PODS at step 10 (37 s), both twice as late in seed 2
    assert "seeds at 0.99 x peak: 0: 2.62x  1: 2.62x  2: 2.62x  4: 2.62x" in every
    assert "(4 runs; " in clock  # the reference: seeds 0-1's four runs
    assert "baseline GRPO n=8: peak 0.950" in clock and "baseline GRPO n=8: peak 0.950" not in every
    assert not any("-s5" in table for table in (idle, every, clock, to_budget))
    # the primary reading (reproduce/headline.py): the to-budget seeds; equal updates has no runs here and waits
    primary = (tmp_path / "reproduce" / "cpu_primary.txt").read_text().splitlines()
    assert primary[0] == "equal rollouts updated: no evaluated runs yet"
    assert primary[1].startswith("equal rollouts generated: PODS max_variance n=8 m=4 against GRPO n=8, seeds 0, 1, 4 (3)")
    assert (tmp_path / "reproduce" / "cpu_paired_differences.png").exists()


@pytest.mark.pure
def test_first_plan_report_draws_the_evaluated_runs_while_a_kept_run_waits_for_its_evaluation(tmp_path):
    """STAGES=report of the first plan (reproduce/cpu/), with a run whose records were kept when its training
    ended but which has no evaluation yet (the machine went first): the figures are drawn from the
    evaluated runs, the waiting run left out, instead of the figure failing on it."""
    keep = project_copy(tmp_path) / "reproduce" / "cpu"
    rows = [{"completion_len": 20.0, "truncated_frac": 0.0}] * 40
    for seed in (0, 1):
        write_constructed_run(keep / f"grpo-n8-s{seed}", {"rule": "none", "n": 8, "m": 8, "seed": seed}, rows,
                              list(zip((0, 10, 20, 30), [0.1, 0.5, 0.7, 0.95])))
        write_constructed_run(keep / f"pods-n8-m4-s{seed}", {"rule": "max_variance", "n": 8, "m": 4, "seed": seed}, rows,
                              list(zip((0, 10, 20, 30), [0.1, 0.95, 0.95, 0.95])))
    write_constructed_run(keep / "pods-n8-m2-s0", {"rule": "max_variance", "n": 8, "m": 2, "seed": 0}, rows)  # not evaluated
    done = run_reproduction(tmp_path, STAGES="report")
    assert done.returncode == 0, done.stderr
    assert "not drawn yet: reproduce/cpu_equal_rollouts " not in done.stdout
    table = (tmp_path / "reproduce" / "cpu_equal_rollouts.txt").read_text()
    assert re.search(r"^GRPO n=8 +2 ", table, re.M) and re.search(r"^PODS max_variance n=8 m=4 +2 ", table, re.M)
    assert "m=2" not in table


STUB_CLOCK_TRAIN = """import json, os, sys
def main(args):  # train.py as the reference clock's chunks call it, without training: --steps, --resume, checkpoints
    value = lambda flag, default=None: args[args.index(flag) + 1] if flag in args else default  # noqa: E731
    out, steps, every = value("--out-dir"), int(value("--steps")), int(value("--save-every-steps"))
    open(os.environ["STUB_LOG"], "a").write(" ".join(args) + "\\n")
    os.makedirs(out, exist_ok=True)
    start = 0
    if "--resume" in args:  # from the last checkpoint; rows after it are dropped, as train.py does
        start = max(int(d.split("-")[1]) for d in os.listdir(out) if d.startswith("checkpoint-"))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][:start] if start else []
    n = int(value("--n")); m = int(value("--m", n))
    config = {"model_resolved": "embedded", "rule": value("--rule"), "n": n, "m": m, "seed": int(value("--seed")),
              "steps": steps, "time_budget": 0.0, "save_every_steps": every}
    open(os.path.join(out, "config.json"), "w").write(json.dumps(config, indent=2))
    stop_at = int(os.environ.get("STUB_STOP_AT", "0"))
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\\n")
        for k in range(start + 1, steps + 1):  # 5 s a step on this machine; 3 s on the reference's (completion_len 20)
            f.write(json.dumps({"step": k, "elapsed_s": 5.0 * k, "generation_s": 2.5, "update_s": 2.5,
                                "completion_len": 20.0, "truncated_frac": 0.0}) + "\\n")
            if k % every == 0 or k == steps or k == stop_at:
                os.makedirs(os.path.join(out, f"checkpoint-{k}"), exist_ok=True)
            if k == stop_at and out.endswith(os.environ.get("STUB_STOP_RUN", "")):  # Ctrl-C (of that run, if named):
                return 130  # train.py saves the finished step, then exits 130
    return 0
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""


def reference_clock_records(root: Path) -> Path:
    """Seed 0's four kept runs in root's reproduce/cpu-plateau, the reference clock's machine: a first step of
    10 s, then 3 s a step (completion_len 20), 40 steps (127 s). Returns reproduce/cpu-plateau."""
    keep = root / "reproduce" / "cpu-plateau"
    rows = [{"completion_len": 20.0, "truncated_frac": 0.0}] * 40
    for name, config in (("grpo-n8-s0", {"rule": "none", "n": 8, "m": 8}), ("pods-n8-m4-s0", {"rule": "max_variance", "n": 8, "m": 4}),
                         ("grpo-n4-s0", {"rule": "none", "n": 4, "m": 4}), ("pods-n16-m4-s0", {"rule": "max_variance", "n": 16, "m": 4})):
        write_constructed_run(keep / name, {**config, "seed": 0, "time_budget": 1.0}, rows)
    return keep


@pytest.mark.pure
def test_plateau_plan_on_the_reference_clock_trains_a_new_seed_in_chunks_to_the_budget_and_resumes_after_ctrl_c(tmp_path):
    """CLOCK=reference, as a user runs it on a machine of another speed (train.py stubbed: its steps take
    5 s here and cost 3 s on the reference clock fit on seed 0's kept runs, whose first step took 10 s).
    Seed 5's first run is stopped by a Ctrl-C at step 7, the same command continues it from checkpoint-7;
    each run trains in chunks of --steps until the clock reaches BUDGET=1 minute (10 + 17 x 3 = 61 s: 18
    steps, on this machine's clock 90 s), no speed check runs, and seed 5 is listed once in
    slower-machine-seeds.txt; a finished plan trains nothing more, and a kept seed's missing run is refused."""
    root = project_copy(tmp_path)
    (root / "train.py").write_text(STUB_CLOCK_TRAIN)
    keep = reference_clock_records(root)
    log = tmp_path / "train-calls.txt"
    plan = dict(PLAN="plateau", CLOCK="reference", BUDGET="1", SEEDS="5", ABLATION_SEEDS="", STAGES="train", STUB_LOG=str(log))
    stopped = run_reproduction(root, **plan, STUB_STOP_AT="7")
    assert stopped.returncode != 0 and "grpo-n8-s5: 17 more steps to reach 1 minutes on the reference clock" in stopped.stdout
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and "--steps 17" in calls[0] and "--save-every-steps 20" in calls[0] and "--time-budget" not in calls[0]
    assert not (keep / "grpo-n8-s5").exists()  # not finished: nothing kept yet

    done = run_reproduction(root, **plan)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = log.read_text().splitlines()
    grpo_calls = [c for c in calls if "grpo-n8-s5" in c]
    # resumed at checkpoint-7 for the 17 steps planned, then one step more: 10 + 16 x 3 = 58 s, then 61 s
    assert ["--resume" in c for c in grpo_calls] == [False, True, True]
    assert [re.search(r"--steps (\d+)", c).group(1) for c in grpo_calls] == ["17", "17", "18"]
    for name in ("grpo-n8-s5", "pods-n8-m4-s5", "grpo-n4-s5", "pods-n16-m4-s5"):
        rows = read_metrics(root / "runs" / "cpu-plateau" / name)
        assert [r["step"] for r in rows] == list(range(1, 19)) and rows[-1]["elapsed_s"] == 90.0
        for record in ("config.json", "metrics.jsonl"):  # kept in reproduce/ as soon as it finished, before any evaluation
            assert (keep / name / record).read_text() == (root / "runs" / "cpu-plateau" / name / record).read_text()
    assert len(calls) == 3 + 3 * 2 and not any("--steps 6" in c for c in calls)  # the others in two chunks; no speed check
    listed = [line for line in (keep / "slower-machine-seeds.txt").read_text().splitlines() if line.startswith("5 ")]
    assert len(listed) == 1 and "trained on the reference clock (CLOCK=reference" in listed[0]

    again = run_reproduction(root, **plan)
    assert again.returncode == 0 and len(log.read_text().splitlines()) == len(calls)  # finished: nothing trained

    refused = run_reproduction(root, **{**plan, "SEEDS": "", "ABLATION_SEEDS": "0"})
    assert refused.returncode == 1 and len(log.read_text().splitlines()) == len(calls)
    assert ("CLOCK=reference: seed 0's runs in reproduce/cpu-plateau (" in refused.stdout
            and "are the reference clock's own runs" in refused.stdout and "maxreward-n8-m4-s0" in refused.stdout)
    assert run_reproduction(root, **{**plan, "CLOCK": "sundial"}).stdout.startswith("CLOCK=sundial: pass CLOCK=wall")
    first = run_reproduction(root, **{**plan, "PLAN": "first", "CLOCK": "wall", "TAKE_TURNS": "1"})  # (it would wait forever)
    assert first.returncode == 1 and first.stdout.startswith("TAKE_TURNS=1 is for PLAN=plateau")


@pytest.mark.pure
def test_plateau_plan_on_the_reference_clock_continues_one_comparison_to_a_longer_budget(tmp_path):
    """GRPO n=4 still rising at the budget, as a user continues equal updates only (train.py stubbed, as
    above): seed 5 trained on the clock to BUDGET=1 minute (18 steps), then BUDGET=2 COMPARISONS=updates
    resumes GRPO n=4 and PODS n=16 m=4 from their last checkpoint to 2 minutes (10 + 37 x 3 = 121 s: 38
    steps, in two chunks) and keeps their longer records in reproduce/; equal rollouts' runs are not touched. A
    misspelt COMPARISONS is refused before anything trains."""
    root = project_copy(tmp_path)
    (root / "train.py").write_text(STUB_CLOCK_TRAIN)
    keep = reference_clock_records(root)
    log = tmp_path / "train-calls.txt"
    plan = dict(PLAN="plateau", CLOCK="reference", SEEDS="5", ABLATION_SEEDS="", STAGES="train", STUB_LOG=str(log))
    assert run_reproduction(root, **plan, BUDGET="1").returncode == 0
    first = len(log.read_text().splitlines())
    longer = run_reproduction(root, **plan, BUDGET="2", COMPARISONS="updates")
    assert longer.returncode == 0, longer.stdout + longer.stderr
    calls = log.read_text().splitlines()[first:]
    assert all("--resume" in c for c in calls)  # each in chunks (as above: 37 steps planned, then one more)
    assert [(re.search(r"--out-dir \S+/(\S+)", c).group(1), re.search(r"--steps (\d+)", c).group(1)) for c in calls] == [
        ("grpo-n4-s5", "37"), ("grpo-n4-s5", "38"), ("pods-n16-m4-s5", "37"), ("pods-n16-m4-s5", "38")]
    for name, steps in (("grpo-n8-s5", 18), ("pods-n8-m4-s5", 18), ("grpo-n4-s5", 38), ("pods-n16-m4-s5", 38)):
        assert len(read_metrics(keep / name)) == steps
    assert run_reproduction(root, **plan, BUDGET="2", COMPARISONS="updates").returncode == 0  # reached: nothing more
    assert len(log.read_text().splitlines()) == first + 4
    typo = run_reproduction(root, **plan, BUDGET="3", COMPARISONS="update")
    assert typo.returncode == 1 and typo.stdout.startswith("COMPARISONS=update: pass rollouts, updates or both")
    assert len(log.read_text().splitlines()) == first + 4


@pytest.mark.pure
def test_plateau_report_draws_equal_updates_to_the_longer_budget_on_the_seeds_that_reached_it(tmp_path):
    """STAGES=report with LONG_BUDGET=3: seeds 6 and 7 trained equal updates on the clock to 3.6 minutes
    (70 steps, 1.5x as slow as the reference machine), seed 5 to 2.1 minutes; the longer table
    (reproduce/cpu_plateau_equal_updates_clock_3min) holds seeds 6 and 7 only, read to 3.6 minutes, while the
    to-budget table keeps all three to the shortest run's end."""
    keep = reference_clock_records(project_copy(tmp_path))
    listed = "# seed  why\n" + "".join(f"{seed}       constructed: on the clock\n" for seed in (5, 6, 7))
    (keep / "slower-machine-seeds.txt").write_text(listed)
    for seed, steps in ((5, 40), (6, 70), (7, 70)):
        rows = [{"completion_len": 20.0, "truncated_frac": 0.0}] * steps  # 3 s a step on the clock
        checkpoints = list(range(0, steps + 1, 10))
        for name, config, curve in (("grpo-n4", {"rule": "none", "n": 4, "m": 4}, [0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.9, 0.9]),
                                    ("pods-n16-m4", {"rule": "max_variance", "n": 16, "m": 4}, [0.1] + [0.9] * 7)):
            write_constructed_run(keep / f"{name}-s{seed}", {**config, "seed": seed, "time_budget": 0.0, "steps": steps}, rows,
                                  list(zip(checkpoints, curve)), speed=1.5)
    done = run_reproduction(tmp_path, PLAN="plateau", STAGES="report", LONG_BUDGET="3")
    assert done.returncode == 0, done.stderr
    longer = (tmp_path / "reproduce" / "cpu_plateau_equal_updates_clock_3min.txt").read_text()
    to_budget = (tmp_path / "reproduce" / "cpu_plateau_equal_updates_clock_to_budget.txt").read_text()
    assert re.search(r"^GRPO n=4 +2 ", longer, re.M) and "grpo-n4-s6" in longer and "-s5" not in longer
    assert "shortest run's end, 3.6 min on the reference clock" in longer  # 10 + 69 x 3 = 217 s
    assert re.search(r"^GRPO n=4 +3 ", to_budget, re.M) and "shortest run's end, 2.1 min" in to_budget


STUB_EVAL = """from eval_real import *  # noqa: F401,F403 (the reference clock and the record readers, as the script imports them)
import json, os, sys
if __name__ == "__main__":  # evaluating a run's checkpoints: logged, and an evaluation written
    open(os.environ["STUB_LOG"], "a").write("eval " + " ".join(sys.argv[1:]) + "\\n")
    open(os.path.join(sys.argv[1], "eval-arith-2.json"), "w").write(json.dumps({"results": []}))
"""


@pytest.mark.pure
def test_plateau_plan_evaluates_each_run_as_soon_as_it_has_trained_so_a_lost_machine_takes_no_trained_run(tmp_path):
    """The plan as sessions run it (CLOCK=reference, the default STAGES, train.py and eval.py's
    evaluation stubbed): each run's checkpoints are evaluated, and the evaluation kept in reproduce/, before
    the next run trains. The machine going during seed 5's second run (its train.py stopped) leaves the
    first run evaluated in reproduce/; the same command on a fresh machine (runs/ gone) trains the rest, each
    evaluated once, right after its training, and adds nothing for the first."""
    root = project_copy(tmp_path)
    (root / "train.py").write_text(STUB_CLOCK_TRAIN)
    (root / "eval_real.py").write_text((root / "eval.py").read_text())
    (root / "eval.py").write_text(STUB_EVAL)
    keep = reference_clock_records(root)
    log = tmp_path / "calls.txt"
    plan = dict(PLAN="plateau", CLOCK="reference", BUDGET="1", SEEDS="5", ABLATION_SEEDS="", STAGES="train eval", STUB_LOG=str(log))
    lost = run_reproduction(root, **plan, STUB_STOP_AT="7", STUB_STOP_RUN="pods-n8-m4-s5")
    assert lost.returncode != 0
    calls = [line.split("--out-dir ")[-1] if "--out-dir" in line else line for line in log.read_text().splitlines()]
    assert calls[-2:] == ["eval runs/cpu-plateau/grpo-n8-s5 --dataset arith:2 --limit 256 --repeats 1", "runs/cpu-plateau/pods-n8-m4-s5"]
    assert set(calls[:-2]) == {"runs/cpu-plateau/grpo-n8-s5"}  # its chunks of training
    assert (keep / "grpo-n8-s5" / "eval-arith-2.json").exists() and not (keep / "pods-n8-m4-s5").exists()

    shutil.rmtree(root / "runs")  # the machine and its checkpoints are gone; reproduce/ came back with git
    log.unlink()
    again = run_reproduction(root, **plan)
    assert again.returncode == 0, again.stdout + again.stderr
    calls = log.read_text().splitlines()
    assert not any("grpo-n8-s5" in c for c in calls)  # trained and evaluated before: nothing more
    names = [re.search(r"runs/cpu-plateau/(\S+)", c).group(1) for c in calls]
    evals = [n for c, n in zip(calls, names) if c.startswith("eval ")]
    assert evals == ["pods-n8-m4-s5", "grpo-n4-s5", "pods-n16-m4-s5"]  # once each
    for name in evals:  # right after its last chunk of training, before the next run's first
        trained_at = [i for i, n in enumerate(names) if n == name and not calls[i].startswith("eval ")]
        evaluated_at = [i for i, n in enumerate(names) if n == name and calls[i].startswith("eval ")]
        assert evaluated_at == [trained_at[-1] + 1], (name, calls)
        assert (keep / name / "eval-arith-2.json").exists()
    assert re.search(r"this invocation: training \d+ min, evaluation \d+ min", again.stdout)

