"""sampling.py: the transformers sampler (shared prefill, tempered sampling, stop tokens, the merged copy)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

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


@pytest.mark.parametrize("merged", [False, True])
def test_a_reserved_cache_generates_what_a_growing_one_does(tiny_model_dir, monkeypatch, merged):
    """reserve_cache (keys and values written in place) against transformers' DynamicCache growing by
    concatenation: the same tokens and log-probabilities."""
    model, tokenizer = lora_policy(tiny_model_dir)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    results = []
    for reserve in (sampling.reserve_cache, lambda cache, tokens: None):
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
    as EagerDecode's growing view, with left padding (prompts of different lengths). In float32: in bfloat16 the longer
    sums round differently and an adjacent token is sometimes drawn (the GPU check measures that gap). test_cuda
    captures the step as a graph."""
    model, tokenizer = lora_policy(tiny_model_dir)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    results = []
    for decode in (sampling.EagerDecode, functools.partial(sampling.CudaGraphDecode, capture=False)):
        monkeypatch.setattr(sampling, "EagerDecode", decode)
        sampler = sampling.HFSampler(model, tokenizer, max_new_tokens=12, temperature=0.9, merged=merged, merged_dtype=torch.float32)
        torch.manual_seed(0)
        results.append([(r.completion_ids, r.logprobs) for group in sampler.generate(prompts, 4) for r in group])
    (eager, static) = results
    assert [ids for ids, _ in static] == [ids for ids, _ in eager]
    assert torch.allclose(torch.tensor([lp for _, lps in static for lp in lps]), torch.tensor([lp for _, lps in eager for lp in lps]), atol=1e-5)
    assert len({tuple(ids) for ids, _ in static}) > 2



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

    model, tokenizer = lora_policy(tiny_model_dir)
    clone = sampling.merged_copy(model, torch.float32)
    with torch.inference_mode():
        prompt, mask = torch.tensor([[5, 6, 7, 8], [2, 9, 10, 11]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
        out = clone(input_ids=prompt, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0), use_cache=True)
        cache = getattr(out, sampling.kv_cache_name())
        assert sampling.reserve_cache(cache, 4)
        step = sampling.CudaGraphDecode(clone, cache, torch.cat([mask, mask.new_ones(2, 4)], dim=1), mask.sum(1), 4, capture=False)
        with HostReads() as static:
            logits = step(torch.tensor([12, 13]))
        with HostReads() as control:
            bool(logits.isfinite().all())
    assert static.found == [] and control.found == ["is_nonzero.default"]


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
    folded, _ = sampling.decode_attention(torch.nn.Module(), query, key, value, mask, scaling=0.25)
    weights = torch.softmax(query @ key.repeat_interleave(4, dim=1).transpose(-1, -2) * 0.25 + mask, dim=-1)
    expected = (weights @ value.repeat_interleave(4, dim=1)).transpose(1, 2)  # [rows, 1, heads, dim]
    assert folded.shape == (3, 1, 8, 16)
    assert torch.allclose(folded, expected, atol=1e-5)


def test_the_reserved_cache_is_freed_when_generate_returns_without_the_cycle_collector(tiny_model_dir, monkeypatch):
    """reserve_cache gives each layer an update that refers to the layer; the sampler drops it after decoding, so
    the cache (0.76 GB at Qwen2.5-3B's shape, 32 rows) is not carried into the update until Python's gc runs."""
    import gc
    import weakref

    model, tokenizer = lora_policy(tiny_model_dir)
    rooms = []
    reserve = sampling.reserve_cache
    monkeypatch.setattr(sampling, "reserve_cache", lambda cache, tokens: reserve(cache, tokens) and not rooms.append(
        weakref.ref(cache.layers[0].room[0])))
    gc.collect()
    gc.disable()
    try:
        sampling.HFSampler(model, tokenizer, max_new_tokens=4, temperature=0.9, merged=True).generate([[5, 6, 7]], 2)
        assert len(rooms) == 1 and rooms[0]() is None
    finally:
        gc.enable()

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
    base = models.load_policy(str(tiny_model_dir), "cpu", dtype)[0].state_dict()
    assert all(torch.equal(sampler.model.state_dict()[k], v) for k, v in base.items())


def test_cut_at_stop_keeps_the_eos_and_drops_what_follows():
    assert sampling.cut_at_stop([5, 6, 2, 9, 2], {2}) == ([5, 6, 2], False)
    assert sampling.cut_at_stop([5, 6, 7], {2}) == ([5, 6, 7], True)
