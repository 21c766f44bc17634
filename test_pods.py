"""The paper's pieces: the down-sampling rules (pods.py: Definition 3.1, Lemma 3.1), the reward
(rewards.py) and GRPO's advantages and loss (grpo.py). Run this file first: `pytest -q test_pods.py`.

The other test files are named after what they test (test_train.py, test_update.py, test_sampling.py, ...);
`pytest -q` runs them all.
"""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grpo
import pods
import rewards

GSM8K_DIR = Path(__file__).resolve().parent.parent / "shared" / "data" / "gsm8k"


def reward_families(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "real": rng.normal(size=n),
        "integer": rng.integers(-3, 4, size=n).astype(float),
        "binary": rng.integers(0, 2, size=n).astype(float),
        "tied": rng.choice([0.0, 0.2, 1.0, 1.2], size=n, p=[0.55, 0.05, 0.35, 0.05]),
        "all_equal": np.full(n, 0.7),
    }


def is_top_bottom_shape(r: np.ndarray, kept: list[int]) -> bool:
    """Lemma 3.1's shape: the kept rewards are, as a multiset, the m-k lowest plus the k highest."""
    m, s = len(kept), np.sort(r)
    kept_sorted = np.sort(r[kept])
    return any(np.array_equal(kept_sorted, np.sort(np.concatenate((s[: m - k], s[len(r) - k :])))) for k in range(m + 1))


def test_max_variance_equals_brute_force_for_every_n_up_to_10_and_every_m():
    rng = np.random.default_rng(0)
    for n in range(1, 11):
        for trial in range(3):
            for family, r in reward_families(n, rng).items():
                for m in range(1, n + 1):
                    kept = pods.max_variance_downsample(r, m)
                    best = pods.brute_force_max_variance(r, m)
                    assert np.isclose(r[kept].var(), best, rtol=1e-9, atol=1e-12), (family, n, m, r)
                    assert is_top_bottom_shape(r, kept), (family, n, m, r, kept)


def test_brute_force_reference_enumerates_every_subset():
    r = [0.0, 1.0, 5.0, 2.0]
    assert pods.brute_force_max_variance(r, 2) == pytest.approx(6.25)  # {0, 5}
    assert pods.brute_force_max_variance(r, 3) == pytest.approx(np.var([0.0, 1.0, 5.0]))


def test_max_variance_takes_extremes_of_binary_rewards_in_equal_halves():
    r = [1, 1, 1, 1, 1, 0, 1, 0]
    kept = pods.max_variance_downsample(r, 4)
    assert sorted(np.asarray(r)[kept]) == [0, 0, 1, 1]
    # k = 0, 1, 2 all give {0, 0, 1, 1}; the smallest k wins: the four lowest, 5, 7, 0, 1
    assert kept == [0, 1, 5, 7]


def test_max_variance_is_stable_under_large_offsets():
    r = np.array([0.0, 1.0, 0.0, 1.0, 0.5, 0.5]) + 1e9
    kept = pods.max_variance_downsample(r, 4)
    assert sorted((r[kept] - 1e9).tolist()) == [0.0, 0.0, 1.0, 1.0]


def test_max_variance_picks_the_same_subset_at_any_reward_scale():
    """A user's reward of 1e200 overflowed r^2 and one of 1e-200 underflowed it: both kept [0, 3], not [0, 2]."""
    r = np.array([0.0, 1.0, 2.0, 0.5, 1.5, 0.25])
    for m in range(1, 7):
        expected = pods.max_variance_downsample(r, m)
        assert all(pods.max_variance_downsample(r * scale, m) == expected for scale in (1e200, 1e-200, 1e-310, 1e300))
    assert pods.max_variance_downsample([1e308, -1e308, 0.0, 5.0], 2) == [0, 1]
    assert pods.max_variance_downsample([1e308, 1e308, 0.0, 0.0], 2) == [1, 2]  # their mean overflowed: it kept [2, 3]


def test_ties_are_broken_by_index_and_smallest_k():
    assert pods.max_variance_downsample([0.5, 0.5, 0.5, 0.5], 2) == [0, 1]
    assert pods.max_reward_downsample([1, 0, 1, 1], 2) == [0, 2]
    assert pods.max_variance_downsample([0, 1, 0, 1, 0, 1], 2) == [0, 5]
    # k=1 keeps [0, .025, 1.025], k=2 [0, 1, 1.025]: mirror images, one variance in reals; floats differ
    assert np.var([0, 0.025, 1.025]) != np.var([0, 1, 1.025])
    assert pods.max_variance_downsample([0.0, 0.025, 1.0, 1.025], 3) == [0, 1, 3]


def test_ties_are_broken_by_index_in_a_group_of_64():
    """numpy's default sort is unstable past 16 elements: at the paper's n = 64 ties must still go as documented
    (max_variance: the lowest indices among equal low rewards, the highest among equal high ones; max_reward: lowest)."""
    r = [0.0, 1.0] * 32
    for m in range(1, 33):
        low, high = m - m // 2, m // 2  # binary rewards: half and half, the smallest k on a tie
        assert pods.max_variance_downsample(r, m) == list(range(0, 2 * low, 2)) + list(range(65 - 2 * high, 64, 2))
        assert pods.max_reward_downsample(r, m) == list(range(1, 2 * m, 2))


def test_a_subset_better_by_a_relative_1e8_is_not_taken_for_a_tie():
    """Only variances within rounding (1e-12) count as tied: 1e-8 apart, the larger wins, whichever k it has."""
    assert pods.max_variance_downsample([0.0, 0.025 + 1e-8, 1.0, 1.025], 3) == [0, 2, 3]  # k = 2 is larger
    assert pods.max_variance_downsample([0.0, 0.025 - 1e-8, 1.0, 1.025], 3) == [0, 1, 3]  # k = 1 is larger


def test_max_reward_keeps_the_highest():
    assert pods.max_reward_downsample([0.1, 0.9, 0.5, 0.7], 2) == [1, 3]


def test_accepts_lists_numpy_and_torch():
    r = [0.0, 1.0, 0.3, 0.9, 0.2, 1.0]
    expected = pods.max_variance_downsample(r, 4)
    assert pods.max_variance_downsample(np.array(r), 4) == expected
    assert pods.max_variance_downsample(torch.tensor(r), 4) == expected
    assert pods.max_variance_downsample(torch.tensor(r, dtype=torch.bfloat16), 4) == expected
    close = [1.0, 1.0 + 1e-9, 0.0]  # float64 rewards are read as float64, as numpy's: they were rounded to float32
    assert pods.max_reward_downsample(torch.tensor(close, dtype=torch.float64), 1) == pods.max_reward_downsample(close, 1) == [1]


@pytest.mark.parametrize("rule", sorted(pods.RULES))
def test_every_rule_returns_m_distinct_sorted_indices(rule):
    rng = np.random.default_rng(1)
    for n in (1, 2, 5, 16):
        for m in range(1, n + 1):
            r = rng.normal(size=n)
            kept = pods.downsample(r, m, rule, rng=rng)
            assert len(kept) == m and len(set(kept)) == m
            assert kept == sorted(kept) and all(0 <= i < n for i in kept)
        assert pods.downsample(rng.normal(size=n), n, rule, rng=rng) == list(range(n))


@pytest.mark.parametrize("rule", sorted(pods.RULES))
def test_downsample_selects_m_per_group_in_a_flat_batch(rule):
    r = np.array([[0, 1, 0, 1], [5, 5, 5, 9], [3, 2, 1, 0]], dtype=float)
    kept = pods.downsample(r.ravel(), 2, rule, group_size=4, rng=np.random.default_rng(0))
    assert len(kept) == 6 and len(set(kept)) == 6
    for g in range(3):
        assert all(4 * g <= i < 4 * g + 4 for i in kept[2 * g : 2 * g + 2])


def test_downsample_groupwise_matches_rule_on_each_group():
    r = np.array([0, 1, 0, 1, 5, 5, 5, 9, 3, 2, 1, 0], dtype=float)
    assert pods.downsample(r, 2, "max_variance", group_size=4) == [0, 3, 4, 7, 8, 11]
    assert pods.downsample(r, 2, "max_reward", group_size=4) == [1, 3, 4, 7, 8, 9]


def test_random_rule_is_reproducible_with_a_seeded_generator():
    r = np.arange(10.0)
    a = pods.downsample(r, 3, "random", rng=np.random.default_rng(7))
    b = pods.downsample(r, 3, "random", rng=np.random.default_rng(7))
    assert a == b


def test_random_rule_takes_a_seed_and_draws_each_group_from_one_stream():
    """An int seed was an AttributeError; and no rng was fresh entropy, which np.random.seed does not reach (said now).
    downsample turns a seed into one stream: a seed per group would keep the same positions in every group."""
    assert pods.random_downsample(np.arange(10.0), 3, rng=7) == pods.random_downsample(np.arange(10.0), 3, rng=np.random.default_rng(7))
    kept = pods.downsample(np.zeros(8 * 20), 4, "random", group_size=8, rng=0)
    assert kept == pods.downsample(np.zeros(8 * 20), 4, "random", group_size=8, rng=0)
    assert len({tuple(k % 8 for k in kept[g * 4 : g * 4 + 4]) for g in range(20)}) > 1


def test_random_rule_draws_every_subset_of_m_equally_whatever_the_rewards():
    """Uniform without replacement: each of the 6 pairs of 4 about 1/6 of the time (a rule that kept the first m,
    or favoured the high reward, would not); 6,000 seeded draws, each count within 5 standard deviations of 1,000."""
    rng = np.random.default_rng(0)
    counts = collections.Counter(tuple(pods.random_downsample([9.0, 0.0, 0.0, 0.0], 2, rng=rng)) for _ in range(6000))
    assert sorted(counts) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert all(abs(c - 1000) < 5 * (6000 * 1 / 6 * 5 / 6) ** 0.5 for c in counts.values()), counts


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: pods.max_variance_downsample([1.0, 2.0], 0), "m=0 must be >= 1"),
        (lambda: pods.max_reward_downsample([1.0, 2.0], 3), "m=3 must be <= n=2"),
        (lambda: pods.downsample([1.0, 2.0, 3.0], 2.0), "m=2.0 must be a whole number"),  # an IndexError; m=True kept 1
        (lambda: pods.downsample([1.0, 2.0, 3.0], True), "m=True must be a whole number"),
        (lambda: pods.max_reward_downsample([1.0, 2.0, 3.0], torch.tensor(True)), "m=tensor(True) must be a whole number"),
        (lambda: pods.max_variance_downsample([1.0, 2.0, 3.0], torch.tensor([2])), "m=tensor([2]) must be a whole number"),
        (lambda: pods.downsample([1.0, 2.0, 3.0], 1, group_size=2), "a batch of 3 rewards is not a whole number of groups of group_size=2"),
        (lambda: pods.downsample([1.0, float("nan")], 1), "rewards must be finite, got [nan]"),
        (lambda: pods.random_downsample([1.0, float("inf")], 1), "rewards must be finite, got [inf]"),
        (lambda: pods.downsample([1.0, 2.0], 1, rule="best"), "unknown rule 'best'; known rules: max_reward, max_variance, random"),
        (lambda: pods.downsample([1.0, 2.0], 3, group_size=2), "m=3 must be <= n=2"),
        (lambda: pods.downsample([], 1), "rewards is empty"),  # said "group_size=0 must be >= 1", unasked
        (lambda: pods.downsample(np.zeros((2, 4)), 2, group_size=4), "one-dimensional (one group, or groups back to back"),
        (lambda: grpo.grpo_loss(torch.zeros(4, 4), torch.zeros(4, 4), torch.zeros(1, 4), torch.ones(4, 4)),
         "advantages must have one entry per completion, shape (4,), got (1, 4)"),  # [groups, m] broadcast over the tokens
        (lambda: grpo.grpo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), beta=0.1),
         "beta=0.1 needs ref_logprobs"),  # the KL term was left out without a word
        # a copier's wrong shapes broadcast into a wrong loss without a word (a [2, 1] mask weighed every token)
        (lambda: grpo.grpo_loss(torch.zeros(2, 5), torch.zeros(2, 5), torch.zeros(2), torch.ones(2, 1)),
         "mask must be shaped like logprobs, (2, 5), got (2, 1)"),
        (lambda: grpo.grpo_loss(torch.zeros(2, 5), torch.zeros(5), torch.zeros(2), torch.ones(2, 5)),
         "old_logprobs must be shaped like logprobs, (2, 5), got (5,)"),
        (lambda: grpo.grpo_loss(torch.zeros(2, 5), torch.zeros(2, 5), torch.zeros(2), torch.ones(2, 5), token_weights=torch.ones(1, 5)),
         "token_weights must be shaped like logprobs, (2, 5), got (1, 5)"),
        (lambda: grpo.grpo_loss(torch.zeros(2, 5), torch.zeros(2, 5), torch.zeros(2), torch.ones(2, 5), ref_logprobs=torch.zeros(2, 4)),
         "ref_logprobs must be shaped like logprobs, (2, 5), got (2, 4)"),
        (lambda: grpo.token_logprobs(torch.zeros(3, 4, 7), torch.zeros(1, 4, dtype=torch.long)),
         "token_ids must be shaped [B, T] = (3, 4) like the logits, got (1, 4)"),
        (lambda: grpo.group_advantages([[1.0, float("nan"), 0.0]]), "rewards must be finite, got [nan]"),  # a NaN loss
        (lambda: grpo.group_advantages(np.array([[1.0, float("inf")]])), "rewards must be finite, got [inf]"),
        (lambda: pods.downsample([1.0, 2.0], 1, group_size=2.0), "group_size=2.0 must be a whole number"),  # range()'s TypeError
        (lambda: pods.downsample([1.0, 2.0], 1, group_size=True), "group_size=True must be a whole number"),
        (lambda: pods.dynamic_sampling([True, False], 2.0), "target=2.0 must be a whole number"),
        (lambda: rewards.correctness_reward("<answer>72</answer>", torch.tensor(72)),
         "answer must be the reference answer, as text or a number; got tensor(72)"),
    ],
)
def test_bad_input_raises_a_value_error_naming_the_values(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value)


@pytest.mark.parametrize("m", [np.int64(2), np.array(2), torch.tensor(2)], ids=["numpy-int", "numpy-0d", "torch-0d"])
def test_m_may_be_any_kind_of_integer(m):
    rewards_ = [0.0, 1.0, 0.0, 1.0, 0.5, 0.2]
    rng = lambda: np.random.default_rng(0)
    assert pods.downsample(rewards_, m) == pods.downsample(rewards_, 2) and pods.max_reward_downsample(rewards_, m) == [1, 3]
    assert pods.random_downsample(rewards_, m, rng()) == pods.random_downsample(rewards_, 2, rng())


FULL = rewards.CORRECT_REWARD + rewards.STRUCTURE_REWARD + 4 * rewards.TAG_REWARD


TAGS_ONLY = rewards.STRUCTURE_REWARD + 4 * rewards.TAG_REWARD


REWARD_TABLE = [
    # (completion, answer, expected reward)
    ("<think>48/2 = 24. 48 + 24 = 72</think>\n<answer>72</answer>", "72", FULL),
    ("<think>\nreasoning\n</think>\n<answer>\n72\n</answer>\n", "72", FULL),
    ("<think>48 + 24</think><answer>$72.00</answer>", "72", FULL),
    ("<think>...</think><answer>1,000</answer>", "1000", FULL),
    ("<think>...</think><answer>$1,000,000</answer>", "1000000", FULL),
    ("<think>...</think><answer>72 clips</answer>", "72", FULL),
    ("<think>...</think><answer>The answer is 72.</answer>", "72", FULL),
    ("<think>...</think><answer>12.50</answer>", "12.5", FULL),
    ("<think>...</think><answer>-3</answer>", "-3", FULL),
    ("<think>...</think><answer>3/4</answer>", "0.75", FULL),
    ("<think>...</think><answer>25%</answer>", "25", FULL),
    ("<think>...</think><answer>18.0</answer>", "18", FULL),
    ("<think>so 5 + 7 = 12</think><answer>12</answer>", "12", FULL),
    ("<think>48/2 = 24</think><answer>24</answer>", "72", TAGS_ONLY),
    ("<think>I am unsure</think><answer>many</answer>", "72", TAGS_ONLY),
    ("<think>...</think><answer></answer>", "72", TAGS_ONLY),
    ("<think>...</think><answer>7</answer><answer>72</answer>", "72", 1.0 + 2 * rewards.TAG_REWARD),
    ("<think>...</think><answer>72</answer><answer>7</answer>", "72", 2 * rewards.TAG_REWARD),
    ("She sold 48 + 24 = 72 clips.", "72", 1.0),
    ("72", "72", 1.0),
    ("The answer is $1,250.", "1250", 1.0),
    ("The answer is 12. Then 5 more.", "12", 0.0),
    ("I cannot solve this.", "72", 0.0),
    ("", "72", 0.0),
    ("<answer>72</answer>", "72", 1.0 + 2 * rewards.TAG_REWARD),
    ("<think>48 + 24 = 72 so the answer is", "72", 1.0 + rewards.TAG_REWARD),
    ("<think>48 + 24 = 7", "72", rewards.TAG_REWARD),
    ("<think>...</think><answer>72", "72", 1.0 + 3 * rewards.TAG_REWARD),
    ("<think>...</think>\nThe answer is 72", "72", 1.0 + 2 * rewards.TAG_REWARD),
    ("Answer: 72 <answer>70</answer>", "72", 2 * rewards.TAG_REWARD),
    ("<think>a</think><answer>72</answer> extra text", "72", 1.0 + 4 * rewards.TAG_REWARD),
    ("<answer>72</answer><think>late</think>", "72", 1.0 + 4 * rewards.TAG_REWARD),
    ("<think><think>x</think><answer>72</answer>", "72", 1.0 + 3 * rewards.TAG_REWARD),
    ("5 - 3 = 2", "2", 1.0),
    ("The temperature is -5 degrees", "-5", 1.0),
    ("<think>...</think><answer>0.5</answer>", "1/2", FULL),
    ("<think>...</think><answer>72</answer>", 72, FULL),  # a number for the answer: an AttributeError,
    ("<think>...</think><answer>0</answer>", 0, FULL),  # and 0 (falsy) scored the format alone
    ("<think>...</think><answer>0.5</answer>", 0.5, FULL),
    ("<think>...</think><answer>0.00001</answer>", 1e-05, FULL),  # str(1e-05) is "1e-05": read as 5
    ("<think>...</think><answer>5</answer>", 1e-05, FULL - rewards.CORRECT_REWARD),
    ("<think>...</think><answer>10000000000000000</answer>", 1e16, FULL),
]


@pytest.mark.parametrize("completion, answer, expected", REWARD_TABLE)
def test_reward_table(completion, answer, expected):
    assert rewards.reward(completion, answer) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("$1,000.00", "1000"), ("12%", "12"), ("12.", "12"), ("12.0", "12"), ("-3.50", "-3.5"),
        ("3/4", "0.75"), ("1/3", "1/3"), ("6/3", "2"), ("4/0", None), ("about 12 apples", "12"),
        ("1,2", "2"), ("none", None), ("", None), (None, None), ("-0", "0"), (".5", "0.5"),
        ("0.125", "0.125"), ("007", "7"), ("1" * 100, None),
        ("2 1/2", "2.5"), ("2\\frac{1}{2}", "2.5"), ("2 7/4", "1.75"), ("\u22125", "-5"), ("\\frac{\u22121}{2}", "-0.5"),
        ("a3 1/2", "0.5"), ("x^2\\frac{1}{4}", "0.25"),  # no mixed number after a letter or an exponent
        ("\\frac{1.5}{2}", "0.75"), ("\\frac{3}{1.5}", "2"), ("3/1.5", "2"), ("X=$60/1.5", "40"), ("4/0.0", None),  # were 2, 1.5, 0.5, 0.5, 0
    ],
)
def test_normalize_number(text, expected):
    assert rewards.normalize_number(text) == expected


@pytest.mark.parametrize("completion, answer, correct", [
    ("<answer>2 1/2</answer>", "2.5", True), ("<answer>2 1/2</answer>", "0.5", False),  # was 0.5: the fraction alone
    ("<answer>-2 1/2</answer>", "-2.5", True), ("<answer>2\\frac{1}{2}</answer>", "0.5", False),
    ("<answer>\u22125</answer>", "-5", True), ("<answer>\u22125</answer>", "5", False),  # was 5: Unicode's minus dropped
    ("<answer>\\frac{1.5}{2}</answer>", "2", False), ("<answer>\\frac{1.5}{2}</answer>", "0.75", True),  # was 2: the denominator
])
def test_a_mixed_number_and_unicode_minus_keep_their_value(completion, answer, correct):
    assert rewards.correctness_reward(completion, answer) == (1.0 if correct else 0.0)


@pytest.mark.parametrize("text, expected", [
    ("\n- 72", "72"), ("- 72", "72"), ("Total:\n  - 72 clips", "72"), ("a\n\t-\t72", "72"), ("\n- -3", "-3"),
    ("-72", "-72"), ("\n-72", "-72"), ("x = -3", "-3"), ("answer: - 3", "-3"), ("The answer is -72", "-72"),
])
def test_a_dash_starting_a_line_is_a_bullet_and_any_other_minus_a_sign(text, expected):
    assert rewards.normalize_number(text) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("<think>...</think><answer>\n- 72\n</answer>", "72", FULL),
    ("The answer:\n- 72 clips", "72", 1.0),
    ("The answer is -72", "-72", 1.0),
    ("The answer is -72", "72", 0.0),
    ("<think>...</think><answer>x = -3</answer>", "-3", FULL),
])
def test_a_markdown_bullet_before_the_answer_is_not_read_as_a_minus_sign(completion, answer, expected):
    assert rewards.reward(completion, answer) == pytest.approx(expected)


@pytest.mark.parametrize("completion, answer, expected", [
    ("<answer>- 3</answer>", "3", 0.0), ("<answer>- 3</answer>", "-3", 1.0),
    ("\\boxed{- 5}", "5", 0.0), ("\\boxed{- 5}", "-5", 1.0),
    ("answer: - 3", "3", 0.0), ("answer: - 3", "-3", 1.0),
    ("<answer>\n- 3\n</answer>", "-3", 1.0),  # the tag's content is -3; the completion's line "- 3" a bullet: 3 counts too
    ("<answer>\n- 3\n</answer>", "3", 1.0),
    ("The answer is 10 - 3", "3", 1.0), ("The answer is 10 - 3", "-3", 0.0), ("The answer is 10 - 3", "7", 0.0),
    ("<answer>(2 + 8) - 3</answer>", "3", 1.0), ("<answer>10 -3</answer>", "-3", 0.0),
])
def test_an_extracted_answer_keeps_its_minus_sign_and_a_subtraction_ends_in_its_last_number(completion, answer, expected):
    """The bullet rule reads a "- " starting a line of the completion, never an answer extracted from it; "10 - 3" is a
    subtraction whose last number is 3, as the authors' grader reads it (its last number, [\\d.,]+, has no sign)."""
    assert rewards.correctness_reward(completion, answer) == expected


def test_normalize_number_reads_list_markers_only_in_a_completions_text():
    assert rewards.normalize_number("- 72") == "72" and rewards.normalize_number("- 72", list_markers=False) == "-72"
    assert rewards.parse_gsm8k_solution("...\n#### - 5") == "-5"  # a reference answer has no bullets either
    assert rewards.correctness_reward("<answer>-5</answer>", "- 5") == 1.0 and rewards.correctness_reward("so 5", "- 5") == 0.0
    assert rewards.normalize_number("\n- 72", list_markers=False) == "-72"
    assert rewards.extract_answer("so \\boxed{- 5}") == "- 5" and rewards.extract_answer("<answer> - 3 </answer>") == "- 3"


@pytest.mark.parametrize("text, expected", [("-$5", "-5"), ("The loss is -$12.", "-12"), ("2 2/2", "1")])
def test_normalize_number_edge_cases(text, expected):
    """A currency sign between the minus and the digits keeps the minus; a mixed number needs a proper fraction
    ("2 2/2" is not two and one, it reads as its last number)."""
    assert rewards.normalize_number(text) == expected


def test_whitespace_around_the_tags_is_still_well_formatted():
    """A completion that begins or ends with a newline still earns the format reward."""
    assert rewards.is_well_formatted("\n<think>a</think>\n<answer>1</answer>\n")


def test_extract_answer_prefers_the_last_answer_tag_then_the_last_number():
    assert rewards.extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert rewards.extract_answer("it is 3, no 4") == "4"
    assert rewards.extract_answer("no numbers") is None
    assert rewards.extract_answer("<answer>many</answer> 5") == "many"


def test_parse_gsm8k_solution():
    assert rewards.parse_gsm8k_solution("3 + 4 = <<3+4=7>>7\n#### 7") == "7"
    assert rewards.parse_gsm8k_solution("...\n#### 1,000") == "1000"
    with pytest.raises(ValueError, match="must end in '#### <number>'"):
        rewards.parse_gsm8k_solution("no marker here")


@pytest.mark.gsm8k_files
@pytest.mark.skipif(not GSM8K_DIR.exists(), reason="GSM8K files not present in ../shared/data/gsm8k")
def test_every_gsm8k_row_parses_to_a_number():
    rows = 0
    for split in ("train", "test"):
        with open(GSM8K_DIR / f"{split}.jsonl") as f:
            for line in f:
                row = json.loads(line)
                answer = rewards.parse_gsm8k_solution(row["answer"])
                assert rewards.normalize_number(answer) == answer
                assert rewards.correctness_reward(f"<answer>{answer}</answer>", answer) == 1.0
                rows += 1
    assert rows == 7473 + 1319


@settings(max_examples=400, deadline=None)
@given(st.text(), st.text())
def test_no_text_makes_the_reward_functions_raise(completion, answer):
    value = rewards.reward(completion, answer)
    assert 0.0 <= value <= FULL
    rewards.extract_answer(completion)
    rewards.normalize_number(completion)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "12", "-", "/", "0", ",", ".", "$", " ", "x"]), max_size=30))
def test_no_tag_soup_makes_the_reward_functions_raise(parts):
    text = "".join(parts)
    assert 0.0 <= rewards.reward(text, "12") <= FULL
    tagged = rewards._ANSWER.findall(text)  # the answer tag read is the plain search's last (extract_answer stops the
    if tagged:  # search at the last closing tag: unclosed ones after it cost time quadratic in their number)
        assert rewards.extract_answer(text) == tagged[-1].strip()


def test_group_advantages_hand_computed():
    adv = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]), eps=0.0)
    s = np.std([1, 0, 0, 1], ddof=1)  # 0.57735
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / s)
    assert torch.equal(grpo.group_advantages(torch.tensor([[2.0, 2.0, 2.0]])), torch.zeros(1, 3))


def test_group_advantages_of_float64_or_bfloat16_rewards_are_computed_in_float32():
    """As informative_groups compares: rewards equal in float32 are uniform (advantages exactly 0) whatever their dtype."""
    r64 = torch.tensor([[1.2, 1.2 + 1e-9, 1.2, 1.2], [0.0, 1.0, 0.2, 1.0]], dtype=torch.float64)
    adv = grpo.group_advantages(r64)
    assert adv.dtype == torch.float32 and torch.equal(adv, grpo.group_advantages(r64.float()))
    assert adv[0].eq(0).all() and pods.informative_groups(r64).tolist() == [False, True]
    bf16 = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.2]], dtype=torch.bfloat16)
    assert torch.equal(grpo.group_advantages(bf16), grpo.group_advantages(bf16.float()))


def test_group_advantages_rejects_groups_of_one():
    with pytest.raises(ValueError, match="m >= 2"):
        grpo.group_advantages(torch.tensor([[1.0], [0.0]]))


@pytest.mark.parametrize("reward, m", [(1.2, 16), (1.05, 8), (0.2, 32)])
def test_group_advantages_are_exactly_zero_for_a_group_of_equal_float32_rewards(reward, m):
    # float32's mean and std round: the formula gave 1.19e-3 to each rollout of [1.2] * 16
    assert torch.equal(grpo.group_advantages(torch.tensor([[reward] * m])), torch.zeros(1, m))


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 64), st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_any_group_of_equal_float32_rewards_gets_advantages_exactly_zero(m, reward):
    assert torch.equal(grpo.group_advantages(torch.full((1, m), reward)), torch.zeros(1, m))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(-10, 10, width=32), min_size=2, max_size=64).filter(lambda r: len(set(r)) > 1))
def test_group_advantages_of_a_mixed_group_are_the_formula(values):
    r = torch.tensor([values])
    expected = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)
    assert torch.equal(grpo.group_advantages(r), expected)


def test_a_group_one_float32_step_from_uniform_is_normalized_not_zeroed():
    r = torch.tensor([[1.2, 1.2, 1.2, 1.2], [1.2, 1.2, 1.2, 1.2]])
    r[1, 3] = torch.nextafter(r[1, 3], torch.tensor(2.0))  # one ulp above 1.2
    adv = grpo.group_advantages(r, eps=0.0)
    assert torch.equal(adv[0], torch.zeros(4))  # 0, not 0 / 0
    formula = (r - r.mean(dim=1, keepdim=True)) / r.std(dim=1, keepdim=True)
    assert torch.equal(adv[1], formula[1]) and adv[1].ne(0).any()  # as before, however float32 rounds it


def test_informative_groups_are_those_whose_kept_rewards_are_not_all_equal():
    kept = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.2, 1.2], [2.0, 2.0 + 1e-12], [2.0, 2.0 + 1e-6]]
    assert pods.informative_groups(kept).tolist() == [False, True, False, False, False, True]  # 1e-12 vanishes in float32
    assert pods.informative_groups(torch.tensor([[0.2, 0.2, 0.2], [0.2, 0.2, 1.0]])).tolist() == [False, True]
    assert pods.informative_groups(np.zeros((0, 4))).tolist() == []
    with pytest.raises(ValueError, match=r"shaped \[groups, m\], got shape \(4,\)"):
        pods.informative_groups([1.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="must be finite"):
        pods.informative_groups([[1.0, float("nan")]])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.2, 1.0, 1.2, 1.2 + 1e-9]), min_size=4, max_size=4), min_size=1, max_size=6))
def test_informative_groups_agree_with_group_advantages_exactly(kept):
    """A group is uniform exactly where grpo.group_advantages gives it advantages all 0 (float32, as train.py's rewards)."""
    rewards = torch.tensor(kept)
    assert pods.informative_groups(rewards).tolist() == grpo.group_advantages(rewards).ne(0).any(dim=1).tolist()


def test_dynamic_sampling_takes_the_first_informative_groups_in_the_order_drawn():
    """DAPO's dynamic sampling over rounds: round 1 has one informative group of 3, round 2 three; the step's 3 are the
    first three in order, the fourth is dropped; with too few it takes what there is; target 0 takes none."""
    informative = [False, True, False, True, True, True]
    assert pods.dynamic_sampling(informative, 3) == [1, 3, 4]
    assert pods.dynamic_sampling(informative[:3], 3) == [1]
    assert pods.dynamic_sampling(np.array(informative), 0) == [] and pods.dynamic_sampling([], 2) == []
    with pytest.raises(ValueError, match="target=-1 must be >= 0"):
        pods.dynamic_sampling(informative, -1)
    assert pods.dynamic_sampling(torch.tensor(informative), 3) == [1, 3, 4]  # (a GPU's tensor, which np.asarray refuses, is
    # moved to the CPU first as in _rewards_array: untested here, without a GPU)


def test_group_advantages_take_lists_and_numpy_arrays():
    expected = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert torch.equal(grpo.group_advantages([[1.0, 0.0, 0.0, 1.0]]), expected)
    assert torch.equal(grpo.group_advantages(np.array([[1.0, 0.0, 0.0, 1.0]])), expected) and expected.dtype == torch.float32


def test_token_logprobs_matches_log_softmax():
    logits = torch.randn(3, 5, 11)
    ids = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(grpo.token_logprobs(logits, ids), expected, atol=1e-6)


def test_token_logprobs_of_bfloat16_logits_are_computed_in_float32():
    """A logsumexp over a vocabulary in bfloat16 was off by up to ~0.05; now only the logits' own rounding remains."""
    logits = (4 * torch.randn(2, 3, 1000, generator=torch.Generator().manual_seed(0))).bfloat16()
    ids = torch.randint(0, 1000, (2, 3), generator=torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    got = grpo.token_logprobs(logits, ids)
    assert got.dtype == torch.float32 and torch.allclose(got, expected, atol=1e-5)


def test_grpo_loss_hand_computed():
    logprobs = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    old = torch.tensor([[-1.0, -1.0 - np.log(2.0)], [-2.0, -2.0]])  # token (0,1): ratio 2
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, stats = grpo.grpo_loss(logprobs, old, adv, mask, clip_eps=0.2)
    # completion 0: tokens give min(1*1, 1*1)=1 and min(2*1, 1.2*1)=1.2 -> mean 1.1
    # completion 1: one token, ratio 1, A=-1 -> -1
    assert loss.item() == pytest.approx(-(1.1 + -1.0) / 2)
    # statistics averaged as the loss is: over each completion's tokens, then over completions
    assert stats["clip_frac"] == pytest.approx((1 / 2 + 0) / 2)
    assert stats["ratio_mean"] == pytest.approx(((1 + 2) / 2 + 1) / 2)
    assert stats["kl"] == 0.0


def test_grpo_loss_treats_old_and_reference_logprobs_as_constants():
    """grpo_loss(logprobs, logprobs, ...), the docstring's one-update case without .detach(), had gradient exactly 0:
    rho = exp(logp - logp) cancelled it. Now REINFORCE's, -A_i / (B |o_i|), as with the detached copy."""
    mask, adv = torch.tensor([[1, 1], [1, 0]]), torch.tensor([1.0, -1.0])
    grads = []
    for detached in (False, True):
        logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
        old = logprobs.detach() if detached else logprobs
        loss, _ = grpo.grpo_loss(logprobs, old, adv, mask, ref_logprobs=old, beta=0.1)  # (k3 at the policy itself: 0)
        loss.backward()
        grads.append(logprobs.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0].tolist() == [[-0.25, -0.25], [0.5, 0.0]]


def test_grpo_loss_statistics_count_an_empty_completion_as_no_change():
    logprobs = torch.zeros(2, 3)
    _, stats = grpo.grpo_loss(logprobs, logprobs, torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 1], [0, 0, 0]]))
    assert stats == {"clip_frac": 0.0, "ratio_mean": 1.0, "kl": 0.0}  # ratio 1 everywhere: the empty row too


def test_grpo_loss_with_kl_penalty_uses_k3_estimator():
    logprobs = torch.tensor([[-1.0]])
    ref = torch.tensor([[-1.5]])
    loss, stats = grpo.grpo_loss(logprobs, logprobs, torch.tensor([0.0]), torch.ones(1, 1), ref_logprobs=ref, beta=0.1)
    k3 = np.exp(-0.5) + 0.5 - 1
    assert stats["kl"] == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.1 * k3)


def test_one_update_per_batch_is_reinforce_with_group_baseline():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, _ = grpo.grpo_loss(logprobs, logprobs.detach(), adv, mask)
    loss.backward()
    expected = torch.tensor([[-2 / 6] * 3, [1 / 4, 1 / 4, 0.0]])  # -A_i / (m |o_i|)
    assert torch.allclose(logprobs.grad, expected)


def test_masked_tokens_contribute_nothing():
    logprobs = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    loss, _ = grpo.grpo_loss(logprobs, logprobs.detach() + 0.1, torch.tensor([1.0, -1.0]), mask)
    loss.backward()
    assert torch.all(logprobs.grad[mask == 0] == 0)
    changed = logprobs.detach().clone()
    changed[mask == 0] = 100.0
    loss2, _ = grpo.grpo_loss(changed, logprobs.detach() + 0.1, torch.tensor([1.0, -1.0]), mask)
    assert loss2.item() == pytest.approx(loss.item())


def test_masked_tokens_contribute_nothing_to_the_kl_term():
    """The KL penalty, like the surrogate, counts completion tokens only."""
    logprobs = torch.tensor([[-1.0, -200.0]])  # a padded position the policy finds very unlikely: exp(199) overflows
    ref = torch.tensor([[-1.5, -1.0]])
    loss, stats = grpo.grpo_loss(logprobs, logprobs, torch.tensor([0.0]), torch.tensor([[1, 0]]), ref_logprobs=ref, beta=0.1)
    k3 = math.exp(-0.5) + 0.5 - 1
    assert stats["kl"] == pytest.approx(k3) and loss.item() == pytest.approx(0.1 * k3)


def test_token_weights_scale_the_surrogate_not_the_kl_penalty():
    """As TRL: the importance weight multiplies the clipped surrogate; beta * KL is added after, unweighted."""
    logprobs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
    loss, _ = grpo.grpo_loss(logprobs, logprobs, torch.tensor([1.0]), torch.ones(1, 2), ref_logprobs=ref, beta=0.1,
                             token_weights=torch.tensor([[2.0, 0.5]]))
    k3 = math.exp(-0.5) + 0.5 - 1
    assert loss.item() == pytest.approx((-(2.0 + 0.5) + 0.1 * k3) / 2)


@pytest.mark.parametrize(
    "log_ratio, advantage, has_gradient",
    [
        (np.log(1.5), 1.0, False),  # above 1+eps with A>0: clipped, no gradient
        (np.log(1.5), -1.0, True),  # above 1+eps with A<0: min picks unclipped
        (np.log(0.5), -1.0, False),  # below 1-eps with A<0: clipped
        (np.log(0.5), 1.0, True),  # below 1-eps with A>0: unclipped
        (np.log(1.1), 1.0, True),  # inside the range
    ],
)
def test_clipping_zeroes_the_gradient_on_the_side_the_min_picks(log_ratio, advantage, has_gradient):
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - log_ratio]], dtype=torch.float32)
    loss, _ = grpo.grpo_loss(logprobs, old, torch.tensor([advantage]), torch.ones(1, 1), clip_eps=0.2)
    loss.backward()
    assert (logprobs.grad.abs().item() > 0) == has_gradient


def test_asymmetric_clip_high():
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - np.log(1.25)]], dtype=torch.float32)
    loss, _ = grpo.grpo_loss(logprobs, old, torch.tensor([1.0]), torch.ones(1, 1), clip_eps=0.2, clip_eps_high=0.28)
    loss.backward()
    assert logprobs.grad.item() != 0  # ratio 1.25 < 1.28: not clipped


def test_asymmetric_clipping_keeps_clip_eps_on_the_low_side_and_counts_clips_per_side():
    """DAPO's clip-higher: clip_eps_high widens the upper side only, and clip_frac counts a token clipped on either."""

    def one_token(ratio, advantage):
        logprobs = torch.tensor([[-1.0]], requires_grad=True)
        old = torch.tensor([[-1.0 - math.log(ratio)]])
        loss, stats = grpo.grpo_loss(logprobs, old, torch.tensor([advantage]), torch.ones(1, 1), clip_eps=0.2, clip_eps_high=0.28)
        loss.backward()
        return logprobs.grad.item() != 0, stats["clip_frac"]

    assert one_token(0.75, -1.0) == (False, 1.0)  # below 1 - 0.2 with A < 0: clipped (not at 1 - 0.28)
    assert one_token(1.25, 1.0) == (True, 0.0)  # below 1 + 0.28: neither clipped nor counted as clipped
    assert one_token(1.3, 1.0) == (False, 1.0)


@pytest.mark.parametrize("advantage, direction", [(1.0, 1), (-1.0, -1)])
def test_one_sgd_step_moves_the_logprob_with_the_sign_of_the_advantage(advantage, direction):
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 7, requires_grad=True)
    ids = torch.tensor([[1, 3, 5, 0]])
    before = grpo.token_logprobs(logits, ids).detach()
    lp = grpo.token_logprobs(logits, ids)
    loss, _ = grpo.grpo_loss(lp, lp.detach(), torch.tensor([advantage]), torch.ones(1, 4))
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    after = grpo.token_logprobs(logits, ids).detach()
    assert torch.all(torch.sign(after - before) == direction)


def test_well_formatted_needs_the_order_and_each_tag_once():
    assert rewards.is_well_formatted("<think>a</think>\n<answer>1</answer>")
    assert not rewards.is_well_formatted("<answer>1</answer><think>a</think>")  # all four tags, wrong order
    assert rewards.format_reward("<answer>1</answer><think>a</think>") == pytest.approx(4 * rewards.TAG_REWARD)


# The authors' grader (utils/data.py answer_correct: the whole text, the last <answer> content or the last
# [\d.,]+ match, any of them, through a MATH-style normaliser), run on each row: same verdict unless noted.
LENIENCY_TABLE = [
    ("<answer>$1,234.00</answer>", "1234", True),
    ("<answer>\\boxed{12}</answer>", "12", True),
    ("\\boxed{12}", "12", True),
    ("<answer>12 dollars</answer>", "12", True),
    ("The answer is 12.0", "12", True),
    ("<answer>7</answer> wait, it is 72", "72", True),  # was 0: the last number counts as well as the tag
    ("<answer>seventy-two</answer> so 72", "72", True),  # was 0
    ("The total is 72. <answer></answer>", "72", True),  # was 0
    ("<answer>\\frac{1}{2}</answer>", "0.5", True),  # was 0: LaTeX fractions
    ("<answer>\\dfrac{3}{4}</answer>", "3/4", True),  # was 0
    ("<answer>1{,}000</answer>", "1000", True),  # was 0: LaTeX thousands
    ("<answer>\\tfrac34</answer>", "0.75", True),  # theirs: wrong
    ("<answer>-\\frac{1}{2}</answer>", "-0.5", True),  # theirs: wrong
    ("<answer>1\\,000</answer>", "1000", True),  # theirs: wrong
    ("<answer>12.50</answer>", "12.5", True),  # theirs: wrong
    ("She sold 72 clips.", "72", True),  # theirs: wrong (their last match is the final ".")
    ("<answer>2\\frac{1}{2}</answer>", "10.5", False),  # not read as 21/2
    ("<answer>72</answer><answer>7</answer>", "72", False),  # the last tag and the last number are both 7
    ("<answer>-5</answer>", "5", False),  # theirs: right (their last match drops the sign); not copied
    ("<answer>1 000</answer>", "1000", True),  # was 0: thousands grouped by spaces, as GSM8K's own solutions write them
    ("<answer>17 000/5</answer>", "3400", True),  # was 0: not the mixed number 17 0/5
    ("<answer>1 00</answer>", "0", False),  # was 1: its last number was 00
    ("<answer>1,00</answer>", "0", False),  # was 1
    ("<answer>1_000</answer>", "0", False),  # was 1
    ("<answer>3,0</answer>", "0", False),  # was 1 (3.0, written with a decimal comma)
    ("<answer>1, 0</answer>", "0", True),  # a list: 0 is a number of its own
]


@pytest.mark.parametrize("completion, answer, correct", LENIENCY_TABLE)
def test_reward_correctness_is_at_least_as_lenient_as_the_authors_grader(completion, answer, correct):
    assert rewards.correctness_reward(completion, answer) == (1.0 if correct else 0.0)


def test_token_weights_at_padded_positions_let_no_nan_into_the_loss_or_gradient():
    """Log-probs padded with -inf give weight exp(-inf - -inf) = NaN there; multiplied by the mask it was NaN still."""
    logprobs = torch.tensor([[-1.0, -math.inf]], requires_grad=True)
    weights = grpo.truncated_importance_weights(logprobs, logprobs.detach(), cap=2.0)
    assert math.isnan(weights[0, 1].item())
    loss, _ = grpo.grpo_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), torch.tensor([[1, 0]]), token_weights=weights)
    loss.backward()
    assert loss.item() == -1.0 and torch.isfinite(logprobs.grad).all()


def test_truncated_importance_weights_cap_the_ratio_and_one_is_no_correction():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    sampled = torch.tensor([[-1.0, -3.0, -0.4]])
    weights = grpo.truncated_importance_weights(logprobs, sampled, cap=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0, math.exp(-0.1)]])) and not weights.requires_grad
    adv, mask = torch.tensor([1.0]), torch.ones(1, 3)
    plain, _ = grpo.grpo_loss(logprobs, logprobs.detach(), adv, mask)
    ones, _ = grpo.grpo_loss(logprobs, logprobs.detach(), adv, mask, token_weights=torch.ones(1, 3))
    weighted, _ = grpo.grpo_loss(logprobs, logprobs.detach(), adv, mask, token_weights=weights)
    assert ones.item() == plain.item() and weighted.item() == pytest.approx(-(1.0 + 2.0 + math.exp(-0.1)) / 3)
