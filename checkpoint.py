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

--resume continues the same experiment: `continues` decides whether a run continues or starts, and
`check_resume_config` refuses settings that would make it another experiment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import pickle
import random
import shutil
import stat
import uuid
from pathlib import Path

import numpy as np
import torch

import config
import distributed
import model as models

log = logging.getLogger("pods")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (e.g. a full disk; the previous ones are untouched) or read (damaged)."""


CHECKPOINT_FILES = ("adapter_model.safetensors", "training_state.pt", "trainer_state.json")


def find(out_dir: Path, needs: tuple[str, ...] = CHECKPOINT_FILES) -> list[Path]:
    """The complete checkpoint-STEP directories, oldest first: those holding the files `needs` (to resume, all of
    them; eval.py needs the adapter's and the step's). save renames a checkpoint into place only when whole; a
    directory missing one of its files (copied in part, or damaged) is left out."""
    found = [p for p in out_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    complete = [p for p in found if all((p / name).is_file() for name in needs)]
    for p in sorted(set(found) - set(complete)):
        log.warning("%s is incomplete (it lacks %s): not used", p, ", ".join(n for n in needs if not (p / n).is_file()))
    return sorted(complete, key=lambda p: int(p.name.split("-")[-1]))


def is_number(value, kind: type | tuple[type, ...]) -> bool:
    """A finite number of `kind`, as JSON files read back (their true and false are no numbers)."""
    return isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)


def found_in(out_dir: Path) -> list[Path]:
    """find's checkpoints of --out-dir, none where it does not exist yet; a path the file system will not look at
    (no permission on a folder above it, a name too long) stops here in one line, before the model loads."""
    try:
        return find(out_dir) if out_dir.exists() else []
    except OSError as err:
        raise config.UsageError(f"--out-dir {out_dir}: cannot look there ({err.strerror}); choose another --out-dir") from None


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
        tmp = out_dir / f".tmp-{path.name}"
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


def metrics_line(row: dict) -> str:
    """One metrics.jsonl line. A value that is not finite (a skipped update's loss) is written as null: JSON has no
    NaN or Infinity, and jq, JavaScript and pandas' strict readers stop at Python's `NaN`."""
    finite = {key: None if isinstance(value, float) and not math.isfinite(value) else value for key, value in row.items()}
    return json.dumps(finite, allow_nan=False) + "\n"


def parse_row(line: str) -> dict | None:
    """One metrics.jsonl row; None for a line cut short by a crash."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl (none if it does not exist). A last line cut short by a crash is left out; any
    other line that is not a row (a write that failed part-way, an edit) is left out with a warning naming it."""
    if not path.exists():
        return []
    try:
        lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as err:  # a directory in its place, a damaged copy
        raise CheckpointError(f"{path} cannot be read ({str(err).splitlines()[0][:120]}): copy it again, or move it away") from None
    rows, bad = [], []
    for number, line in lines:
        row = parse_row(line)
        if isinstance(row, dict) and is_number(row.get("step"), int) and is_number(row.get("elapsed_s"), (int, float)):
            rows.append(row)
        elif row is not None or number != lines[-1][0]:  # (not the last line cut short by a crash)
            bad.append(number)
    if bad:
        log.warning("%s: left out %d line(s) that are not metrics rows (JSON with step and elapsed_s), first at line %d",
                    path, len(bad), bad[0])
    return rows


def drop_rows_after(path: Path, step: int) -> None:
    """On resume: keep the metrics rows up to the checkpoint's step; the steps after it run again."""
    write_atomic(path, "".join(metrics_line(r) for r in read_rows(path) if r["step"] <= step))


def write_atomic(path: Path, text: str) -> None:
    """Replace `path`'s contents with `text` whole: written aside, then renamed, so that a kill or a full disk
    during the write leaves the old file (the run's metrics, its config, eval.py's results), never half of each.
    The file aside is this process's own (two eval.py processes may write one base-model result), and takes the
    replaced file's permissions; a symbolic link is followed."""
    path = Path(os.path.realpath(path))
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(text, newline="")  # as given: no line-ending translation
        if path.exists():
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    except OSError as err:  # a full disk, a read-only directory: the old file is whole
        raise CheckpointError(f"could not write {path} ({err.strerror or err}); free space or make it writable, then run again") from None
    finally:
        with contextlib.suppress(OSError):  # (the directory may be what failed)
            tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- --resume


RESUME_MUST_MATCH = ("model", "dataset", "n", "m", "rule", "uniform_groups", "lora_rank", "lora_alpha", "prompts_per_step", "max_prompt_tokens",
                     "seed")
OPTIMIZER_SETTINGS = ("lr", "adam_beta1", "adam_beta2", "weight_decay")  # saved in the optimizer's state; --resume takes the command's
RETUNABLE = (*OPTIMIZER_SETTINGS, "max_grad_norm", "warmup_ratio", "temperature", "max_new_tokens", "beta", "clip_eps", "clip_eps_high",
             "tis_cap")  # --resume may change these (a warning says so): the same adapter and data, another objective or sampling


def check_resume_config(out_dir: Path, args, world_size: int = 1, resumed_from: Path | None = None,
                        model_name: str | None = None) -> list[str]:
    """--resume continues the same experiment: settings that shape the adapter or the data must not
    change, nor the number of processes. (The prompt order would survive another number: every rank
    draws the same global stream and takes its share. But each rank's random state is saved for its
    rank, and a rank that did not exist has none, so the run would not continue as it started.)
    A change of precision (PRECISION_FLAGS, e.g. a run moved to a CPU without bfloat16 arithmetic,
    whose defaults are float32) or of a RETUNABLE setting (e.g. a lower --lr after non-finite updates:
    take_optimizer_settings) is allowed, with a warning; compared with the settings at `resumed_from` (settings_at).
    The model is compared as `model_name`, the one --model resolves to (check_resumed_model).
    Returns those warnings, for the caller to print if the run trains on (a run at its --steps keeps its settings)."""
    path = out_dir / "config.json"
    if not path.exists():  # a checkpoint copied without it: nothing to check a changed --n or --lora-rank against
        raise config.UsageError(f"--resume: {out_dir} holds checkpoints but no config.json, the run's settings a resume must "
                                f"match; copy it from the run too")
    saved = {"uniform_groups": "keep"} | json.loads(path.read_text())  # a run from before --uniform-groups kept them
    if resumed_from is not None:  # the settings as they were at the checkpoint it continues from
        saved = settings_at(saved, int(resumed_from.name.split("-")[-1]))

    must_match = RESUME_MUST_MATCH
    if model_name is not None and "model_resolved" in saved:  # the model as resolved, not --model as typed
        check_resumed_model(out_dir, saved["model_resolved"], model_name)
        must_match = tuple(k for k in must_match if k != "model")

    def differing(names: tuple[str, ...]) -> list[str]:  # those of `names` the run saved with another value
        return [k for k in names if k in saved and not same_value(k)]

    def same_value(name: str) -> bool:  # a path flag naming the same file ("./d.jsonl" and "/home/me/d.jsonl") is the same
        old, new = saved_value(name), getattr(args, name)
        return old == new or (name in config.PATH_FLAGS and isinstance(old, str) and isinstance(new, str) and same_path(old, new))

    def saved_value(name: str):  # a path as the command line now reads it: "~/d.jsonl" was saved unexpanded before 29 Nov 2026
        return os.path.expanduser(saved[name]) if name in config.PATH_FLAGS and isinstance(saved[name], str) else saved[name]

    def change(name: str) -> str:
        return f"--{name.replace('_', '-')} {saved[name]} -> {getattr(args, name)}"

    changed = [change(k) for k in differing(must_match)]
    if changed:
        raise config.UsageError(f"--resume with other settings than {path} ({', '.join(changed)}); pass the run's own values or choose another --out-dir")
    warnings = []
    switched = differing(config.PRECISION_FLAGS)
    if switched:  # allowed (the same experiment), but not silently: e.g. a run moved to a CPU without bfloat16
        was = " ".join(config.flag_text(k, saved[k]) for k in switched)
        now = " ".join(config.flag_text(k, getattr(args, k)) for k in switched)
        warnings.append(f"--resume: {out_dir} trained with {was} and continues with {now} (this device's defaults or your flags): "
                        f"the steps from here compute in another precision; pass {was} to keep the run's own")
    retuned = [change(k) for k in differing(RETUNABLE) if k not in ("clip_eps", "clip_eps_high")]  # no effect: refused (config.py)
    if retuned:  # allowed (e.g. a lower --lr after non-finite updates), but not silently: a flag left out takes the default
        warnings.append(f"--resume: {out_dir} continues with other settings ({', '.join(retuned)}); pass the run's own to keep "
                        f"them (config.json keeps the old ones under changed_on_resume)")
    trained_with = saved.get("world_size", 1)
    if trained_with != world_size:
        raise config.UsageError(f"--resume with {world_size} process(es), but {out_dir} was trained with {trained_with}: "
                         f"each rank's random state is saved per rank; launch {trained_with} (torchrun --nproc_per_node) to continue it")
    return warnings


RUN_LENGTH = ("steps", "time_budget")  # --resume takes the run's own where they are not given


def run_length(args, out_dir: Path, resumed_from: Path):
    """`args` with --steps and --time-budget, where not given, as the run had them at checkpoint `resumed_from`: a
    run of --steps 4, resumed with `--resume --out-dir` alone, took the profile's 100 and trained on without a word."""
    try:
        saved = settings_at(json.loads((out_dir / "config.json").read_text()), int(resumed_from.name.split("-")[-1]))
        kept = {k: saved[k] for k in RUN_LENGTH if getattr(args, k) is None and is_number(saved.get(k), (int, float))}
    except (OSError, ValueError, AttributeError, TypeError):  # (no config.json or a damaged one: check_resume_config says so)
        return args
    return dataclasses.replace(args, **kept)


def settings_at(saved: dict, step: int) -> dict:
    """A run's config.json as it stood when `step` had trained: the changes made on resuming at `step` or later (whose
    steps a resume from `step` runs again) undone, from the last back."""
    saved, history = dict(saved), list(saved.get("changed_on_resume", []))
    while history and history[-1]["step"] >= step:
        saved |= {k: change[0] for k, change in history.pop().items() if k != "step"}
    return {k: v for k, v in saved.items() if k != "changed_on_resume"} | ({"changed_on_resume": history} if history else {})


def write_config(out_dir: Path, settings: dict, resumed_step: int | None = None) -> None:
    """The run's config.json: `settings`, and for a run resumed at `resumed_step` the history of the RETUNABLE settings
    it changed, a list under changed_on_resume of {"step": resumed_step, setting: [old, new], ...}, so that the run's
    record keeps the settings its early steps trained with (eval.py and --plot read the latest). A resumed run keeps
    its model's names as it recorded them ("./m" resumed as "/home/me/m", which check_resumed_model found the same, or
    "auto" as "embedded"): eval.py's results and --plot compare them as written."""
    path = out_dir / "config.json"
    old = settings_at(json.loads(path.read_text()), resumed_step) if path.exists() and resumed_step is not None else {}
    kept = ("dataset",) + (() if model_moved(old.get("model_resolved", ""), settings["model_resolved"]) else ("model", "model_resolved"))
    settings = settings | {k: old[k] for k in kept if k in old}
    history = old.pop("changed_on_resume", [])
    changed = {k: [old[k], settings[k]] for k in RETUNABLE if k in old and old[k] != settings[k]}
    if changed:
        history.append({"step": resumed_step, **changed})
    write_atomic(path, json.dumps(settings | ({"changed_on_resume": history} if history else {}), indent=2))


def check_nothing_else_is_replaced(out_dir: Path, resuming: bool) -> None:
    """Refuses in one line, before anything loads or is deleted (`continues` calls it first), what a run would
    overwrite in out_dir that is not its own: a config.json that train.py did not write (a model directory's), or,
    for a run that starts, a checkpoint-STEP directory (another trainer's, or a run copied in part), which the save
    at that step would delete. (A resumed run replaces an incomplete checkpoint after the one it continues from: its
    own, damaged; `find` warns of it.)"""
    if any((out_dir / name).exists() for name in CHECKPOINT_FILES):  # a run inside it would train afresh, nested in it
        run = f": {out_dir.parent}" if (out_dir.parent / "config.json").exists() else ""
        raise config.UsageError(f"--out-dir {out_dir} is a checkpoint, not a run's directory; pass the run's directory "
                                f"instead (the one holding config.json and checkpoint-STEP/){run}")
    path = out_dir / "config.json"
    if path.exists():
        try:
            saved = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:  # (json's JSONDecodeError is a ValueError)
            raise CheckpointError(f"{path} cannot be read ({str(err).splitlines()[0][:120]}): it holds the run's settings; "
                                  f"copy the run again, or choose another --out-dir") from None
        if not isinstance(saved, dict) or "model_resolved" not in saved:
            raise config.UsageError(f"{path} was not written by train.py (a model's?), and a run would replace it; choose another --out-dir")
    others = sorted(p.name for p in out_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit())
    if others and not resuming:
        raise config.UsageError(f"{out_dir} holds {', '.join(others)}, incomplete (another trainer's, or a run copied in part), which "
                                f"this run would replace: move it away, or choose another --out-dir")


def make_out_dir(out_dir: Path) -> None:
    """--out-dir as a directory this process can write into, made before the model loads, so that a wrong
    path costs nothing (a file of that name, a parent that is a file, no permission)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # FileExistsError for a file of that name
        raise config.UsageError(f"--out-dir {out_dir}: cannot make a directory there ({err.strerror}); choose another --out-dir") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise config.UsageError(f"--out-dir {out_dir} is not writable; choose another --out-dir")


def check_resumed_model(out_dir: Path, trained: str, model_name: str) -> None:
    """--resume loads `model_name`, the model --model resolves to, and the run `out_dir` trained `trained` (its adapter
    fits only that one). Compared as resolved: "auto" and "embedded" are one model on a CPU, "./m" and "/home/me/m" one
    directory (--model was compared as typed: a run begun with "auto" was told to pass the model's name, then refused)."""
    if model_moved(trained, model_name):  # the run's local directory is gone (moved, or the run copied to another machine)
        log.warning("--resume: %s trained %s, which is not here any more; continuing with %s as that model (config.json will "
                    "name it)", out_dir, trained, model_name)
        return
    if models.missing_path(trained):  # (and --model names no directory: "pass --model {trained}" named the one gone)
        raise config.UsageError(f"--resume: {out_dir} trained {trained}, which is not there any more: pass --model with where it is now")
    if not same_path(trained, model_name):
        raise config.UsageError(f"--resume: {out_dir} trained {trained}, but this command loads {model_name}; pass --model {trained}")


def same_path(a: str, b: str) -> bool:
    """Whether two names are one: equal, or two paths to the same file or directory ("./m" and "/home/me/m")."""
    return a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


def model_moved(trained: str, model_name: str) -> bool:
    """Whether the run's model was a local directory that no longer exists, and this command names a local directory."""
    return models.missing_path(trained) and os.path.isdir(model_name)  # ("runs/models/qwen" too: a path, as train.py reads --model)


def take_optimizer_settings(optimizer, scheduler, args) -> None:
    """After --resume: the optimizer takes this command's --lr, --adam-beta1/2 and --weight-decay, as every
    setting outside RESUME_MUST_MATCH follows the command line. (A restored optimizer and scheduler would
    keep the first run's, whatever the command said.) The warm-up factor of the step reached applies to the
    new --lr; check_resume_config has warned if the settings changed."""
    scheduler.base_lrs = [args.lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(lr=args.lr * factor(scheduler.last_epoch), initial_lr=args.lr,
                     betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)


def unexpanded_run(out_dir: Path) -> Path | None:
    """./~/X, where the run of --out-dir=~/X went before "~" was expanded (29 Nov 2026), if it holds one."""
    try:
        old = Path("~") / out_dir.relative_to(Path.home())
    except ValueError:  # not under the home directory
        return None
    return old if (old / "config.json").is_file() else None


def continues(resume: str, out_dir: Path, found: list[Path]) -> bool:
    """Whether this run continues the one in out_dir (--resume yes | auto | no), or refuses in one line.
    `auto` is start-or-continue: a launcher that restarts failed workers re-runs the same command, so
    the same flags must start the run the first time and continue it after a fault. A directory with
    metrics but no checkpoint (a run that died before its first save) is started afresh under auto."""
    has_metrics = (out_dir / "metrics.jsonl").exists()
    if out_dir.is_dir():  # a run continues exactly when it found checkpoints (else it starts, or is refused below)
        check_nothing_else_is_replaced(out_dir, resuming=bool(found))
    if not found and resume != "no" and (unexpanded := unexpanded_run(out_dir)):
        raise config.UsageError(f"--resume: no checkpoint in {out_dir}, but ./{unexpanded} holds a run: before 29 Nov 2026 "
                                f"--out-dir=~/... wrote there; pass --out-dir ./{unexpanded} to continue it")
    if resume == "auto":
        if not found and (out_dir / "metrics.jsonl").is_dir():
            raise CheckpointError(f"{out_dir / 'metrics.jsonl'} is a directory, not the run's metrics: move it, or choose another --out-dir")
        if not found and has_metrics:  # (train.py empties its metrics.jsonl once the command has passed every check)
            log.info("--resume auto: %s has no checkpoint yet; starting afresh", out_dir)
        return bool(found)
    if resume == "yes" and not found:
        if out_dir.exists() and not out_dir.is_dir():
            raise config.UsageError(f"--resume: --out-dir {out_dir} is a file, not a run's directory")
        raise config.UsageError(f"--resume: no checkpoint-STEP directory in {out_dir} (--resume auto starts a run when there is none)")
    if resume == "no" and found:
        raise config.UsageError(f"{out_dir} already holds a run; pass --resume to continue it or choose another --out-dir")
    if resume == "no" and has_metrics:  # a run that stopped before its first checkpoint: --resume would find none
        raise config.UsageError(f"{out_dir} holds a run that saved no checkpoint; pass --resume auto to start it again, "
                                f"or choose another --out-dir")
    return resume == "yes"
