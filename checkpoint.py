"""A checkpoint: what a run saves to continue exactly where it was, and how it takes it back.

    RUN_DIR/checkpoint-STEP/     adapter_model.safetensors + adapter_config.json (PEFT: eval.py loads these),
                                 training_state.pt (optimizer, scheduler, every rank's random generators),
                                 trainer_state.json (step, seconds of training, position in the prompt stream)

A checkpoint is written into a hidden directory and renamed into place only when whole, so a crash,
a kill -9 or a full disk during a save leaves the previous checkpoints as they were. A resumed run
restores the adapter, optimizer, scheduler and random generators. The rest of the run's directory
(config.json, metrics.jsonl) and whether a command continues the run in it: run_dir.py.
"""
from __future__ import annotations

import json
import logging
import math
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import torch

import distributed

log = logging.getLogger("pods")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (e.g. a full disk; the previous ones are untouched) or read (damaged)."""


CHECKPOINT_FILES = ("adapter_model.safetensors", "training_state.pt", "trainer_state.json")
ASIDE = ".tmp-"  # save writes checkpoint-STEP as .tmp-checkpoint-STEP, then renames it whole


def find(out_dir: Path, needs: tuple[str, ...] = CHECKPOINT_FILES, warn: bool = True) -> list[Path]:
    """The complete checkpoint-STEP directories, oldest first: those holding the files `needs` (to resume, all of
    them; eval.py needs the adapter's and the step's). save renames a checkpoint into place only when whole; a
    directory missing one of its files (copied in part, or damaged) is left out, with a warning (`warn`)."""
    found = [p for p in out_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    complete = [p for p in found if all((p / name).is_file() for name in needs)]
    for p in sorted(set(found) - set(complete)) if warn else ():
        log.warning("%s is incomplete (it lacks %s): not used", p, ", ".join(n for n in needs if not (p / n).is_file()))
    return sorted(complete, key=lambda p: int(p.name.split("-")[-1]))


def is_number(value, kind: type | tuple[type, ...]) -> bool:
    """A finite number of `kind`, as JSON files read back (their true and false are no numbers)."""
    return isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)


def random_state(rng: np.random.Generator) -> dict:
    """This process's random generators: torch (sampling on the hf backend), CUDA, the run's numpy
    generator (the random rule), and numpy's and Python's global ones: vLLM draws each request's
    sampling seed from numpy's global generator (Model Runner V2), so without it a resumed run would
    replay the noise of the run's first steps instead of continuing."""
    return {"torch": torch.get_rng_state(), "numpy": rng.bit_generator.state,
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "numpy_global": np.random.get_state(), "python": random.getstate()}


def save(out_dir: Path, model, optimizer, scheduler, state: dict, rng: np.random.Generator,
         world: distributed.World = distributed.World()) -> Path:
    """checkpoint-STEP/: PEFT adapter files, trainer_state.json (step, elapsed_s, data position, skipped_in_a_row)
    and training_state.pt (optimizer, scheduler, every rank's random state). Written aside, then
    renamed. Under torchrun every rank calls it; rank 0 writes (the adapters and optimizers are
    identical across ranks), the others wait until the checkpoint is complete."""
    from safetensors import SafetensorError

    path = out_dir / f"checkpoint-{state['step']}"
    random_states = distributed.gather(random_state(rng), world)
    if world.is_main:
        tmp = out_dir / f"{ASIDE}{path.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            # save_embedding_layers=False: with "auto", peft asks the model hub about a hub model at every save
            distributed.unwrap(model).save_pretrained(tmp, save_embedding_layers=False)
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "random_states": random_states},
                       tmp / "training_state.pt")
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        # a full disk (torch.save says so in a RuntimeError, safetensors in its own): the previous checkpoints are untouched
        except (OSError, RuntimeError, SafetensorError) as err:  # (each is renamed into place only when whole)
            shutil.rmtree(tmp, ignore_errors=True)
            previous = find(out_dir)
            raise CheckpointError(f"could not write {path.name} ({str(err).splitlines()[0][:160]}); the last complete checkpoint is "
                                  f"{previous[-1] if previous else 'none'}: free space, then --resume") from None
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    distributed.barrier(world)
    return path


def remove_cut_short(out_dir: Path) -> None:
    """Remove the checkpoints a kill during `save` left aside (.tmp-checkpoint-STEP): called only by the process that
    holds out_dir (run_dir.held), so none of them is a save in flight."""
    for aside in out_dir.glob(f"{ASIDE}checkpoint-*"):
        if aside.name.removeprefix(f"{ASIDE}checkpoint-").isdigit():
            shutil.rmtree(aside, ignore_errors=True)


def load(path: Path, model, optimizer, scheduler, rng: np.random.Generator,
         world: distributed.World = distributed.World()) -> dict:
    """Restore a checkpoint into this process; under torchrun, each rank takes its own random state."""
    load_adapter(path, model)
    try:  # map_location: tensors saved from rank 0's GPU would otherwise be restored onto GPU 0 by every rank
        saved = torch.load(path / "training_state.pt", map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:  # a file cut short, or another file in its place
        raise unreadable(path, "training_state.pt", err) from None
    try:
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        if "random_states" in saved:
            set_random_state(saved["random_states"][world.rank], rng)
        else:  # written by train.py before torchrun support: one process's states, under other names
            cuda = saved.get("cuda_rng")
            set_random_state({"torch": saved["torch_rng"], "numpy": saved["numpy_rng"], "cuda": cuda[0] if cuda else None}, rng)
    except (KeyError, IndexError, TypeError, ValueError) as err:  # a file that loads, but not train.py's states
        raise unreadable(path, "training_state.pt", ValueError(f"not the states train.py saves: {type(err).__name__} {err}")) from None
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise unreadable(path, "trainer_state.json", err) from None
    check_trainer_state(path, state)
    return state


def check_trainer_state(path: Path, state, keys: tuple[str, ...] = ("step", "elapsed_s", "data_position")) -> None:
    """The one line of `unreadable` unless checkpoint `path`'s trainer_state.json holds `keys` as numbers (--resume needs
    all three; eval.py the step and the time)."""
    kinds = {"step": int, "elapsed_s": (int, float), "data_position": int}
    if not (isinstance(state, dict) and all(is_number(state.get(key), kinds[key]) for key in keys)):
        raise unreadable(path, "trainer_state.json", ValueError(f"not a {', '.join(keys[:-1])} and {keys[-1]} that are numbers"))


def set_random_state(mine: dict, rng: np.random.Generator) -> None:
    """This process's random generators as random_state took them."""
    torch.set_rng_state(mine["torch"])
    if mine["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["cuda"])
    rng.bit_generator.state = mine["numpy"]
    if "numpy_global" in mine:  # checkpoints before these were saved leave them as the engine seeded them
        np.random.set_state(mine["numpy_global"])
        random.setstate(mine["python"])


def load_adapter(path: Path, model) -> None:
    """The checkpoint's LoRA weights into `model` (benchmark.py --resume times a trained policy with them alone)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    check_adapter(path)
    check_adapted_layers(path, distributed.unwrap(model).peft_config["default"].target_modules)
    try:
        loaded = set_peft_model_state_dict(distributed.unwrap(model), load_file(path / "adapter_model.safetensors"))
    except RuntimeError as err:  # "size mismatch for ...lora_A...": another LoRA rank, or another model's adapter
        detail = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err))
        raise unreadable(path, "adapter_model.safetensors", ValueError(f"not this model's adapter: {detail}")) from None
    missing = [key for key in loaded.missing_keys if "lora_" in key]
    if missing or loaded.unexpected_keys:  # strict=False above: a file of other weights loaded nothing, silently
        raise unreadable(path, "adapter_model.safetensors", ValueError(
            f"not this model's adapter: {len(missing)} of its LoRA weights missing, {len(loaded.unexpected_keys)} others there"))


def check_adapted_layers(path: Path, targets) -> None:
    """Stop in one line where checkpoint `path` adapts other layers than `targets` (the model's LoRA, model.lora_targets):
    a run begun before 30 November 2026 on a model whose layers are not Llama's names (Phi-3: its fixed list adapted
    o_proj and down_proj alone), which its checkpoints' weights would not fill."""
    short = lambda names: None if isinstance(names, str) else {name.rsplit(".", 1)[-1] for name in names}
    try:
        saved = short(json.loads((path / "adapter_config.json").read_text()).get("target_modules") or ())
    except (OSError, ValueError, AttributeError):
        return  # (no adapter_config.json, or another kind: its weights are checked as they load)
    ours = short(targets)
    if saved is not None and ours is not None and saved != ours:
        raise CheckpointError(f"{path} adapts {', '.join(sorted(saved))}, and this train.py adapts {', '.join(sorted(ours))} "
                              f"(every linear map of the decoder's blocks, since 30 November 2026): continue the run with the "
                              f"commit that began it, or begin a new one")


def check_adapter(path: Path) -> None:
    """Stop in one line where checkpoint `path`'s adapter cannot be read: its adapter_config.json is no JSON object, or
    safetensors finds the weights' header or the file's length wrong (without reading the weights), or there are no
    weights. (An adapter saved in another format is left to its loader.)"""
    from safetensors import SafetensorError, safe_open

    try:
        if os.path.lexists(path / "adapter_config.json") and not isinstance(json.loads((path / "adapter_config.json").read_text()), dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise unreadable(path, "adapter_config.json", err) from None
    weights = path / "adapter_model.safetensors"
    if not os.path.lexists(weights):
        if not os.path.lexists(path / "adapter_model.bin"):  # (peft's other format)
            raise CheckpointError(f"{path} has no adapter weights ({weights.name}): copy the checkpoint again")
        return
    try:
        with safe_open(weights, "pt"):
            pass
    except (SafetensorError, OSError) as err:
        raise unreadable(path, weights.name, err) from None


def unreadable(path: Path, name: str, err: Exception) -> CheckpointError:
    """The one line for a checkpoint file that cannot be read: cut short by a copy, or another file in its place."""
    return CheckpointError(f"{path / name} cannot be read ({str(err).splitlines()[0][:120]}): copy it again, or delete {path} "
                           f"(eval.py then leaves it out, and --resume continues from the checkpoint before it)")


