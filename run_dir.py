"""A run's directory, and whether a command starts the run in it or continues it (--resume).

    RUN_DIR/config.json          the settings (train.py writes it; --resume refuses others)
    RUN_DIR/metrics.jsonl        one JSON row per step
    RUN_DIR/checkpoint-STEP/     checkpoint.py
    RUN_DIR/.lock                held by the train.py writing there (`held`: one at a time)

`continues` decides whether a run continues or starts, refusing in one line what would overwrite another run's
files; `check_resume_config` refuses settings that would make a resumed run another experiment. A resumed run
drops the metrics rows after its checkpoint's step (`drop_rows_after`): those steps run again, drawing the same
prompts and the same random numbers. Files are replaced whole (`write_atomic`), never left half written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import stat
import uuid
from pathlib import Path

import config
import model as models
from checkpoint import CHECKPOINT_FILES, CheckpointError, find, is_number, remove_cut_short

log = logging.getLogger("pods")


# ----------------------------------------------------------------------------- a run starts, or continues


def found_in(out_dir: Path) -> list[Path]:
    """find's checkpoints of --out-dir, none where it does not exist yet; a path the file system will not look at
    (no permission on a folder above it, a name too long) stops here in one line, before the model loads."""
    try:
        return find(out_dir) if out_dir.exists() else []
    except OSError as err:
        raise config.UsageError(f"--out-dir {out_dir}: cannot look there ({err.strerror}); choose another --out-dir") from None


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


def unexpanded_run(out_dir: Path) -> Path | None:
    """./~/X, where the run of --out-dir=~/X went before "~" was expanded (29 Nov 2026), if it holds one."""
    try:
        old = Path("~") / out_dir.relative_to(Path.home())
    except ValueError:  # not under the home directory
        return None
    return old if (old / "config.json").is_file() else None


def make_out_dir(out_dir: Path) -> None:
    """--out-dir as a directory this process can write into, made before the model loads, so that a wrong
    path costs nothing (a file of that name, a parent that is a file, no permission)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # FileExistsError for a file of that name
        raise config.UsageError(f"--out-dir {out_dir}: cannot make a directory there ({err.strerror}); choose another --out-dir") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise config.UsageError(f"--out-dir {out_dir} is not writable; choose another --out-dir")


LOCK = ".lock"  # in a run's directory: held by the train.py writing there


@contextlib.contextmanager
def held(out_dir: Path, is_main: bool = True, found: list[Path] | None = None):
    """out_dir for this run alone while the block runs: a second train.py on it (a --resume typed while the run still
    trains in another terminal, a job queued twice) stops here in one line, before it writes anything, where the two
    would interleave their checkpoints and metrics rows. The hold is a POSIX lock (lockf) on out_dir/.lock, which the
    system lets go when the process ends, however it ends (kill -9 too): no stale lock is left to delete (a network file
    system's server may keep one of a crashed machine until its lease ends), and processes it starts (vLLM's engine)
    do not inherit it. It is the process's own: a second hold in it is not refused, and closing any descriptor of the
    file in it lets go (nothing else opens .lock). Under torchrun rank 0 holds it for all ranks (`is_main`); a file
    system without locks (some network ones) holds nothing, with a warning. Held, it removes the checkpoints a kill
    left half-saved (checkpoint.remove_cut_short), and refuses where the checkpoints are no longer `found`, those the
    run's decisions were made from (another train.py saved one, stopping, after this one looked and before it held)."""
    if not is_main:
        yield
        return
    try:
        lock = open(out_dir / LOCK, "a+")
    except OSError as err:  # (a directory of that name, a file another user made read-only)
        raise config.UsageError(f"{out_dir / LOCK} cannot be opened ({err.strerror}): move it away, or choose another --out-dir") from None
    with lock:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EAGAIN):  # another process holds it
                lock.seek(0)
                raise config.UsageError(f"--out-dir {out_dir} is in use by another train.py (process {lock.read().strip() or '?'}): "
                                        f"let it finish, or stop it (Ctrl-C saves a checkpoint) and --resume; or choose another --out-dir") from None
            log.warning("--out-dir %s cannot be locked (%s): nothing stops a second train.py from writing there", out_dir, err.strerror)
        else:  # held: no other train.py writes here now, so a save a kill cut short can go
            remove_cut_short(out_dir)
            if found is not None and find(out_dir, warn=False) != found:  # (its incomplete ones were named as it looked)
                raise config.UsageError(f"--out-dir {out_dir} changed as this train.py started (another one saved a checkpoint "
                                        f"there as it stopped): run the command again")
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")  # named in the line above
        lock.flush()
        yield


# ----------------------------------------------------------------------------- its files: metrics.jsonl, config.json


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
    """On resume: keep the metrics rows up to the checkpoint's step; the steps after it run again. Where there are none
    of those steps (the file deleted, emptied, or not copied with the checkpoints), a warning says so."""
    kept = [r for r in read_rows(path) if r["step"] <= step]
    if step and not kept:
        log.warning("%s holds no row of the %d steps this run continues from (deleted, or not copied with the checkpoints): "
                    "its rows begin at step %d", path, step, step + 1)
    write_atomic(path, "".join(map(metrics_line, kept)))


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
    changed = {k: [old[k], settings[k]] for k in RETUNABLE if k in old and not unchanged(k, old[k], settings[k])}
    if changed:
        history.append({"step": resumed_step, **changed})
    write_atomic(path, json.dumps(settings | ({"changed_on_resume": history} if history else {}), indent=2))


def settings_at(saved: dict, step: int) -> dict:
    """A run's config.json as it stood when `step` had trained: the changes made on resuming at `step` or later (whose
    steps a resume from `step` runs again) undone, from the last back."""
    saved, history = dict(saved), list(saved.get("changed_on_resume", []))
    while history and history[-1]["step"] >= step:
        saved |= {k: change[0] for k, change in history.pop().items() if k != "step"}
    return {k: v for k, v in saved.items() if k != "changed_on_resume"} | ({"changed_on_resume": history} if history else {})


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
             "tis_cap", "backend")  # --resume may change these (a warning says so): the same adapter and data, another objective or sampling


def unchanged(name: str, old, new) -> bool:
    """Whether setting `name`, recorded in config.json as `old`, is `new`: equal; a path flag naming the same file
    ("./d.jsonl" and "/home/me/d.jsonl"); or --backend recorded as "auto", as it was before 1 December 2026 (a resume
    on that machine resolves it alike)."""
    if name in config.PATH_FLAGS and isinstance(old, str) and isinstance(new, str):
        return same_path(old, new)
    return old == new or (name == "backend" and old == "auto")


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
        return [k for k in names if k in saved and not unchanged(k, saved_value(k), getattr(args, k))]

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
