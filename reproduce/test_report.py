"""reproduce/: the statistics over seeds (stats.py), the reference clock (reference_clock.py) and the
report's tables (report.py), on constructed curves and records with known answers."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import headline
import numpy as np
import pytest
import report
import seen_test_questions
import stats
from reference_clock import ReferenceClock
from scipy import stats as scipy_stats

import plot
from testkit import fake_run, timed_run, write_constructed_run

pytestmark = pytest.mark.pure  # no torch, transformers, peft or vLLM code: CI runs it once


def test_step_costs_read_the_machine_speed_from_steps_2_to_6_and_mark_a_slower_machine(tmp_path):
    def run_with(name, seed, seconds):
        return timed_run(tmp_path / name, {"rule": "none", "n": 8, "m": 8, "seed": seed}, seconds)
    # step 1 warms up, steps 2-6 come before learning, then completions are short
    fast = [run_with(f"grpo-s{seed}", seed, [50, 10, 12, 11, 30, 13, 5, 5]) for seed in (0, 1)]
    slow = run_with("grpo-s2", 2, [50, 16, 16, 16, 16, 16, 5, 5])
    header, row0, _, row2 = report.step_costs([*fast, slow])
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
    rows = {line.split()[0]: line.split() for line in report.step_costs(runs)[1:]}
    assert rows["maxreward-s0"][6:] == ["1.30", "slower", "machine"]  # 13 / median(10, 10, 13)
    assert rows["maxvar-s0"][6:] == ["1.00"] and rows["grpo-s0"][6:] == ["1.00"]


def test_speedup_of_means_on_constructed_curves_with_known_answers():
    base = [([0, 60, 120, 180], [0.1, 0.3, 0.5, 0.6])]  # peak 0.6, target 0.594: reached at 180 s
    assert stats.speedup_of_means(base, [([0, 60, 90], [0.1, 0.5, 0.6])]) == pytest.approx(2.0)
    assert stats.speedup_of_means(base, [([0, 60, 120], [0.1, 0.2, 0.3])]) is None  # never reaches the target: no number
    assert stats.speedup_of_means(base, [([0, 60], [0.7, 0.8])]) == math.inf  # there from the start
    two_seeds = [([0, 60, 120], [0.1, 0.4, 0.8]), ([0, 60, 120], [0.1, 0.6, 0.4])]  # mean 0.1, 0.5, 0.6
    assert stats.speedup_of_means(base, two_seeds) == pytest.approx(1.5)  # the mean curve, not each seed


def test_leaving_one_seed_out_moves_the_seed_mean_speedup_and_names_a_never_reaching_one_as_none():
    times = [0, 60, 120, 180]
    base = [(times, [0.1, 0.5, 0.8, 1.0])] * 3  # peak 1.0, target 0.99 at 180 s, whichever seeds are kept
    other = [(times, [0.1, 1.0, 1.0, 1.0]), (times, [0.1, 1.0, 1.0, 1.0]), (times, [0.1, 0.2, 0.2, 0.2])]
    # without seed 0 or 1: the mean of a fast seed and the slow one never passes 0.6; without seed 2: 3x
    assert stats.leave_one_out_speedups(base, other) == [None, None, pytest.approx(3.0)]
    with pytest.raises(plot.PlotError, match="same seeds"):
        stats.leave_one_out_speedups(base, other[:2])


def test_t_interval_is_the_mean_plus_minus_t_times_the_standard_error_written_out():
    """Six seeds' differences 0.1, 0.3, 0.2, 0.4, 0.0, 0.2: mean 0.2; s = sqrt((0.01 + 0.01 + 0 + 0.04
    + 0.04 + 0) / 5) = sqrt(0.02) = 0.141421; s / sqrt(6) = 0.057735; t(0.975, 5) = 2.570582; half-width
    2.570582 x 0.057735 = 0.148413: [0.051587, 0.348413]. A percentile bootstrap would span ~1.8 standard errors."""
    values = [0.1, 0.3, 0.2, 0.4, 0.0, 0.2]
    assert stats.t_interval(values) == pytest.approx((0.2, 0.051587, 0.348413), abs=1e-6)
    base = np.array([0.5, 0.4, 0.6, 0.3, 0.7, 0.5])
    scipy_interval = scipy_stats.ttest_rel(base + values, base).confidence_interval(0.95)
    assert stats.t_interval(values)[1:] == pytest.approx((scipy_interval.low, scipy_interval.high))
    # ten seeds: t(0.975, 9) = 2.262157; values 0..9 have mean 4.5, s = sqrt(82.5 / 9) = 3.027650, s / sqrt(10) = 0.957427, half-width 2.165851
    assert stats.t_interval(range(10)) == pytest.approx((4.5, 4.5 - 2.165851, 4.5 + 2.165851), abs=1e-6)
    assert stats.t_interval([0.1, 0.1, 0.1]) == pytest.approx((0.1, 0.1, 0.1))  # no spread, no width
    with pytest.raises(plot.PlotError, match="two seeds or more"):
        stats.t_interval([0.1])


def test_order_statistic_interval_for_the_median_has_the_binomial_ranks_and_coverage():
    """The median's distribution-free interval [x_(j), x_(k+1-j)] covers with 1 - 2 P(Binomial(k, 1/2) <= j - 1):
    k = 6: j = 1, 1 - 2 / 64 = 0.96875 ([min, max]; j = 2 would give 1 - 2 x 7 / 64 = 0.78);
    k = 10: j = 2, 1 - 2 x 11 / 1024 = 0.978516 (j = 3: 1 - 2 x 56 / 1024 = 0.89);
    k = 13: j = 3, 1 - 2 x 92 / 8192 = 0.977539; k = 5: no ranks reach 95%, [min, max] covers 1 - 2 / 32 = 0.9375."""
    assert stats.order_statistic_ranks(6) == (1, 6, pytest.approx(1 - 2 / 64))
    assert stats.order_statistic_ranks(10) == (2, 9, pytest.approx(1 - 22 / 1024))
    assert stats.order_statistic_ranks(13) == (3, 11, pytest.approx(1 - 184 / 8192))
    assert stats.order_statistic_ranks(5) == (1, 5, pytest.approx(0.9375))
    six = stats.median_interval([(r, r) for r in (0.77, 1.39, 1.39, 2.08, 1.52, 1.49)])  # equal rollouts' six seeds at 0.99 x
    assert (six["median_low"], six["median_high"], six["low"], six["high"]) == pytest.approx((1.44, 1.44, 0.77, 2.08))
    assert six["ranks"] == (1, 6) and six["coverage"] == pytest.approx(0.96875)
    ten = stats.median_interval([(r, r) for r in (5, 1, 9, 3, 7, 2, 8, 4, 10, 6)])
    assert (ten["median_low"], ten["low"], ten["high"]) == (5.5, 2, 9)  # the 2nd and 9th smallest


def test_paired_differences_are_means_over_seed_pairs_with_t_intervals():
    base = [([0, 60, 120], [0.1, 0.2, 0.3]), ([0, 60, 120], [0.1, 0.4, 0.5])]
    shifted = [([0, 60, 120], [a + 0.1 for a in acc]) for _, acc in base]
    for mean, low, high in stats.paired_differences(base, shifted, [60, 120]):
        assert (mean, low, high) == pytest.approx((0.1, 0.1, 0.1))  # the same difference in every pair: no spread
    # differences +0.2 and 0.0 at 60 s: mean 0.1, s = 0.141421, s / sqrt(2) = 0.1, t(0.975, 1) = 12.706205
    other = [([0, 60, 120], [0.1, 0.4, 0.3]), ([0, 60, 120], [0.1, 0.4, 0.5])]
    (mean, low, high), = stats.paired_differences(base, other, [60])
    assert (mean, low, high) == pytest.approx((0.1, 0.1 - 1.2706205, 0.1 + 1.2706205))
    (mean, _, _), = stats.paired_differences(base, other, [30])  # interpolated: +0.1 halfway to 60 s
    assert mean == pytest.approx(0.05)
    with pytest.raises(plot.PlotError, match="same seeds"):
        stats.paired_differences(base, other[:1], [60])


def test_mean_accuracy_is_the_area_under_the_curve_over_the_horizon():
    run = ([0, 60, 120], [0.0, 0.6, 0.6])
    # to 120 s: a triangle 60 x 0.6 / 2 = 18 and a rectangle 60 x 0.6 = 36, over 120 s: 0.45
    assert stats.mean_accuracy(run, 120) == pytest.approx(0.45)
    assert stats.mean_accuracy(run, 90) == pytest.approx((18 + 30 * 0.6) / 90)  # read up to 90 s: 0.4
    assert stats.mean_accuracy(([0, 30, 120], [0.2, 0.2, 0.2]), 120) == pytest.approx(0.2)
    with pytest.raises(plot.PlotError, match="no mean accuracy up to 3.0 min"):
        stats.mean_accuracy(run, 180)


def test_mean_accuracy_difference_is_paired_with_a_t_interval_and_counts_the_seeds_higher():
    times = [0, 60, 120]
    base = [(times, [0.0, 0.6, 0.6]), (times, [0.0, 0.2, 0.6]), (times, [0.0, 0.4, 0.6])]  # means 0.45, 0.25, 0.35
    other = [(times, [0.0, 0.6, 0.6]), (times, [0.0, 0.6, 0.6]), (times, [0.0, 0.8, 0.6])]  # 0.45, 0.45, 0.55
    d = stats.mean_accuracy_difference(base, other, 120)
    assert d["differences"] == pytest.approx([0.0, 0.2, 0.2])
    # mean 0.133333, s = 0.115470, s / sqrt(3) = 0.066667, t(0.975, 2) = 4.302653: half-width 0.286844
    assert (d["mean"], d["low"], d["high"]) == pytest.approx((0.133333, 0.133333 - 0.286844, 0.133333 + 0.286844), abs=1e-6)
    assert (d["higher"], d["seeds"]) == (2, 3) and d["sign_p"] == pytest.approx(0.5)  # a tie is left out: 2 of 2, p = 2 / 4


def test_report_prints_each_runs_step_costs_beside_the_speedup_table(tmp_path, capsys, monkeypatch):
    grpo_run = fake_run(tmp_path, "grpo", "none", 8, 8, [(0, 0.2), (120, 0.4), (240, 0.6)])
    pods_run = fake_run(tmp_path, "pods", "max_variance", 16, 8, [(0, 0.2), (60, 0.5), (120, 0.65), (240, 0.66)])
    never = fake_run(tmp_path, "rand", "random", 16, 8, [(0, 0.2), (60, 0.3), (120, 0.35), (240, 0.36)])
    (pods_run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "elapsed_s": 30.0 * s, "generation_s": 20.0,
                                                                 "update_s": 10.0}) + "\n" for s in (1, 2, 3, 4)))
    monkeypatch.setenv("HOME", str(tmp_path))  # and "~/" is the home directory, after "=" too (where the shell leaves it)
    home_pods = "~/" + str(pods_run.relative_to(tmp_path))
    assert report.main([str(grpo_run), home_pods, str(never), "--out=~/fig.png"]) == 0
    assert (tmp_path / "fig.png").exists()
    out = capsys.readouterr().out
    assert "pods                              4          20.0      10.0    30.0         30.0      1.00" in out  # its step costs


def test_report_prints_t_intervals_exact_median_intervals_and_never_reached_seeds_as_bounds(tmp_path, capsys):
    runs = []
    for seed, (g, p) in enumerate([(0.5, 0.6), (0.3, 0.5), (0.4, 0.4)]):  # PODS minus GRPO at 1 min: +0.1, +0.2, 0.0
        runs.append(fake_run(tmp_path, f"grpo-s{seed}", "none", 8, 8, [(0, 0.1), (60, g), (120, g + 0.1)], seed=seed))
        runs.append(fake_run(tmp_path, f"pods-s{seed}", "max_variance", 8, 4, [(0, 0.1), (60, p), (120, p + 0.1)], seed=seed))
    assert report.main([*map(str, runs), "--out", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert "paired accuracy difference from GRPO n=8 (same seeds) at each minute, mean [95% t interval over seeds]" in out
    lines = out.splitlines()
    row = lines[lines.index(next(line for line in lines if line.startswith("paired accuracy difference"))) + 2]
    # 1 min: mean 0.1 of +0.1, +0.2, 0.0; s = 0.1, t(0.975, 2) x 0.1 / sqrt(3) = 0.248414; 2 min the same
    assert row.split()[4:] == ["+0.100", "[-0.15,", "+0.35]"] * 2
    assert "  interval above zero at 0 of 2 minutes (none), below zero at 0 (none)" in out.splitlines()
    # mean accuracy over 0-2 min, (area of two trapezoids) / 120 s: GRPO (60 x (0.1 + g) / 2 + 60 x (2g + 0.1) / 2) / 120
    # = 0.425, 0.275, 0.35 (mean 0.35); PODS 0.5, 0.425, 0.35 (mean 0.425); differences 0.075, 0.15, 0.0: mean 0.075,
    # s = 0.075, t(0.975, 2) x 0.075 / sqrt(3) = 0.186310; PODS higher in 2 seeds, one tie: sign test 2 of 2, p = 0.5
    averages = next(line for line in out.splitlines() if line.startswith("PODS") and "of 3" in line)
    assert averages.split()[4:] == ["0.350", "0.425", "+0.075", "[-0.111,", "+0.261]", "2", "of", "3", "0.500"]
    # seed by seed at 0.99 x GRPO's peak (0.5): GRPO seed 1 never reaches 0.495 within its 2 min, PODS does at 1 min
    assert "  seeds at 0.99 x peak: 0: 1.00x  1: > 2.00x  2: 1.00x" in out.splitlines()
    # three seeds: no ranks reach 95%, [min, max] covers 1 - 2 / 8 = 75%; seed 1's ratio has no upper end
    assert "1.00x [1.00, open] 75.0%" in out


def test_report_names_each_seeds_precision_when_seeds_differ_in_it(tmp_path, capsys):
    """A series of seeds trained and evaluated in float32 (a CPU without bfloat16 arithmetic) compares with the
    bfloat16 seeds, pair by pair, and the table names each seed's precision (eval.py's --plot refuses a seed
    split between two: test_eval.py)."""
    runs = []
    for seed, precision in enumerate(["bfloat16", "bfloat16", "float32"]):
        runs.append(fake_run(tmp_path, f"grpo-s{seed}", "none", 8, 8, [(0, 0.1), (60, 0.4), (120, 0.5)], seed=seed, precision=precision))
        runs.append(fake_run(tmp_path, f"pods-s{seed}", "max_variance", 8, 4, [(0, 0.1), (60, 0.5), (120, 0.6)], seed=seed, precision=precision))
    assert report.main([*map(str, runs), "--out", str(tmp_path / "f.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "seeds 0, 1: trained in bfloat16 autocast, evaluated in bfloat16" in lines
    assert "seeds 2: trained in float32, evaluated in float32" in lines
    assert "  seeds at 0.99 x peak: 0: 2.00x  1: 2.00x  2: 2.00x" in lines  # every pair read, the float32 one too
    assert report.main([*map(str, runs[:2]), "--out", str(tmp_path / "f.png")]) == 0
    assert not any(line.startswith("seeds 0:") for line in capsys.readouterr().out.splitlines())  # one precision: not named


def test_paired_speedup_reads_each_seed_pair_up_to_its_shorter_run():
    """GRPO's run went on to 2 minutes, PODS's (same seed) stopped at 1: read to 1 minute, GRPO's peak is
    0.5 (target 0.495), which both reach at 1 minute: 1x, not PODS "never" reaching 0.99 x 0.9."""
    base, other = ([0, 60, 120], [0.1, 0.5, 0.9]), ([0, 60], [0.1, 0.95])
    assert stats.paired_speedup([base], [other])["seeds"] == [(1.0, 1.0)]


def test_a_learning_onset_needs_a_whole_window_of_steps(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "elapsed_s": 60.0 * (i + 1), "accuracy": a, "truncated_frac": 0.0}) + "\n"
                                               for i, a in enumerate([0.9, 0.0, 0.0, 0.6, 0.6, 0.6])))
    # one lucky first step is not an onset: the mean over 3 steps first reaches 0.5 at step 6
    assert report.learning_onsets([run])[1].split()[:2] == ["run", "6.0"]


def test_a_seed_that_never_reaches_the_target_is_a_bound_on_its_ratio_not_a_number():
    base = [([0, 60, 120], [0.1, 0.5, 1.0])] * 4
    other = [([0, 60, 120], [0.1, 1.0, 1.0]), ([0, 60, 120], [0.1, 0.2, 0.3]), ([0, 60], [1.0, 1.0]),
             ([0, 60, 120], [0.1, 0.5, 1.0])]
    # seed 1's PODS never reaches 0.99 by its end (120 s), so its time is past 120 s: the ratio is below 120 / 120
    assert stats.seed_speedups(base, other, 0.99) == [(2.0, 2.0), (0.0, 1.0), (math.inf, math.inf), (1.0, 1.0)]
    never = [([0, 60, 120], [0.1, 0.2, 0.3])]
    # GRPO never within its 120 s, PODS at 60 s: above 120 / 60
    assert stats.seed_speedups(never, [([0, 60], [0.1, 1.0])], 0.99) == [(2.0, math.inf)]
    assert stats.seed_speedups(never, never, 0.99) == [(0.0, math.inf)]  # neither: nothing known
    assert [report.ratio_text(*b) for b in [(2.0, 2.0), (0.0, 1.0), (2.0, math.inf), (0.0, math.inf)]] == [
        "2.00x", "< 1.00x", "> 2.00x", "neither reached"]


def test_the_median_of_censored_seeds_is_bounded_by_the_order_statistics_of_their_bounds():
    """Six seeds, two of which never reached: one PODS run (ratio < 0.5) and one GRPO run (ratio > 3).
    Sorted lows 0, 1, 1.2, 1.4, 1.6, 3; sorted highs 0.5, 1, 1.2, 1.4, 1.6, inf: the median, the mean of
    the 3rd and 4th values, is 1.3 whatever the censored ratios are, and the [min, max] interval's ends
    are left open (0 and inf) by the seeds that never reached, not set to a number."""
    bounds = [(1.0, 1.0), (1.2, 1.2), (1.4, 1.4), (1.6, 1.6), (0.0, 0.5), (3.0, math.inf)]
    m = stats.median_interval(bounds)
    assert (m["median_low"], m["median_high"], m["low"], m["high"]) == pytest.approx((1.3, 1.3, 0.0, math.inf))
    assert report.interval_text(m["low"], m["high"]) == "[open, open]"
    # three censored above: the 4th smallest true value is unknown above 1.6, so is the median's upper end
    m = stats.median_interval([(1.0, 1.0), (1.2, 1.2), (1.6, 1.6), (2.0, math.inf), (2.5, math.inf), (3.0, math.inf)])
    assert (m["median_low"], m["median_high"]) == pytest.approx((1.8, math.inf)) and m["low"] == 1.0
    assert report.ratio_text(m["median_low"], m["median_high"]) == "> 1.80x"


def test_paired_speedup_is_unmoved_by_a_seed_run_on_a_slower_machine():
    # seed 1's runs ran twice as slowly: every time doubled, every accuracy the same
    def runs(k):
        times = [0, 60 * k, 120 * k, 180 * k] + ([360] if k == 1 else [])
        return ((times, [0.1, 0.5, 0.9, 1.0, 1.0][:len(times)]), (times, [0.1, 0.9, 1.0, 1.0, 1.0][:len(times)]))
    (base0, other0), (base1, other1) = runs(1), runs(2)
    # target 0.8: GRPO at 120 s, PODS at 60 s in seed 0; 240 s and 120 s in seed 1: 2x in both
    paired = stats.paired_speedup([base0, base1], [other0, other1], frac=0.8)
    assert (paired["median_low"], paired["median_high"], paired["low"], paired["high"]) == pytest.approx((2.0, 2.0, 2.0, 2.0))
    assert paired["seeds"] == [(2.0, 2.0), (2.0, 2.0)]
    # the seed-mean curves mix the fast and the slow seed: GRPO's mean reaches 0.8 at 180 s, PODS's at 120 s
    assert stats.speedup_of_means([base0, base1], [other0, other1], frac=0.8) == pytest.approx(1.5)


def test_paired_speedup_is_the_median_of_seed_ratios_with_its_exact_interval_and_the_sign_test():
    times = [0, 60, 120, 180]
    base = [(times, [0.1, 0.5, 0.5, 1.0])] * 6  # peak 1.0: target 0.99 at 180 s in every seed
    # PODS first at 0.99 at 60, 60, 90 (interpolated checkpoints below), 120, 180 and never: 3x, 3x, 2x, 1.5x, 1x, < 1x
    curves = [[0.1, 1.0, 1.0, 1.0], [0.1, 1.0, 1.0, 1.0], [0.1, 0.5, 1.0, 1.0], [0.1, 0.5, 1.0, 1.0],
              [0.1, 0.5, 0.5, 1.0], [0.1, 0.5, 0.5, 0.5]]
    other = [(times, c) for c in curves[:2]] + [([0, 60, 90, 180], curves[2])] + [(times, c) for c in curves[3:]]
    paired = stats.paired_speedup(base, other)
    assert paired["seeds"] == [(3.0, 3.0), (3.0, 3.0), (2.0, 2.0), (1.5, 1.5), (1.0, 1.0), (0.0, 1.0)]
    # sorted lows 0, 1, 1.5, 2, 3, 3 and highs 1, 1, 1.5, 2, 3, 3: median (1.5 + 2) / 2; [min, max] with the 0 open
    assert (paired["median_low"], paired["median_high"], paired["low"], paired["high"]) == pytest.approx((1.75, 1.75, 0.0, 3.0))
    assert paired["coverage"] == pytest.approx(1 - 2 / 64)
    # 4 seeds surely faster, 1 surely slower, 1 tied: sign test 4 of 5, p = 2 x (5 + 1) / 32
    assert (paired["favour"], paired["against"], paired["sign_p"]) == (4, 1, pytest.approx(0.375))
    with pytest.raises(plot.PlotError, match="same seeds"):
        stats.paired_speedup(base, other[:1])


def test_accuracy_by_minute_is_the_mean_and_standard_error_over_seeds_at_whole_minutes():
    groups = {"GRPO n=8": [([0, 60, 120], [0.2, 0.4, 0.6]), ([0, 60, 120], [0.2, 0.6, 0.8])],
              "PODS max_variance n=8 m=4": [([0, 30, 150], [0.2, 0.5, 0.5])]}
    header, grpo_row, pods_row = report.accuracy_by_minute(groups)
    assert header.split() == ["run", "seeds", "0", "min", "1", "min", "2", "min", "peak"]  # 2 min: the shortest run's end
    assert grpo_row.split()[2:] == ["2", "0.200", "+-", "0.000", "0.500", "+-", "0.100", "0.700", "+-", "0.100", "0.700"]
    assert pods_row.split()[-7:] == ["0.500", "+-", "0.000", "0.500", "+-", "0.000", "0.500"]


def test_speedup_by_target_is_a_point_estimate_with_its_range_leaving_one_seed_out():
    groups = {"GRPO n=8": [([0, 60, 120, 180], [0.1, 0.5, 0.8, 1.0])] * 3,
              "PODS max_variance n=8 m=4": [([0, 60, 120, 180], [0.1, 0.8, 1.0, 1.0])] * 2 + [([0, 60, 120, 180], [0.1, 0.8, 0.8, 1.0])]}
    seeds = {"GRPO n=8": [0, 1, 2], "PODS max_variance n=8 m=4": [0, 1, 2]}
    header, columns, row = report.speedup_by_target(groups, seeds, "GRPO n=8", fracs=(0.8, 0.99))
    assert "a point estimate, no interval" in header and columns.split()[1:] == ["0.8", "x", "peak", "0.99", "x", "peak"]
    # 0.8: GRPO at 120 s, PODS at 60 s in every seed; 0.99: the PODS mean reaches 0.933 at 120 s and 1.0 at 180 s:
    # 1.00x; leaving seed 2 out it reaches 1.0 at 120 s: 1.50x
    assert row.split()[4:] == ["2.00x", "(2.00-2.00)", "1.00x", "(1.00-1.50)"]


def test_plateau_trend_tells_a_rising_curve_from_noise_around_a_level():
    minutes = [60.0 * k for k in range(11)]
    rising = [(minutes, [0.5 + 0.02 * k for k in range(11)])]  # +0.02 a minute, no noise
    assert stats.plateau_trend(rising) == pytest.approx((5, 10, 0.10, 0.0), abs=1e-9)
    level = [(minutes, [0.9 + (0.03 if k % 2 else -0.03) for k in range(11)])]  # +-0.03 around 0.9
    first, last, trend, spread = stats.plateau_trend(level)
    assert (first, last) == (5, 10) and abs(trend) < 0.03 < spread  # max - min would read 0.06: "moving"
    assert stats.plateau_change(level)[2] == pytest.approx(0.06)
    # the line goes through the seed means: two seeds rising and falling in opposition are level
    opposed = [(minutes, [0.5 + 0.02 * k for k in range(11)]), (minutes, [0.9 - 0.02 * k for k in range(11)])]
    assert stats.plateau_trend(opposed)[2:] == pytest.approx((0.0, 0.0), abs=1e-9)
    assert stats.plateau_trend([([0, 90], [0.1, 0.4])]) == pytest.approx((0, 1, 0.2, 0.0))  # too short for a line


def test_plateau_change_is_the_seed_mean_movement_over_the_last_whole_minutes():
    rising = [([0, 60, 120, 180, 240], [0.1, 0.5, 0.8, 0.9, 0.95])]
    assert stats.plateau_change(rising) == pytest.approx((2, 4, 0.15))  # 0.8 at 2 min, 0.95 at 4 min
    # two seeds that cross: each moves 0.2, their mean stays at 0.8 (interpolated at whole minutes)
    crossing = [([0, 60, 120, 180, 250], [0.1, 0.5, 0.7, 0.8, 0.9]), ([0, 60, 120, 180, 250], [0.1, 0.6, 0.9, 0.8, 0.7])]
    assert stats.plateau_change(crossing) == pytest.approx((2, 4, 0.0), abs=1e-9)
    assert stats.plateau_change([([0, 90], [0.1, 0.4])]) == pytest.approx((0, 1, 0.2))  # 0.1 -> 0.3 at 1 min


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
    header, late_row, never_row = report.learning_onsets([late, never, tmp_path / "no-metrics"])
    # trailing means over 3 steps: 0.27 at step 7, 0.53 at step 8 (4.0 min); truncated over the first 3 steps
    # (0.7 + 1 + 1) / 3, then (1 + 0.5 + 0) / 3, and 0 over the last step (10% of 10)
    assert late_row.split() == ["late", "4.0", "0.90", "->", "0.50", "->", "0.00", "1.00"]
    assert never_row.split() == ["never", "never", "0.90", "->", "-", "->", "0.90", "0.20"]
    assert "onset min" in header


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
    clock = ReferenceClock(reference)
    assert clock.line["GRPO n=8"] == pytest.approx([1.0, 0.1, 2.0])
    assert clock.first["GRPO n=8"] == pytest.approx(10.0)
    expected = np.cumsum([10.0] + [1 + 0.1 * r["completion_len"] + 2 * r["truncated_frac"] for r in slow_rows[1:]])
    assert clock.at_steps(tmp_path / "slow", "GRPO n=8", [0, 1, 20]) == pytest.approx([0.0, 10.0, expected[-1]])
    assert plot.read_metrics(tmp_path / "slow")[-1]["elapsed_s"] == pytest.approx(2 * expected[-1])
    assert "2 runs, step-time R^2 1.00; each run's whole time on the clock over its own: 1.000-1.000" in clock.describe()[1]
    # how far to train a run to a time on the clock (CLOCK=reference): whole steps at its last 10 steps' cost, at least 1
    rows, mean = plot.read_metrics(tmp_path / "slow"), clock.mean_step["GRPO n=8"]
    recent = np.mean([1 + 0.1 * r["completion_len"] + 2 * r["truncated_frac"] for r in slow_rows[-10:]])
    assert [clock.steps_left("GRPO n=8", rows, expected[-1] + k * recent) for k in (0, 0.5, 4.5)] == [0, 1, 4]
    # not started: a first step, then the reference runs' costliest step (a run that learns late has costly steps)
    costliest = max(1 + 0.1 * r["completion_len"] + 2 * r["truncated_frac"] for rows_ in reference_rows for r in rows_[1:])
    assert clock.max_step["GRPO n=8"] == pytest.approx(costliest) and costliest > 1.2 * mean
    assert clock.steps_left("GRPO n=8", [], 10.0 + 5.5 * costliest) == 6
    first = clock.costs("GRPO n=8", rows[:1])[0]  # stopped after its first step: no later step of its own to go by yet
    assert clock.steps_left("GRPO n=8", rows[:1], first + 5.5 * costliest) == 5
    with pytest.raises(plot.PlotError, match="do not hold every step from 1 on"):
        clock.steps_left("GRPO n=8", rows[:3] + rows[4:], 1000.0)
    pods = tmp_path / "pods"
    write_constructed_run(pods, {"rule": "max_variance", "n": 8, "m": 4, "seed": 0}, steps(5))
    with pytest.raises(plot.PlotError, match="no reference runs of PODS max_variance n=8 m=4"):
        clock.at_steps(pods, "PODS max_variance n=8 m=4", [5])
    with pytest.raises(plot.PlotError, match="no reference runs of PODS random n=8 m=4"):
        clock.at_steps(pods, "PODS random n=8 m=4", [5])
    with pytest.raises(plot.PlotError, match="past its metrics.jsonl's last"):
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
    clock = ReferenceClock([tmp_path / "mv", tmp_path / "grpo"])
    ablation_rows = steps(12)
    write_constructed_run(tmp_path / "mr", {"rule": "max_reward", "n": 8, "m": 4, "seed": 9}, ablation_rows, speed=2.0)
    expected = np.cumsum([10.0] + [1 + 0.1 * r["completion_len"] + 2 * r["truncated_frac"] for r in ablation_rows[1:]])
    for rule in ("max_reward", "random", "max_variance"):
        assert clock.setting(f"PODS {rule} n=8 m=4") == "PODS max_variance n=8 m=4"
        assert clock.at_steps(tmp_path / "mr", f"PODS {rule} n=8 m=4", [0, 12]) == pytest.approx([0.0, expected[-1]])
    assert clock.setting("GRPO n=8") == "GRPO n=8"
    assert clock.steps_left("PODS random n=8 m=4", [], 10.0 + 2.5 * clock.max_step["PODS max_variance n=8 m=4"]) == 3
    for label in ("PODS max_reward n=8 m=2", "PODS random n=16 m=4", "GRPO n=4"):
        with pytest.raises(plot.PlotError, match=f"no reference runs of {label} "):
            clock.setting(label)


def test_report_on_the_reference_clock_gives_a_slow_machines_seed_the_speed_up_of_the_idle_ones(tmp_path, capsys):
    """report.py --reference-runs, as the reproduction calls it: seed 2 ran on a machine twice as
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
    assert report.main([*runs, "--dataset", "arith:2", "--out", str(tmp_path / "own.png")]) == 0
    own = capsys.readouterr().out
    assert "seeds at 0.99 x peak: 0: 2.62x  1: 2.62x  2: 2.62x" in own
    assert "baseline GRPO n=8: peak 0.826" in own and "PODS max_variance n=8 m=4                            1.1 min     1.45x" in own
    assert report.main([*runs, "--dataset", "arith:2", "--reference-runs", *reference,
                            "--out", str(tmp_path / "clock.png")]) == 0
    clock = capsys.readouterr().out
    assert "seeds at 0.99 x peak: 0: 2.62x  1: 2.62x  2: 2.62x" in clock
    assert "baseline GRPO n=8: peak 0.950" in clock and "PODS max_variance n=8 m=4                            0.6 min     2.62x" in clock
    assert "every time below is on the reference clock" in clock and "R^2 1.00" in clock
    assert report.main([*runs, "--dataset", "arith:2", "--reference-runs", *runs[:1],
                            "--out", str(tmp_path / "x.png")]) == 2
    assert "no reference runs of PODS max_variance n=8 m=4" in capsys.readouterr().err



def test_reference_clock_prices_a_step_at_its_settings_mean_or_counts_plain_steps(tmp_path):
    """The pricings a comparison is read again on (reference_clock.PRICINGS): "constant" gives every step after
    the first its setting's mean reference step, whatever its completions; "steps" gives every step of every
    setting 1 s, so times are step counts."""
    write_constructed_run(tmp_path / "ref", {"rule": "none", "n": 8, "m": 8, "seed": 0},
                          [{"completion_len": length, "truncated_frac": 0.0} for length in [20.0, 10.0, 30.0] * 5])
    rows = plot.read_metrics(tmp_path / "ref")
    line, constant, steps = (ReferenceClock([tmp_path / "ref"], pricing) for pricing in ("line", "constant", "steps"))
    assert line.costs("GRPO n=8", rows[:4]) == pytest.approx([10.0, 2.0, 4.0, 3.0])  # 1 + 0.1 x length
    assert constant.costs("GRPO n=8", rows[:4]) == pytest.approx([10.0, 3.0, 3.0, 3.0])  # the mean of steps 2-15
    assert steps.elapsed("GRPO n=8", rows[:4]) == [1.0, 2.0, 3.0, 4.0]
    assert "here priced otherwise: every step of every setting at 1 s" in steps.describe()[0]
    with pytest.raises(plot.PlotError, match="pricing 'seconds' is not one of line, constant, steps"):
        ReferenceClock([tmp_path / "ref"], "seconds")


@pytest.mark.pure
def test_the_committed_primary_reading_is_what_headline_py_reads_in_the_kept_runs_now(tmp_path, capsys):
    """cpu_primary.txt, whose numbers the README's headline table gives, printed again from reproduce/cpu-plateau/ by
    the current code: the runs cpu_reproduction.sh's report stage names (reference clock: seeds 0-3 of the four
    settings; each comparison: its seeds that trained the whole budget on the clock, evaluated, both runs kept)."""
    kept = Path(headline.__file__).parent / "cpu-plateau"
    settings = ("grpo-n8", "pods-n8-m4", "grpo-n4", "pods-n16-m4")
    runs = lambda names, seeds: [str(kept / f"{name}-s{seed}") for seed in seeds for name in names]
    assert headline.main(["--dataset", "arith:2", "--out", str(tmp_path / "paired.png"), "--reference-runs", *runs(settings, range(4)),
                          "--comparison", "equal rollouts generated", *runs(settings[:2], (0, 1, 2, 3, 9, 10)),
                          "--comparison", "equal rollouts updated", *runs(settings[2:], (0, 1, 2, 3, 9, 10, 11, 12, 13, 15))]) == 0
    committed = (kept.parent / "cpu_primary.txt").read_text().replace("reproduce/cpu_paired_differences.png", str(tmp_path / "paired.png"))
    assert capsys.readouterr().out == committed


def test_headline_reads_each_comparison_with_t_and_exact_intervals_and_draws_one_panel_each(tmp_path, capsys, monkeypatch):
    """reproduce/headline.py on three constructed seeds (each step 3 s on the clock, the first 10 s): PODS is
    ahead by 0.4, 0.2 and 0.0 at step 10 (37 s) and level from step 20; a comparison with no runs yet waits."""
    rows = [{"completion_len": 20.0, "truncated_frac": 0.0}] * 40
    runs = []
    for seed, ahead in enumerate((0.4, 0.2, 0.0)):
        for name, config, curve in (("grpo", {"rule": "none", "n": 8, "m": 8}, [0.1, 0.5, 0.9, 0.9]),
                                    ("pods", {"rule": "max_variance", "n": 8, "m": 4}, [0.1, 0.5 + ahead, 0.9, 0.9])):
            write_constructed_run(tmp_path / f"{name}-s{seed}", {**config, "seed": seed}, rows, list(zip((0, 10, 20, 30), curve)))
            runs.append(str(tmp_path / f"{name}-s{seed}"))
    figure = tmp_path / "paired.png"
    monkeypatch.setenv("HOME", str(tmp_path))  # "~/" is the home directory, after "=" too
    runs[0] = "~/" + str(Path(runs[0]).relative_to(tmp_path))
    assert headline.main(["--dataset", "arith:2", "--out=~/paired.png", "--reference-runs", *runs,
                          "--comparison", "equal rollouts generated", *runs, "--comparison", "equal rollouts updated"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "equal rollouts updated: no evaluated runs yet" and figure.exists()
    assert out[1].startswith("equal rollouts generated: PODS max_variance n=8 m=4 against GRPO n=8, seeds 0, 1, 2 (3)")
    # mean accuracy to the last evaluation, step 30 at 97 s (10 + 29 x 3): PODS's extra area is a triangle from 0 s
    # through step 10 (37 s) to step 20 (67 s), 0.5 x 67 x ahead, over 97 s: 0.1381, 0.0691, 0; mean 0.0691, s 0.0691,
    # t(0.975, 2) x s / sqrt(3) = 4.302653 x 0.0399 = 0.1716
    assert "+0.069 [-0.103, +0.241] (95% t interval), higher in 2 of 3 seeds" in out[2]
    # target 0.891: GRPO at step 20 (67 s) in every seed; seed 0's PODS at step 10 (0.9, 37 s): 1.81x, the others 1x
    assert ("to 0.99 x GRPO n=8's peak, seed by seed: median 1.00x [1.00, 1.81] (order statistics 1 and 3, coverage 75.0%), "
            "1 of 3 seeds faster (sign test p = 1.000); seeds: 1.81x, 1.00x, 1.00x") == out[4].strip()
    priced = out[out.index("equal rollouts generated, each step priced otherwise (reference_clock.PRICINGS):") + 1:][:3]
    assert [line.split()[:4] for line in priced] == [["line", "to", "1.6", "min:"], ["constant", "to", "1.6", "min:"],
                                                     ["steps", "to", "30", "steps:"]]


def test_seen_test_questions_counts_what_the_kept_runs_drew_as_reproduce_readme_says(capsys):
    """The counts behind reproduce/README.md's "Test questions seen in training", from the kept records."""
    seen_test_questions.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "254 distinct of the first 256 test questions; 208 of them in seed 0's training pool of 9389 distinct"
    assert lines[-4].endswith("mean +7.2 questions = +0.028 of the accuracy at most")
    assert lines[-3].endswith("mean -5.7 questions = -0.022 of the accuracy at most")
    assert lines[-2].endswith("13.9 min: drawn share +0.011 (mean over the horizon); mean accuracy +0.046 [+0.008, +0.083], "
                              "less it seed by seed +0.035 [-0.002, +0.072] (95% t interval)")  # the headline's first row, cpu_primary.txt
    assert lines[-1].endswith("14.3 min: drawn share -0.007 (mean over the horizon); mean accuracy +0.076 [+0.012, +0.141], "
                              "less it seed by seed +0.083 [+0.024, +0.143] (95% t interval)")
