"""The decode step of the transformers sampler: the next token of every row through the model and its KV cache.

sampling.HFSampler prefills the prompts, then calls `decode_step(token) -> logits` once per generated token, sampling
between calls. That step is where transformers generation spends its time, so this file holds the ways it is made
fast, each measured (docs/speed.md); they compute the same distribution, up to rounding:
- `reserve_cache`: the KV cache written in place, not grown by concatenation at every token (`release_cache` after).
- `EagerDecode`: the step as a plain forward (on a CPU, with `--no-cuda-graph`, or a cache that cannot be reserved).
- `CudaGraphDecode`: on a GPU, the step captured once as a CUDA graph and replayed for every token (a static cache
  written at a column, `write_at_column`, and attention with grouped-query heads folded, `decode_attention`).
The rollouts themselves (Algorithm 1's "sample n rollouts per prompt") are sampling.py's; this is engineering beneath.

Run `python decode.py` to time the embedded model's decode step at 32 rows, eagerly and as the static step (a CUDA
graph on a GPU), and count the rows whose greedy tokens agree (all in float32; a GPU's bfloat16 rounds the two
steps differently, so a row may pick an adjacent token and go its own way).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

log = logging.getLogger("pods")


@functools.cache
def kv_cache_name() -> str:
    """The name of a forward's key-value cache, argument and output: `cache` from transformers 5.24,
    `past_key_values` before (5.24 still takes the old name, with a FutureWarning, until 5.40)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def windowed_attention(model) -> bool:
    """Whether a layer of `model` attends through a sliding window (Mistral, Gemma 2 and 3, Starcoder2, Olmo 3,
    Cohere 2): the KV cache transformers makes for its config then has a layer other than DynamicLayer. Such a
    layer's window counts columns, not positions, so padding inside a row (prefill's shared prefix) or a packed row
    (update.shared_prompt_logprobs, whose 4D mask transformers takes as it is, with no window) changes which tokens
    a token sees: the sampler or the update then computes another distribution than the model's own forward."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if "local" in (getattr(model.config.get_text_config(decoder=True), "attention_layers", None) or ()):
        return True  # GPT-Neo: its local layers' window is in a column mask of their own (window_size), not in the cache
    return any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers)


def reserve_cache(cache, tokens: int) -> bool:
    """Room for `tokens` more positions in every layer of a filled transformers DynamicCache, written in
    place by each decode step. DynamicLayer.update grows keys and values by concatenation, so every
    step copied every layer's whole cache (`cat` was 15% of a generation step on a 2-core CPU,
    docs/speed.md). Each layer's keys and values become views of the filled part of [batch, heads,
    filled + tokens, head_dim] buffers (`layer.room`); DynamicLayer's own code reads lengths and masks
    from those views. Made for sampling.HFSampler's decode loop, which only appends, and calls release_cache
    when it is done: a cache that is reordered, cropped or reset afterwards needs DynamicLayer's own update back.
    A cache with other kinds of layers (sliding-window, shared or linear-attention ones, which keep their own
    lengths) is left as it is: the result says whether the cache was reserved. The room starts as zeros
    (CudaGraphDecode reads all of it)."""
    from transformers.cache_utils import DynamicLayer

    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return False
    for layer in cache.layers:
        filled = layer.keys.shape[-2]
        layer.room = []
        for current in (layer.keys, layer.values):
            room = current.new_zeros(*current.shape[:2], filled + tokens, current.shape[-1])
            room[:, :, :filled] = current
            layer.room.append(room)
        layer.keys, layer.values = (room[:, :, :filled] for room in layer.room)
        layer.update = functools.partial(write_in_place, layer)  # instead of DynamicLayer.update, for this layer
    return True


def write_in_place(layer, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
    """A reserved layer's update: the new positions written after the filled ones, the views extended over them."""
    start, end = layer.keys.shape[-2], layer.keys.shape[-2] + key_states.shape[-2]
    for room, new in zip(layer.room, (key_states, value_states)):
        room[:, :, start:end] = new
    layer.keys, layer.values = (room[:, :, :end] for room in layer.room)
    return layer.keys, layer.values


def release_cache(cache) -> None:
    """Drop the update that reserve_cache (or CudaGraphDecode) gave each layer: it refers to the layer, a reference
    cycle, so without this the reserved buffers (0.76 GB at Qwen2.5-3B's shape, 32 rows) outlive the generation
    until Python's cycle collector runs, and the policy update starts with them still allocated."""
    for layer in cache.layers:
        vars(layer).pop("update", None)


class EagerDecode:
    """A decode step as a plain forward: the new tokens (one per row) attend to the filled part of the cache.
    `mask` is the rows' attention mask over the prompt (`width` columns, left-padded) and the completion;
    `position` the position of each row's first new token."""

    def __init__(self, model, cache, mask: torch.Tensor, position: torch.Tensor, width: int):
        self.model, self.cache, self.mask, self.position, self.filled = model, cache, mask, position[:, None], width

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """The logits that follow `token`, a row's next token for every row."""
        self.filled += 1
        logits = self.model(input_ids=token[:, None], attention_mask=self.mask[:, : self.filled], position_ids=self.position,
                            **{kv_cache_name(): self.cache}, use_cache=True).logits[:, -1]
        self.position = self.position + 1
        return logits


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream on which every CudaGraphDecode warms up and captures its step. cuBLAS keeps a workspace for each
    stream it has run on (32 MiB on an H100/H200, and cuBLASLt 1 MiB) until told to clear them, so a new stream at every
    generation held 33 MiB more each time, up to torch's pool of 32 streams (1 GiB; reproduce/gpu/runs.md). Warmed up on the
    capture's own stream, the step also finds that stream's workspace made before the capture, not inside it."""
    return torch.cuda.Stream(device)


class CudaGraphDecode:
    """A decode step captured once as a CUDA graph and replayed for every token: the same forward as EagerDecode,
    without its launches. At 32 rows a decode step of a 3B model reads ~6 GB of weights (~2 ms on an H100), but
    eagerly it launches some 15 small kernels per layer from Python, and the launches set its pace (docs/speed.md
    has the figures). A graph replays all of them at once; in exchange every tensor it touches
    must keep its address and shape from one step to the next. So the step reads its inputs from fixed tensors
    (`token`, `position`, `column`), each layer writes its new key and value at `column` of the buffers that
    reserve_cache made (`write_at_column`), and attention (`decode_attention`; a model that attends eagerly keeps its own)
    runs over every reserved position with a 4D mask that hides those not yet written (transformers takes a 4D mask as it is). Sampling stays outside the graph, so the
    tokens still come from torch's generator and a resumed run replays them. `capture=False` runs the same
    static step eagerly (how a CPU test checks it), as does a model whose forward cannot be captured."""

    def __init__(self, model, cache, mask: torch.Tensor, position: torch.Tensor, width: int, capture: bool = True):
        from transformers import AttentionInterface

        self.model, self.cache = model, cache
        room = cache.layers[0].room[0]
        self.token, self.position = position.new_zeros(len(position), 1), position[:, None].clone()
        self.column = position.new_full((1,), width)  # where the step writes its keys and values
        self.bias = torch.zeros(len(position), 1, 1, room.shape[-2], dtype=room.dtype, device=room.device)  # added to attention's scores
        self.bias[:, 0, 0, :width].masked_fill_(mask[:, :width] == 0, torch.finfo(room.dtype).min)  # the left padding
        self.bias[:, 0, 0, width:] = torch.finfo(room.dtype).min  # the completion, until written
        for layer in cache.layers:
            layer.update = functools.partial(write_at_column, layer, self.column)
        AttentionInterface.register("pods_decode", decode_attention)  # forward() switches the model to it
        self.graph = None
        if capture:
            stream, side = torch.cuda.current_stream(), capture_stream(room.device)
            side.wait_stream(stream)  # a first forward off the graph: cuBLAS's and the allocator's setup are not captured
            with torch.cuda.stream(side):
                self.forward()  # writes column `width`, which the first step writes again
            stream.wait_stream(side)
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side):
                    self.logits = self.forward()
                self.graph = graph
            except RuntimeError as err:  # a model whose forward cannot be captured (it reads a GPU value on the host, say)
                torch.cuda.set_stream(stream)  # a failed capture can leave the capture's stream current
                log.warning("decoding without CUDA graphs: capturing the decode step failed (%s)", str(err).splitlines()[0])

    def forward(self) -> torch.Tensor:
        config = self.model.config  # every attention layer reads its implementation from it at each forward
        attention = config._attn_implementation
        if attention != "eager":  # transformers picks eager for what sdpa cannot do (Gemma 2's soft-capping, gpt-oss's sinks)
            config._attn_implementation = "pods_decode"
        try:
            return self.model(input_ids=self.token, attention_mask=self.bias, position_ids=self.position,
                              **{kv_cache_name(): self.cache}, use_cache=True).logits[:, -1]
        finally:
            config._attn_implementation = attention

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """The logits that follow `token`; replayed, they are the same tensor every step (read them before the next)."""
        self.token.copy_(token[:, None])
        self.bias.index_fill_(3, self.column, 0.0)  # the token attends to itself and everything before it
        if self.graph is None:
            logits = self.forward()
        else:
            self.graph.replay()
            logits = self.logits
        self.position += 1
        self.column += 1
        return logits


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """CudaGraphDecode's attention (a transformers attention function): one new token per row, with the query heads
    that share a key and value head (grouped-query attention) folded into the query's length, [rows, kv heads,
    group, dim], against the keys and values as they are stored. Given a mask, transformers 5.19's sdpa copies every
    key and value head to each query head it serves (repeat_kv: 8 copies at Qwen2.5-3B's shape, of the whole reserved
    cache, in every layer, every step); folded, nothing is copied: a decode step of 8.2 ms instead of 12.4 (H100, 32
    rows, 3B shape, transformers 5.19; docs/speed.md). transformers 5.24's sdpa folds them itself (`pack_gqa`).
    The same products, equal up to rounding. Anything else (the prefill, models without grouped heads,
    soft-capping or sinks) goes to transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, heads, length, dim = query.shape
    others = any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "position_bias", "sliding_window"))
    if length != 1 or key.shape[1] == heads or others:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query.view(rows, key.shape[1], heads // key.shape[1], dim),
                                                           key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None  # [rows, 1, heads, dim], as transformers' sdpa returns it


def write_at_column(layer, column: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
    """A reserved layer's update in a captured step: the new key and value written at `column` (a tensor, read when
    the graph replays), and the whole of each buffer returned, its unwritten positions masked by the caller."""
    for room, new in zip(layer.room, (key_states, value_states)):
        room.index_copy_(2, column, new)
    return layer.room[0], layer.room[1]


if __name__ == "__main__":
    import model as models

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    policy, tokenizer = models.load_policy(models.EMBEDDED, device, dtype)
    chat = [{"role": "user", "content": "What is 7 + 5?"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    rows, tokens, width = 32, 32, len(prompt)
    steps = [("eager", EagerDecode), ("CUDA graph" if device == "cuda" else "static, run eagerly",
                                      functools.partial(CudaGraphDecode, capture=device == "cuda"))]
    greedy = []
    for name, step in steps:
        with torch.inference_mode():
            ids, mask = torch.tensor([prompt] * rows, device=device), torch.ones(rows, width + tokens, dtype=torch.long, device=device)
            out = policy(input_ids=ids, use_cache=True)
            cache, token = getattr(out, kv_cache_name()), out.logits[:, -1].argmax(-1)
            if not reserve_cache(cache, tokens):
                raise SystemExit("this model's KV cache has layers other than DynamicLayer: it cannot be reserved")
            decode = step(policy, cache, mask, mask[:, :width].sum(1), width)
            generated = [token, decode(token).argmax(-1)]  # the first step untimed (a GPU's first calls)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(tokens - 2):
                generated.append(decode(generated[-1]).argmax(-1))
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            release_cache(cache)
        greedy.append(torch.stack(generated, 1))
        print(f"{name}: {seconds / (tokens - 2) * 1e3:.1f} ms a decode step ({rows} rows, {dtype}, {device})")
    agree = sum(torch.equal(a, b) for a, b in zip(*greedy))
    print(f"rows whose greedy tokens agree: {agree} of {rows} (row 1: {tokenizer.decode(greedy[0][0])!r})")
