"""sampling.py: the transformers sampler (shared prefill, tempered sampling, stop tokens, the merged copy)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import model as models
import sampling
from testkit import lora_policy


def test_computes_bfloat16_takes_a_torch_device_as_well_as_its_name():
    assert models.computes_bfloat16(torch.device("cpu")) == models.computes_bfloat16("cpu")
    assert models.computes_bfloat16(torch.device("cuda", 0)) and models.computes_bfloat16("cuda:0")


def test_computes_bfloat16_reads_what_the_cpu_reports():
    """Against /proc/cpuinfo's flags, a source torch does not share: avx512_bf16 or amx_bf16."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo (not Linux)")
    flags = set(re.search(r"^flags\s*:(.*)$", cpuinfo.read_text(), re.M).group(1).split())
    assert models.computes_bfloat16("cpu") == bool(flags & {"avx512_bf16", "amx_bf16"})
    assert models.computes_bfloat16("cuda")


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


def test_a_sliding_window_model_samples_with_a_shared_prefix_what_its_own_forward_gives(tiny_windowed_dir):
    """A sliding window counts cache columns: a prompt padded after the shared prefix would see fewer of its own tokens
    (Mistral, Gemma 2/3: a gap of ~1 nat). Such a model prefills each row whole: its log-probs are the model's own."""
    model, tokenizer = lora_policy(tiny_windowed_dir)
    prompts = [list(range(20, 40)) + rest for rest in ([5, 6, 7, 8, 9, 10, 11, 12], [13])]
    sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=6, temperature=0.9, merged=True, merged_dtype=torch.float32)
    torch.manual_seed(0)
    rollouts = [r for group in sampler.generate(prompts, 2) for r in group]
    for r in rollouts:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([r.prompt_ids + r.completion_ids])).logits[0, len(r.prompt_ids) - 1 : -1] / 0.9
        own = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.completion_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.logprobs), own, atol=1e-4)


@pytest.mark.parametrize("rests, shared_forwards", [
    ([[5, 6, 7, 8, 9], [12], [15, 16, 17], [5, 6, 7]], [(1, 20), (4, 5)]),  # one prompt is another's beginning
    ([[5], [5, 6]], [(1, 20), (2, 2)]),  # the first is all prefix: one token of it is left for its logits
])
def test_a_prefix_every_prompt_shares_is_prefilled_once_and_samples_what_prefilling_each_row_does(tiny_model_dir, monkeypatch,
                                                                                                    rests, shared_forwards):
    """prefill(share_prefix=True): the tokens all prompts begin with (a system prompt) are computed once, for one row,
    then each prompt's rest. The same tokens and log-probs as each row's own prefill."""
    model, tokenizer = lora_policy(tiny_model_dir)
    prompts = [list(range(20, 40)) + rest for rest in rests]
    shapes, forward = [], model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: shapes[-1].append(tuple(k["input_ids"].shape)) or forward(*a, **k))
    generated = []
    for share in (False, True):
        sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=8, temperature=0.9, batch_size=8, share_prompt=share)
        torch.manual_seed(0)
        shapes.append([])
        generated.append([r for group in sampler.generate(prompts, 2) for r in group])
    assert [r.completion_ids for r in generated[0]] == [r.completion_ids for r in generated[1]]
    assert [x for r in generated[1] for x in r.logprobs] == pytest.approx([x for r in generated[0] for x in r.logprobs], abs=1e-4)
    assert shapes[0][0] == (2 * len(prompts), max(map(len, prompts)))  # every row's whole prompt, left-padded
    assert shapes[1][:2] == shared_forwards
    assert shapes[1][2:] == shapes[0][1:] == [(2 * len(prompts), 1)] * (len(shapes[0]) - 1)  # the decode steps


def test_an_empty_prompt_is_refused_in_one_line(tiny_model_dir):
    """The shared prefix of [[20, 21], []] came out as -1 tokens, and the rows' widths then disagreed."""
    model, tokenizer = lora_policy(tiny_model_dir)
    for share in (False, True):
        sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=2, temperature=0.9, share_prompt=share)
        with pytest.raises(ValueError, match="^every prompt needs at least one token; build prompts with build_prompt$"):
            sampler.generate([[20, 21], []], 2)


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


def test_sample_tokens_can_draw_a_token_rarer_than_float32s_steps_after_most_of_the_mass(monkeypatch):
    """In a float32 running sum 1 + 1e-9 is 1 again: a token of probability 1e-9 after one of nearly 1 had no width and was
    never drawn (most of SmolLM2's vocabulary at most steps). The uniform number is made to land in its interval."""
    logits = torch.tensor([[0.0, math.log(1e-9)]])
    top = 1 - 5e-10  # in [1 - 1e-9, 1): the rare token's interval; float32 rounds it, so there its largest value below 1
    monkeypatch.setattr(torch, "rand", lambda *size, dtype=torch.float32, device=None: torch.full(
        size, min(top, 1 - torch.finfo(dtype).eps / 2), dtype=dtype, device=device))
    token, logprob = sampling.sample_tokens(logits, temperature=1.0)
    assert token.tolist() == [1] and logprob.item() == pytest.approx(math.log(1e-9), rel=1e-6)


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
    base = models.load_policy(str(tiny_model_dir), "cpu", dtype)[0].state_dict()
    assert all(torch.equal(sampler.model.state_dict()[k], v) for k, v in base.items())


def test_cut_at_stop_keeps_the_eos_and_drops_what_follows():
    assert sampling.cut_at_stop([5, 6, 2, 9, 2], {2}) == ([5, 6, 2], False)
    assert sampling.cut_at_stop([5, 6, 7], {2}) == ([5, 6, 7], True)


def test_rollouts_end_at_a_stop_token_or_at_max_new_tokens_with_one_logprob_per_token(tiny_model_dir):
    """Rows stop at different steps (a tiny random model never draws its EOS: here an eighth of the vocabulary
    stops): each rollout ends at its first stop token, or is truncated at max_new_tokens, one log-prob a token."""
    model, tokenizer = lora_policy(tiny_model_dir)
    sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=6, temperature=0.9)
    sampler.stops = set(range(0, len(tokenizer), 8))  # an eighth of the vocabulary stops: rows end at different steps
    torch.manual_seed(0)
    rollouts = [r for group in sampler.generate([[5, 6, 7, 8], [9, 10]], 4) for r in group]
    for r in rollouts:
        assert len(r.logprobs) == len(r.completion_ids) and sum(t in sampler.stops for t in r.completion_ids) == (not r.truncated)
        assert r.completion_ids[-1] in sampler.stops if not r.truncated else len(r.completion_ids) == 6
    assert {r.truncated for r in rollouts} == {True, False}


def test_stop_tokens_are_the_tokenizers_eos_and_every_eos_of_the_generation_config():
    """Models with several end tokens (Llama 3's eot_id, Qwen's <|im_end|> and <|endoftext|>) stop at each."""
    tokenizer = SimpleNamespace(eos_token_id=2)
    assert sampling.stop_token_ids(tokenizer, SimpleNamespace(eos_token_id=[2, 7, 9])) == {2, 7, 9}  # Llama 3's eot_id, ...
    assert sampling.stop_token_ids(tokenizer, SimpleNamespace(eos_token_id=5)) == {2, 5}
    assert sampling.stop_token_ids(tokenizer, None) == {2}
