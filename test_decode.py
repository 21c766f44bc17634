"""decode.py: the sampler's decode step (the reserved cache, the static step a CUDA graph captures, its attention),
checked on a CPU against the eager step and transformers' growing cache. test_cuda.py captures it on a GPU."""

from __future__ import annotations

import functools

import pytest
import torch

import decode
import sampling
from testkit import lora_policy


@pytest.mark.parametrize("merged", [False, True])
def test_a_reserved_cache_generates_what_a_growing_one_does(tiny_model_dir, monkeypatch, merged):
    """reserve_cache (keys and values written in place) against transformers' DynamicCache growing by
    concatenation: the same tokens and log-probabilities."""
    model, tokenizer = lora_policy(tiny_model_dir)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    results = []
    for reserve in (decode.reserve_cache, lambda cache, tokens: None):
        monkeypatch.setattr(sampling, "reserve_cache", reserve)
        sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=10, temperature=0.9, merged=merged)
        torch.manual_seed(0)
        results.append([(r.completion_ids, r.logprobs) for group in sampler.generate(prompts, 4) for r in group])
    (reserved, growing) = results
    assert [ids for ids, _ in reserved] == [ids for ids, _ in growing]
    assert [logprobs for _, logprobs in reserved] == [logprobs for _, logprobs in growing]
    assert len({tuple(ids) for ids, _ in reserved}) > 2


@pytest.mark.parametrize("merged", [False, True])
def test_the_cuda_graphs_static_decode_step_generates_what_the_eager_one_does(tiny_model_dir, monkeypatch, merged):
    """CudaGraphDecode's step run eagerly (capture=False: a CPU has no CUDA graphs): keys and values written at a
    column of the reserved cache, attention over all of it under a 4D mask, the same tokens and log-probabilities
    as EagerDecode's growing view, with padding (prompts of different lengths, padded after the prefix they share). In
    float32: in bfloat16 the longer sums round differently and an adjacent token is sometimes drawn (the GPU check
    measures that gap). test_cuda captures the step as a graph."""
    model, tokenizer = lora_policy(tiny_model_dir)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 12, 13]]
    results = []
    for step in (decode.EagerDecode, functools.partial(decode.CudaGraphDecode, capture=False)):
        monkeypatch.setattr(sampling, "EagerDecode", step)
        sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=12, temperature=0.9, merged=merged, merged_dtype=torch.float32)
        torch.manual_seed(0)
        results.append([(r.completion_ids, r.logprobs) for group in sampler.generate(prompts, 4) for r in group])
    (eager, static) = results
    assert [ids for ids, _ in static] == [ids for ids, _ in eager]
    assert torch.allclose(torch.tensor([lp for _, lps in static for lp in lps]), torch.tensor([lp for _, lps in eager for lp in lps]), atol=1e-5)
    assert len({tuple(ids) for ids, _ in static}) > 2


def soft_capped_or_sinks(kind: str):
    """Tiny random models whose attention sdpa cannot compute, on eager attention (transformers 5.24 gives it to them
    itself): Gemma 2's soft-capped scores and gpt-oss's attention sinks (every layer full attention, so their caches
    can be reserved)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

    shape = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, layer_types=["full_attention"] * 2, attn_implementation="eager")  # (5.24's choice; 5.19 picks sdpa)
    torch.manual_seed(0)
    if kind == "soft-capped":
        return Gemma2ForCausalLM(Gemma2Config(intermediate_size=64, attn_logit_softcapping=0.5, **shape)).eval()
    return GptOssForCausalLM(GptOssConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **shape)).eval()


@pytest.mark.parametrize("kind", ["soft-capped", "sinks"])
def test_a_model_that_attends_eagerly_keeps_its_attention_in_the_static_step(kind):
    """decode_attention is sdpa's arithmetic; soft-capping and sinks are not in it (sdpa refuses the first and drops
    the second without a word: 0.03 logits apart here). A model on eager attention keeps it in CudaGraphDecode's step:
    the same logits as EagerDecode's."""
    model = soft_capped_or_sinks(kind)
    assert model.config._attn_implementation == "eager"
    logits = []
    for step in (decode.EagerDecode, functools.partial(decode.CudaGraphDecode, capture=False)):
        with torch.inference_mode():
            cache, last, mask = sampling.prefill(model, [[1, 2, 3, 4], [1, 2, 5]], 0)
            assert decode.reserve_cache(cache, 3)
            decode_step = step(model, cache, torch.cat([mask, mask.new_ones(2, 3)], dim=1), mask.sum(1), mask.shape[1])
            token, rows = last.argmax(-1), []
            for _ in range(3):
                rows.append(decode_step(token).clone())
                token = rows[-1].argmax(-1)
        logits.append(torch.stack(rows))
    assert torch.allclose(logits[0], logits[1], atol=1e-5)


def static_step(tiny_model_dir):
    """The tiny model's merged float32 copy, prefilled with two prompts (one left-padded), and CudaGraphDecode's step
    over its cache reserved for 4 more tokens, not captured. Made under inference mode, as the sampler makes it: call
    the step there too."""
    model, _ = lora_policy(tiny_model_dir)
    clone = sampling.merged_copy(model, torch.float32)
    with torch.inference_mode():
        prompt, mask = torch.tensor([[5, 6, 7, 8], [2, 9, 10, 11]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
        out = clone(input_ids=prompt, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0), use_cache=True)
        cache = getattr(out, decode.kv_cache_name())
        assert decode.reserve_cache(cache, 4)
        return clone, decode.CudaGraphDecode(clone, cache, torch.cat([mask, mask.new_ones(2, 4)], dim=1), mask.sum(1), 4, capture=False)


def test_the_static_decode_step_never_reads_a_tensor_on_the_host_so_a_cuda_graph_can_capture_it(tiny_model_dir):
    """A CUDA graph cannot capture an operation that brings a value back to the host (`.item()`, a bool of a
    tensor, `nonzero`, ...): the capture fails. Checked here on a CPU, operation by operation: CudaGraphDecode's step
    has none under the installed transformers (the eager step has: transformers' mask code asks whether every
    position is attended), while the same check does see one in `bool(tensor)`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.found = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal", "masked_select",
                                               "unique", "_unique2", "repeat_interleave"):
                self.found.append(func.__name__)
            return func(*args, **(kwargs or {}))

    _, step = static_step(tiny_model_dir)
    with torch.inference_mode():
        with HostReads() as static:
            logits = step(torch.tensor([12, 13]))
        with HostReads() as control:
            bool(logits.isfinite().all())
    assert static.found == [] and control.found == ["is_nonzero.default"]


def test_the_static_step_attends_through_decode_attention_in_every_layer_and_gives_the_model_its_attention_back(
        tiny_model_dir, monkeypatch):
    """CudaGraphDecode switches the model's attention to decode_attention only inside its own forward: every layer of
    every step goes through it with one new token per row (the folded path), and the prefill's attention before and
    the model's setting after are transformers' own."""
    calls = []
    folded = decode.decode_attention
    monkeypatch.setattr(decode, "decode_attention", lambda module, query, *args, **kwargs: calls.append(query.shape) or folded(
        module, query, *args, **kwargs))
    clone, step = static_step(tiny_model_dir)
    attention = clone.config._attn_implementation
    assert calls == []  # the prefill attends with transformers' own
    with torch.inference_mode():
        step(torch.tensor([12, 13]))
        step(torch.tensor([14, 15]))
    layers, heads = clone.config.num_hidden_layers, clone.config.num_attention_heads
    assert heads > clone.config.num_key_value_heads  # grouped-query attention: decode_attention folds it
    assert calls == [torch.Size([2, heads, 1, clone.config.head_dim])] * (2 * layers)
    assert clone.config._attn_implementation == attention


@pytest.mark.parametrize("layout", ["contiguous", "heads-last"])
def test_decode_attention_folds_grouped_heads_into_the_query_and_gives_attention_over_repeated_heads(monkeypatch, layout):
    """One new token per row, 8 query heads on 2 key/value heads, a mask hiding some positions: the folded product
    equals attention written out with each key and value head repeated for its 4 query heads. `heads-last`: the
    product returned in the layout some CUDA kernels give ([rows, heads, length, dim] as a transposed view)."""
    if layout == "heads-last":
        sdpa = torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda *args, **kwargs: sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2))
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 8, 1, 16), torch.randn(3, 2, 10, 16), torch.randn(3, 2, 10, 16)
    mask = torch.zeros(3, 1, 1, 10)
    mask[0, ..., 7:], mask[1, ..., :2] = torch.finfo(torch.float32).min, torch.finfo(torch.float32).min
    folded, _ = decode.decode_attention(torch.nn.Module(), query, key, value, mask, scaling=0.25)
    weights = torch.softmax(query @ key.repeat_interleave(4, dim=1).transpose(-1, -2) * 0.25 + mask, dim=-1)
    expected = (weights @ value.repeat_interleave(4, dim=1)).transpose(1, 2)  # [rows, 1, heads, dim]
    assert folded.shape == (3, 1, 8, 16)
    assert torch.allclose(folded, expected, atol=1e-5)


def test_the_reserved_cache_is_freed_when_generate_returns_without_the_cycle_collector(tiny_model_dir, monkeypatch):
    """reserve_cache gives each layer an update that refers to the layer; the sampler drops it after decoding (release_cache), so
    the cache (0.76 GB at Qwen2.5-3B's shape, 32 rows) is not carried into the update until Python's gc runs."""
    import gc
    import weakref

    model, tokenizer = lora_policy(tiny_model_dir)
    rooms = []
    reserve = decode.reserve_cache
    monkeypatch.setattr(sampling, "reserve_cache", lambda cache, tokens: reserve(cache, tokens) and not rooms.append(
        weakref.ref(cache.layers[0].room[0])))
    gc.collect()
    gc.disable()
    try:
        sampling.HFSampler(model, tokenizer, max_new_tokens=4, temperature=0.9, merged=True).generate([[5, 6, 7]], 2)
        assert len(rooms) == 1 and rooms[0]() is None
    finally:
        gc.enable()


def test_windowed_attention_finds_gpt_neos_local_layers():
    """GPT-Neo's local layers mask all but the last window_size columns (their cache is a plain DynamicLayer): a shared
    prefix padded inside a row, or the update's packed row, changed what a token saw (gaps of 4-6 nats, 6-token window)."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(0)
    model = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, window_size=6,
                                           attention_types=[[["local", "global"], 1]], max_position_embeddings=64)).eval()
    assert decode.windowed_attention(model)
    prompts = [list(range(20, 40)) + rest for rest in ([5, 6, 7, 8, 9, 10, 11, 12], [13])]
    with torch.no_grad():
        _, logits, _ = sampling.prefill(model, prompts, 0, share_prefix=True)
        own = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts])
    assert torch.allclose(logits, own, atol=1e-5)
    model.config.attention_layers = ["global", "global"]
    assert not decode.windowed_attention(model)
