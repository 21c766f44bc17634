"""reproduce/uniform_groups.sh, issue 53's exploratory comparison, as a user runs it: train.py and eval.py
stubbed in a copy of the project (the plan, its flags, resuming), and the report on constructed records."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_cpu_reproduction import project_copy

from testkit import write_constructed_run

STUB_TRAIN = """import json, os, sys
args = sys.argv[1:]
value = lambda flag, default=None: args[args.index(flag) + 1] if flag in args else default  # noqa: E731
out = value("--out-dir")
open(os.environ["STUB_LOG"], "a").write("train " + " ".join(args) + "\\n")
os.makedirs(out, exist_ok=True)
n = int(value("--n")); config = {"model_resolved": "embedded", "rule": value("--rule"), "n": n, "m": int(value("--m", n)),
                                 "seed": int(value("--seed")), "uniform_groups": value("--uniform-groups", "keep")}
open(os.path.join(out, "config.json"), "w").write(json.dumps(config))
with open(os.path.join(out, "metrics.jsonl"), "w") as f:  # a step a minute, to the time budget
    for k in range(1, int(float(value("--time-budget"))) + 1):
        f.write(json.dumps({"step": k, "elapsed_s": 60.0 * k, "generation_s": 30.0, "update_s": 30.0}) + "\\n")
os.makedirs(os.path.join(out, "checkpoint-%d" % k), exist_ok=True)
"""
STUB_EVAL = """import json, os, sys
open(os.environ["STUB_LOG"], "a").write("eval " + " ".join(sys.argv[1:]) + "\\n")
open(os.path.join(sys.argv[1], "eval-arith-2.json"), "w").write(json.dumps({"results": []}))
"""


def run_plan(root: Path, **env: str) -> subprocess.CompletedProcess:
    """bash reproduce/uniform_groups.sh in a project copy, with this interpreter as `python`."""
    env = {**{k: v for k, v in os.environ.items() if k != "OUT"}, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env}
    return subprocess.run(["bash", str(root / "reproduce" / "uniform_groups.sh")], env=env, capture_output=True, text=True, timeout=120)


def stubbed_project(tmp_path: Path, bfloat16: bool = True) -> Path:
    root = project_copy(tmp_path)
    (root / "train.py").write_text(STUB_TRAIN)
    (root / "eval.py").write_text(STUB_EVAL)
    (root / "model.py").write_text(f"def computes_bfloat16(device):\n    return {bfloat16}\n")
    return root


@pytest.mark.pure
def test_plan_trains_each_arm_with_its_flags_rotating_their_order_and_resumes_where_it_stopped(tmp_path):
    """Seeds 0 and 1: three 10-minute runs each, the arms' order rotated by the seed, each with the reproduction's
    settings and its own --rule/--n/--m/--uniform-groups; each run's record kept, then every run evaluated on 128
    problems. Run again after a stop: trained runs are not redone, a run with a checkpoint resumes, one without starts over."""
    root, log = stubbed_project(tmp_path), tmp_path / "calls.log"
    done = run_plan(root, STAGES="train eval", SEEDS="0 1", STUB_LOG=str(log))
    assert done.returncode == 0, done.stdout + done.stderr
    calls = log.read_text().splitlines()
    trained = [re.search(r"--out-dir runs/uniform-groups/(\S+)", c).group(1) for c in calls if c.startswith("train ")]
    assert trained == ["pods-keep-s0", "pods-refill-s0", "grpo-refill-s0", "pods-refill-s1", "grpo-refill-s1", "pods-keep-s1"]
    for call in calls[:6]:
        assert ("--dataset arith:2 --prompts-per-step 4 --max-new-tokens 32 --lr 3e-4 --warmup-ratio 0 --bf16-autocast "
                "--merged-sampler --steps 1000 --time-budget 10 --save-every-minutes 2 --save-every-steps 0") in call
    assert "--rule max_variance --n 8 --m 4 --out-dir" in calls[0]
    assert "--rule max_variance --n 8 --m 4 --uniform-groups refill --out-dir" in calls[1]
    assert "--rule none --n 8 --uniform-groups refill --out-dir" in calls[2]
    assert calls[6:] == [f"eval runs/uniform-groups/{arm}-s{seed} --dataset arith:2 --limit 128 --repeats 1"
                         for seed in (0, 1) for arm in ("pods-keep", "pods-refill", "grpo-refill")]
    keep = root / "reproduce" / "uniform-groups"
    assert {p.name for p in (keep / "pods-refill-s1").iterdir()} == {"config.json", "metrics.jsonl", "eval-arith-2.json"}

    runs = root / "runs" / "uniform-groups"  # a stop: seed 2's first run had saved a checkpoint, its second had not
    (runs / "grpo-refill-s2" / "checkpoint-2").mkdir(parents=True)
    (runs / "grpo-refill-s2" / "metrics.jsonl").write_text(json.dumps({"step": 2, "elapsed_s": 120.0}) + "\n")
    (runs / "pods-keep-s2").mkdir()
    (runs / "pods-keep-s2" / "metrics.jsonl").write_text(json.dumps({"step": 1, "elapsed_s": 60.0}) + "\n")
    log.unlink()
    again = run_plan(root, STAGES="train", SEEDS="0 1 2", STUB_LOG=str(log))
    assert again.returncode == 0, again.stdout + again.stderr
    calls = log.read_text().splitlines()
    assert [re.search(r"--out-dir runs/uniform-groups/(\S+)", c).group(1) for c in calls] == [
        "grpo-refill-s2", "pods-keep-s2", "pods-refill-s2"]
    assert calls[0].endswith("--resume --out-dir runs/uniform-groups/grpo-refill-s2") and "--resume" not in calls[1]


@pytest.mark.pure
def test_plan_stops_on_a_cpu_without_bfloat16_arithmetic_and_on_an_unknown_arm(tmp_path):
    root, log = stubbed_project(tmp_path, bfloat16=False), tmp_path / "calls.log"
    stopped = run_plan(root, SEEDS="0", STUB_LOG=str(log))
    assert stopped.returncode == 1 and stopped.stdout.startswith("this CPU has no bfloat16 arithmetic") and not log.exists()
    unknown = run_plan(root, ARMS="pods-keep pods-skip", STAGES="report", STUB_LOG=str(log))
    assert unknown.returncode == 1 and unknown.stderr.startswith("unknown arm 'pods-skip' in ARMS") and "Traceback" not in unknown.stderr


@pytest.mark.pure
def test_report_reads_every_arm_against_pods_keep_on_the_seeds_where_all_three_were_evaluated(tmp_path):
    """STAGES=report on constructed records: the refill arms are settings of their own (plot.label_of names
    --uniform-groups), each paired with PODS keep seed by seed; seed 2, whose GRPO refill run has no evaluation
    yet, is left out; the step-cost table reads refill's longer steps against refill's, not keep's."""
    keep = project_copy(tmp_path) / "reproduce" / "uniform-groups"
    rows = [{"completion_len": 20.0, "truncated_frac": 0.0, "uniform_share": 0.5, "generation_rounds": 1, "prompts_drawn": 4,
             "informative_rows": 8}] * 39 + [{"completion_len": 20.0, "truncated_frac": 0.0, "uniform_share": 1.0,
                                               "generation_rounds": 3, "prompts_drawn": 12, "informative_rows": 0}]
    arms = (("pods-keep", {"rule": "max_variance", "n": 8, "m": 4}, [0.1, 0.5, 0.7, 0.9], 1.0),
            ("pods-refill", {"rule": "max_variance", "n": 8, "m": 4, "uniform_groups": "refill"}, [0.1, 0.9, 0.9, 0.9], 2.0),
            ("grpo-refill", {"rule": "none", "n": 8, "m": 8, "uniform_groups": "refill"}, [0.1, 0.3, 0.5, 0.7], 2.0))
    for seed in (0, 1, 2):
        for name, config, curve, speed in arms:
            results = None if (seed, name) == (2, "grpo-refill") else list(zip((0, 10, 20, 30), curve))
            write_constructed_run(keep / f"{name}-s{seed}", {**config, "seed": seed}, rows, results, speed)
    done = run_plan(tmp_path, STAGES="report")
    assert done.returncode == 0, done.stdout + done.stderr
    table = (keep / "report.txt").read_text()
    assert (keep / "report.png").exists() and done.stdout.startswith(table.strip())
    for label in ("PODS max_variance n=8 m=4", "PODS max_variance n=8 m=4 refill", "GRPO n=8 refill"):
        assert re.search(rf"^{re.escape(label)} +2 ", table, re.M), label  # seeds 0 and 1
    assert re.search(r"^PODS max_variance n=8 m=4 refill +0\.\d+ +0\.\d+ +\+0\.\d+ \[", table, re.M)  # mean accuracy, t interval
    assert "-s2" not in table and "slower machine" not in table
    steps = (keep / "steps.txt").read_text()  # every trained seed, evaluated or not: 40 steps, the last without an update
    assert re.search(r"^pods-keep +3 +40\.0 +0\.51 +1\.05 +4\.20 +7\.8 +0\.0 +", steps, re.M)
    assert re.search(r"^grpo-refill +3 +40\.0 +0\.51 +1\.05 +4\.20 +7\.8 +1\.0 +", steps, re.M)
