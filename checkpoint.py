"""What a run leaves on disk, and how a resumed run takes it back.

    RUN_DIR/config.json          the settings (train.py writes it; --resume refuses others)
    RUN_DIR/metrics.jsonl        one JSON row per step
    RUN_DIR/checkpoint-STEP/     adapter_model.safetensors + adapter_config.json (PEFT: eval.py loads these),
                                 training_state.pt (optimizer, scheduler, every rank's random generators),
                                 trainer_state.json (step, seconds of training, position in the prompt stream)

A checkpoint is written into a hidden directory and renamed into place only when whole, so a crash,
a kill -9 or a full disk during a save leaves the previous checkpoints as they were. A resumed run
restores the adapter, optimizer, scheduler and random generators and drops the metrics rows after
the checkpoint's step: those steps run again, drawing the same prompts and the same random numbers.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch

import distributed

log = logging.getLogger("pods")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (e.g. a full disk); the previous ones are untouched."""


CHECKPOINT_FILES = ("adapter_model.safetensors", "training_state.pt", "trainer_state.json")


def find(out_dir: Path) -> list[Path]:
    """The complete checkpoint-STEP directories, oldest first. save renames a checkpoint into
    place only when whole; a directory missing one of its files (copied in part, or damaged) is left out."""
    found = [p for p in out_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    complete = [p for p in found if all((p / name).is_file() for name in CHECKPOINT_FILES)]
    for p in sorted(set(found) - set(complete)):
        log.warning("%s is incomplete (it lacks %s): not used", p, ", ".join(n for n in CHECKPOINT_FILES if not (p / n).is_file()))
    return sorted(complete, key=lambda p: int(p.name.split("-")[-1]))


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
    """checkpoint-STEP/: PEFT adapter files, trainer_state.json (step, elapsed_s, data position)
    and training_state.pt (optimizer, scheduler, every rank's random state). Written aside, then
    renamed. Under torchrun every rank calls it; rank 0 writes (the adapters and optimizers are
    identical across ranks), the others wait until the checkpoint is complete."""
    path = out_dir / f"checkpoint-{state['step']}"
    random_states = distributed.gather(random_state(rng), world)
    if world.is_main:
        tmp = out_dir / f".tmp-{path.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            # save_embedding_layers=False: with "auto", peft asks the model hub about a hub model at every save
            distributed.unwrap(model).save_pretrained(tmp, save_embedding_layers=False)
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "random_states": random_states},
                       tmp / "training_state.pt")
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        except OSError as err:  # a full disk: the previous checkpoints are untouched (only renamed into place when whole)
            shutil.rmtree(tmp, ignore_errors=True)
            previous = find(out_dir)
            raise CheckpointError(f"could not write {path.name} ({err}); the last complete checkpoint is "
                                  f"{previous[-1] if previous else 'none'}: free space, then --resume") from None
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    distributed.barrier(world)
    return path


def load(path: Path, model, optimizer, scheduler, rng: np.random.Generator,
         world: distributed.World = distributed.World()) -> dict:
    """Restore a checkpoint into this process; under torchrun, each rank takes its own random state."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(distributed.unwrap(model), load_file(path / "adapter_model.safetensors"))
    # map_location: tensors saved from rank 0's GPU would otherwise be restored onto GPU 0 by every rank
    saved = torch.load(path / "training_state.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    if "random_states" in saved:
        mine = saved["random_states"][world.rank]
    else:  # written by train.py before torchrun support: one process's states, under other names
        cuda = saved.get("cuda_rng")
        mine = {"torch": saved["torch_rng"], "numpy": saved["numpy_rng"], "cuda": cuda[0] if cuda else None}
    torch.set_rng_state(mine["torch"])
    if mine["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["cuda"])
    rng.bit_generator.state = mine["numpy"]
    if "numpy_global" in mine:  # checkpoints before these were saved leave them as the engine seeded them
        np.random.set_state(mine["numpy_global"])
        random.setstate(mine["python"])
    return json.loads((path / "trainer_state.json").read_text())


def parse_row(line: str) -> dict | None:
    """One metrics.jsonl row; None for a line cut short by a crash."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl (none if it does not exist), without a last line cut short by a crash."""
    return [r for r in map(parse_row, path.read_text().splitlines()) if r] if path.exists() else []


def drop_rows_after(path: Path, step: int) -> None:
    """On resume: keep the metrics rows up to the checkpoint's step; the steps after it run again."""
    path.write_text("".join(json.dumps(r) + "\n" for r in read_rows(path) if r["step"] <= step))
