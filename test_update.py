"""update.py: log-probs of completions (shared prompt or not, padded or not) and the micro-batched update."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import grpo
import model as models
import sampling
import train
import update
from testkit import checkpointed_lora_policy, lora_policy, mixed_length_groups, read_metrics, tiny_args, update_at_lr_0


def test_kl_penalty_measures_the_distance_from_the_base_model(tiny_model_dir, tmp_path, length_rewards):
    """--beta > 0: the reference is the model with the adapter off; KL is 0 while the adapter is
    still zero (step 1) and positive once the update has moved it (step 2)."""
    out = tmp_path / "run"
    assert train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--beta", "0.1")) == 0
    rows = read_metrics(out)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and rows[1]["kl"] > 1e-6


@pytest.mark.parametrize("share", ["--share-prompt", "--no-share-prompt"])
@pytest.mark.parametrize("rule, m, rows_per_step", [("max_variance", 2, 4), ("random", 3, 6), ("none", 4, 8)])
def test_only_the_kept_rollouts_enter_the_update(tiny_model_dir, tmp_path, monkeypatch, rule, m, rows_per_step, share, length_rewards):
    """2 prompts x n=4 generated; the training forward passes see exactly 2 x m rollouts per step."""
    rollouts_seen = []

    def counting(original):
        def logprobs(model, rollouts, *args):
            if torch.is_grad_enabled():
                rollouts_seen.append(len(rollouts))
            return original(model, rollouts, *args)
        return logprobs

    monkeypatch.setattr(update, "completion_logprobs", counting(update.completion_logprobs))
    monkeypatch.setattr(update, "shared_prompt_logprobs", counting(update.shared_prompt_logprobs))
    argv = tiny_args(tiny_model_dir, tmp_path / "run", "--steps", "2", "--rule", rule, "--m", str(m), share)
    assert train.main(argv) == 0
    assert sum(rollouts_seen) == 2 * rows_per_step
    assert max(rollouts_seen) <= 3  # --micro-batch 3


def test_micro_batches_keep_prompt_groups_together_and_split_only_large_ones():
    def kept(*group_sizes):
        return [sampling.Rollout([g], [1], "", False) for g, size in enumerate(group_sizes) for _ in range(size)]

    assert update.micro_batches(kept(2, 2, 2), 4) == [[0, 1, 2, 3], [4, 5]]
    assert update.micro_batches(kept(3, 3), 4) == [[0, 1, 2], [3, 4, 5]]  # not [0..3], [4, 5]: each prompt once
    assert update.micro_batches(kept(6, 1), 4) == [[0, 1, 2, 3], [4, 5, 6]]
    assert update.prompt_groups(kept(2, 1, 3)) == [[0, 1], [2], [3, 4, 5]]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompt_logprobs_equal_the_unshared_ones(tiny_model_dir, checkpointing):
    model, tokenizer = checkpointed_lora_policy(tiny_model_dir, checkpointing)
    model.train()
    rollouts = mixed_length_groups()
    unshared, mask = update.completion_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)
    shared, shared_mask = update.shared_prompt_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)
    assert torch.equal(mask, shared_mask)
    assert ((shared - unshared).abs() * mask).max().item() <= 1e-5


def test_shared_prompt_logprobs_of_a_sliding_window_model_equal_the_unshared_ones(tiny_windowed_dir):
    """A packed row's 4D mask has no sliding window (transformers takes it as it is): such a model is scored row by row."""
    model, tokenizer = lora_policy(tiny_windowed_dir)
    prompt = list(range(20, 40))
    rollouts = [sampling.Rollout(prompt, list(range(50 + k, 60 + 2 * k)), "", True) for k in range(3)]
    with torch.no_grad():
        shared, shared_mask = update.shared_prompt_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)
        unshared, mask = update.completion_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)
    assert torch.equal(shared_mask, mask)
    assert torch.allclose(shared * mask, unshared * mask, atol=1e-5)


def test_shared_prompt_logprobs_under_eager_attention_equal_the_unshared_ones_and_other_kinds_are_refused(tiny_model_dir):
    """Eager attention adds the mask to its scores (a float mask: 0 or the dtype's minimum), sdpa takes the boolean one;
    any other kind (flash attention takes no mask of this shape) stops with what to pass."""
    model, tokenizer = lora_policy(tiny_model_dir)
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    rollouts = mixed_length_groups()
    unshared, mask = update.completion_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)
    shared, _ = update.shared_prompt_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)
    assert ((shared - unshared).abs() * mask).max().item() <= 1e-5
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(models.SetupError, match="^--share-prompt needs sdpa or eager attention, not flash_attention_2; pass --no-share-prompt$"):
        update.shared_prompt_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)


def test_shared_prompt_logprobs_with_completions_shorter_than_the_prompt_or_empty(tiny_model_dir):
    """A long prompt whose kept completions are short together (a model that learned to answer in a
    few tokens): the packed row holds fewer completion tokens than prompt tokens. This once indexed
    past the kept logits for padded completion positions and crashed a run. An empty completion (a
    sampler that strips the EOS, as TRL's) ended in torch.arange(-1)'s RuntimeError; it is masked out."""
    model, tokenizer = lora_policy(tiny_model_dir)
    prompt = list(range(3, 33))  # 30 tokens
    rollouts = [sampling.Rollout(prompt, [40, 41, 42], "", False), sampling.Rollout(prompt, [], "", False),
                sampling.Rollout(prompt, [50], "", False)]
    unshared, mask = update.completion_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)
    shared, shared_mask = update.shared_prompt_logprobs(model, rollouts, 0.7, tokenizer.pad_token_id)
    assert torch.equal(mask, shared_mask) and mask[1].sum() == 0
    assert ((shared - unshared).abs() * mask).max().item() <= 1e-5
    for logprobs in (update.completion_logprobs, update.shared_prompt_logprobs):  # a micro-batch of empty completions only
        _, empty = logprobs(model, rollouts[1:2], 0.7, tokenizer.pad_token_id)
        assert empty.shape == (1, 0) and empty.dtype == torch.long  # (float32 from torch.tensor([[]]), for one of them)


@pytest.mark.parametrize("share", [False, True])
def test_an_update_whose_micro_batch_holds_only_empty_completions_with_sampler_logprobs_runs(tiny_model_dir, share):
    """A sampler that strips the EOS (TRL's) with log-probs (vLLM's): gap.max() of no token was a RuntimeError."""
    model, tokenizer = lora_policy(tiny_model_dir)
    rollouts = [sampling.Rollout([3, 4, 5], [6, 7], "", False, logprobs=[-1.0, -2.0]), sampling.Rollout([3, 4, 5], [8], "", False, logprobs=[-0.5])]
    rollouts += [sampling.Rollout([9, 10], [], "", False, logprobs=[]) for _ in range(2)]
    args = update.UpdateSettings(micro_batch=2, share_prompt=share, bf16_autocast=False, max_grad_norm=1e9)
    stats, _ = update_at_lr_0(model, rollouts, torch.tensor([1.0, -1.0, 0.5, -0.5]), args, tokenizer.pad_token_id)
    assert stats["skipped"] == 0 and stats["sampler_gap_max"] > 0  # the gap of the first micro-batch's 3 tokens


@pytest.mark.parametrize("checkpointing, beta", [(False, 0.0), (True, 0.0), (False, 0.1), (True, 0.1)])
def test_shared_prompt_update_gives_the_same_lora_gradients(tiny_model_dir, checkpointing, beta):
    """policy_update with --share-prompt and without: the same loss, KL and accumulated LoRA gradients
    (micro-batch 4, so the group of 4 fills one micro-batch and the groups of 3 and 2 are kept whole)."""
    rollouts = mixed_length_groups()
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.7, -0.7, 0.3, -1.0, 0.2, 0.5])
    results = []
    for share in (False, True):
        model, tokenizer = checkpointed_lora_policy(tiny_model_dir, checkpointing)
        args = update.UpdateSettings(micro_batch=4, beta=beta, share_prompt=share, bf16_autocast=False, max_grad_norm=1e9)
        stats, params = update_at_lr_0(model, rollouts, advantages, args, tokenizer.pad_token_id)  # the gradients are the result
        results.append((stats, [p.grad.clone() for p in params]))
    (unshared, unshared_grads), (shared, shared_grads) = results
    assert shared["loss"] == pytest.approx(unshared["loss"], abs=1e-6)
    assert shared["kl"] == pytest.approx(unshared["kl"], abs=1e-6)
    assert (shared["kl"] > 0) == (beta > 0)
    total = torch.cat([g.flatten() for g in unshared_grads]).norm()
    assert total > 0
    assert torch.cat([(a - b).flatten() for a, b in zip(shared_grads, unshared_grads)]).norm() / total <= 1e-4


def test_update_statistics_do_not_depend_on_how_the_batch_is_split(tiny_model_dir):
    """The step's kl (and loss) are the same numbers for any --micro-batch, prompt-shared or not: grpo_loss
    averages its statistics as the loss, so their completion-weighted mean over micro-batches is the batch's.
    (Token means per micro-batch gave kl 0.0338 at micro-batch 1 and 0.0365 at 9 here.)"""
    rollouts = mixed_length_groups()
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.7, -0.7, 0.3, -1.0, 0.2, 0.5])
    results = {}
    for micro_batch, share in ((1, False), (9, False), (3, True), (9, True)):
        model, tokenizer = lora_policy(tiny_model_dir)
        args = update.UpdateSettings(micro_batch=micro_batch, beta=0.1, share_prompt=share, bf16_autocast=False, max_grad_norm=1e9)
        stats, _ = update_at_lr_0(model, rollouts, advantages, args, tokenizer.pad_token_id)
        results[micro_batch, share] = stats
    reference = results[1, False]
    assert reference["kl"] > 1e-3
    for stats in results.values():
        for key in ("loss", "kl", "ratio_mean", "clip_frac"):
            assert stats[key] == pytest.approx(reference[key], abs=1e-6), key


def test_the_update_clips_the_gradient_to_max_grad_norm_and_reports_the_norm_before_clipping(tiny_model_dir):
    """The update's gradient is scaled down to --max-grad-norm (the GPU profile's 0.1 binds at most steps); the row
    reports the norm before. Nothing else checked that clipping happens at all."""
    model, tokenizer = lora_policy(tiny_model_dir)
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.7, -0.7, 0.3, -1.0, 0.2, 0.5])
    args = update.UpdateSettings(micro_batch=9, max_grad_norm=1e-3, bf16_autocast=False)
    stats, params = update_at_lr_0(model, mixed_length_groups(), advantages, args, tokenizer.pad_token_id)
    clipped = torch.cat([p.grad.flatten() for p in params]).norm().item()
    assert stats["grad_norm"] > 1e-2 and clipped == pytest.approx(1e-3, rel=1e-3)


def test_a_non_finite_loss_skips_the_step_even_when_the_gradient_is_finite(tiny_model_dir, monkeypatch):
    """A step whose loss is not finite changes no weight, even where the gradient happens to be."""
    model, tokenizer = lora_policy(tiny_model_dir)
    original = grpo.grpo_loss
    monkeypatch.setattr(grpo, "grpo_loss", lambda *a, **k: (lambda loss, stats: (loss + math.inf, stats))(*original(*a, **k)))
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    stats = update.policy_update(model, optimizer, scheduler, mixed_length_groups(), torch.linspace(-1, 1, 9),
                                 update.UpdateSettings(micro_batch=9, max_grad_norm=1e9), tokenizer.pad_token_id)
    assert stats["skipped"] == 1 and math.isfinite(stats["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, params))


def test_tis_cap_weights_each_token_by_the_truncated_ratio_and_the_gap_counts_completion_tokens_only(tiny_model_dir):
    """policy_update with --tis-cap: each token's surrogate times min(pi_theta / pi_sampler, cap); the sampler gap is
    measured on completion tokens only (not on the padding of a shorter completion)."""
    model, tokenizer = lora_policy(tiny_model_dir)
    pad = tokenizer.pad_token_id
    base = [sampling.Rollout([3, 4, 5], [6, 7, 8], "", False), sampling.Rollout([3, 4, 5], [9, 10], "", False)]
    with torch.no_grad():
        logprobs, mask = update.completion_logprobs(model, base, 0.9, pad)
    shift = torch.tensor([[0.5, -0.5, 3.0], [-3.0, 0.2, 0.0]])  # log pi_theta - log pi_sampler
    rollouts = [dataclasses.replace(r, logprobs=(logprobs[i] - shift[i])[: len(r.completion_ids)].tolist()) for i, r in enumerate(base)]
    adv = torch.tensor([1.0, -1.0])
    args = update.UpdateSettings(micro_batch=2, temperature=0.9, tis_cap=2.0, max_grad_norm=1e9, bf16_autocast=False)
    stats, _ = update_at_lr_0(model, rollouts, adv, args, pad)
    expected = -((shift.exp().clamp(max=2.0) * adv[:, None] * mask).sum(1) / mask.sum(1)).mean()
    assert stats["loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert stats["sampler_gap_max"] == pytest.approx(3.0, abs=1e-5) and stats["sampler_gap_mean"] == pytest.approx(7.2 / 5, abs=1e-5)


@pytest.mark.parametrize("share, beta, checkpointing", [(False, 0.0, False), (True, 0.0, False), (True, 0.1, True)])
def test_frozen_weights_for_autocast_give_bit_identical_loss_and_gradients(tiny_model_dir, share, beta, checkpointing):
    """Under bfloat16 autocast, base weights stored in bfloat16 and the adapters' input cast off
    (the CPU profile's model) are the same numbers as float32 weights that autocast casts each time,
    the KL term's reference pass (adapter off) and activation checkpointing's recomputation included."""
    rollouts = mixed_length_groups()
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.7, -0.7, 0.3, -1.0, 0.2, 0.5])
    results = []
    for stored in (False, True):
        model, tokenizer = checkpointed_lora_policy(tiny_model_dir, checkpointing)
        if stored:
            models.frozen_weights_for_autocast(model)
        args = update.UpdateSettings(micro_batch=4, share_prompt=share, beta=beta, bf16_autocast=True, max_grad_norm=1e9)
        stats, params = update_at_lr_0(model, rollouts, advantages, args, tokenizer.pad_token_id)
        results.append((stats["loss"], stats["kl"], [p.grad.clone() for p in params]))
    (loss, kl, grads), (stored_loss, stored_kl, stored_grads) = results
    assert (stored_loss, stored_kl) == (loss, kl) and (kl > 0) == (beta > 0)
    assert all(torch.equal(a, b) for a, b in zip(grads, stored_grads))
    assert model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16


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
    args = update.UpdateSettings(micro_batch=8, bf16_autocast=merged == torch.bfloat16, max_grad_norm=1e9, share_prompt=True)  # the CPU profile's
    stats, _ = update_at_lr_0(model, rollouts, torch.randn(len(rollouts)), args, tokenizer.pad_token_id)
    if merged == torch.bfloat16:  # measured on this tiny model: mean 0.0012, max 0.007 (the embedded model: benchmark.py prints it)
        assert 0 < stats["sampler_gap_mean"] < 0.005 and stats["sampler_gap_max"] < 0.05
    else:  # measured: max 2e-6, the trained model and the float32 copy alike
        assert stats["sampler_gap_max"] < 1e-4


def test_batched_logprobs_with_padding_equal_unpadded_ones(tiny_model_dir):
    model, tokenizer = models.load_policy(str(tiny_model_dir), "cpu", torch.float32)
    rollouts = [sampling.Rollout([5, 6, 7, 8, 9], [10, 11, 2], "", False), sampling.Rollout([5, 6], [12], "", True),
                sampling.Rollout([1, 2, 3], [4, 5, 6, 7], "", True)]
    with torch.no_grad():
        batched, mask = update.completion_logprobs(model, rollouts, 0.9, tokenizer.pad_token_id)
        for i, r in enumerate(rollouts):
            alone, _ = update.completion_logprobs(model, [r], 0.9, tokenizer.pad_token_id)
            assert torch.allclose(batched[i, : len(r.completion_ids)], alone[0], atol=1e-5)
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1] / 0.9
            direct = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.completion_ids)[:, None]).squeeze(-1)
            assert torch.allclose(alone[0], direct, atol=1e-5)
    assert mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_model_with_dropout_is_updated_without_it(embedded_dir, tmp_path, kind):
    """The update runs in training mode; GPT-2's dropout (0.1 by default) then scored the rollouts under a noisy policy,
    not the sampled one: sampler gap mean 0.05, max 0.2. Llama's attention_dropout is a number of the attention module."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    config = (GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2) if kind == "gpt2" else
              LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          attention_dropout=0.3))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, tokenizer = models.load_trainable_policy(str(tmp_path), "cpu", lora_rank=4, lora_alpha=8)
    sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=8, temperature=0.9, merged=False)
    rollouts = [r for group in sampler.generate([[5, 6, 7, 8], [9, 10, 11]], 4) for r in group]
    stats, _ = update_at_lr_0(model, rollouts, torch.randn(len(rollouts)), update.UpdateSettings(micro_batch=8, max_grad_norm=1e9),
                              tokenizer.pad_token_id)
    assert stats["sampler_gap_max"] < 1e-4


def test_without_dropout_reaches_rates_a_module_reads_from_its_config():
    """Falcon's blocks read hidden_dropout from the config as they run: two forwards in training mode differed by 0.3."""
    from transformers import AutoModelForCausalLM, FalconConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                          hidden_dropout=0.1, attention_dropout=0.1))
    models.without_dropout(model)
    model.train()
    ids = torch.arange(12).reshape(2, 6)
    assert torch.equal(model(ids).logits, model(ids).logits)
