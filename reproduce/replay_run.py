"""Rebuild a recorded run's checkpoints from its config.json and metrics.jsonl, for evaluation elsewhere.

A reproduction keeps each run's config.json and metrics.jsonl in git (reproduce/cpu-plateau/RUN/) but not
its checkpoints (runs/ is not in git). When a run was trained in one session and the machine holding its
checkpoints is gone before they were evaluated, they can be made again: on the CPU train.py is
deterministic for a seed (the same prompts, the same random numbers, the same kernels), so training the
same settings again for the same number of steps gives the same adapters. This script does that and
proves it, step by step:

- every metrics row of the replay must equal the record's (rewards, accuracy, completion lengths,
  loss, gradient norm, ...: every field but the step's seconds); at the first difference it stops
  with an error, since the adapters after that step are not the recorded run's;
- a checkpoint is written where train.py's rule puts one on the record's clock (once
  `save_every_minutes` of training have passed since the last, and at the last step), carrying the
  record's training clock (`elapsed_s`), so eval.py places each checkpoint at the recorded run's
  minute, not the replay's. These are the recorded run's own checkpoint steps unless it was stopped
  and resumed: the stop wrote an extra checkpoint, which the metrics do not show, and its later ones
  fell a minute from that (2 of the 47 evaluated runs in reproduce/). The replay's are then one a minute
  from the start: other minutes of the same run;
- when every step has matched, the recorded config.json and metrics.jsonl replace the replay's in
  OUT_DIR, so OUT_DIR is the recorded run with its checkpoints back.

The replay's own speed plays no part (it may run beside other work), but its machine must compute as the
recorded one did: a machine with other kernels gives other numbers from the first step, and the replay
stops there. (Seeds 0-3 of reproduce/cpu-plateau do not replay on the machine seeds 4-8 trained on: that is
how the two machines were told apart.)

    python reproduce/replay_run.py reproduce/cpu-plateau/grpo-n8-s8 runs/cpu-plateau/grpo-n8-s8   # in the project root
    python eval.py runs/cpu-plateau/grpo-n8-s8 --dataset arith:2 --limit 256 --repeats 1
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

TIMING_FIELDS = ("elapsed_s", "generation_s", "update_s")  # the only fields a replay may change
ADDED_FIELDS = ("uniform_share", "generation_rounds", "prompts_drawn", "informative_rows")  # since --uniform-groups: older records lack them
NOT_ARGS = ("out_dir", "resume", "steps", "time_budget", "save_every_steps", "save_every_minutes")  # set by the replay


class ReplayError(RuntimeError):
    """The replay is not the recorded run (a different step, settings or library), or cannot start."""


def checkpoint_steps(rows: list[dict], save_every_minutes: float, save_every_steps: int = 0) -> dict[int, float]:
    """{step: elapsed_s} of the checkpoints train.py writes on this clock: a save once
    `save_every_minutes` of training have passed since the last one, or every `save_every_steps` steps,
    and at the last step. A run stopped by Ctrl-C and resumed also saved at the stop, which its rows
    do not show, and counted its later minutes from there."""
    steps, last_save_s = {}, 0.0
    for row in rows:
        due_steps = save_every_steps and row["step"] % save_every_steps == 0
        due_time = save_every_minutes and row["elapsed_s"] - last_save_s >= save_every_minutes * 60
        if due_steps or due_time:
            steps[row["step"]] = row["elapsed_s"]
            last_save_s = row["elapsed_s"]
    if rows:
        steps[rows[-1]["step"]] = rows[-1]["elapsed_s"]
    return steps


def replay_argv(config: dict, fields: list[dataclasses.Field], out_dir: Path, last_step: int) -> list[str]:
    """train.py's command line for the recorded settings, training `last_step` steps with no clock
    limit and a checkpoint offered after every step (`replay` keeps the recorded ones)."""
    argv = []
    for f in fields:
        if f.name in NOT_ARGS or f.name not in config or config[f.name] is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        value = config[f.name]
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv + ["--out-dir", str(out_dir), "--steps", str(last_step), "--time-budget", "0",
                   "--save-every-minutes", "0", "--save-every-steps", "1"]


def differences(replayed: dict, recorded: dict) -> list[str]:
    """The fields (but the timings, and fields a record made before they were logged lacks) in which a
    replayed metrics row differs from the recorded one."""
    keys = (set(replayed) | set(recorded)) - set(TIMING_FIELDS) - (set(ADDED_FIELDS) - set(recorded))
    return [f"{k}: {replayed.get(k)!r} here, {recorded.get(k)!r} recorded" for k in sorted(keys) if replayed.get(k) != recorded.get(k)]


def replay(kept: Path, out_dir: Path) -> Path:
    """Train the run recorded in `kept` again into `out_dir`, checking every step against the record
    and writing its checkpoints with the record's clock; see the module docstring."""
    import checkpoint
    import progress
    import run_dir
    import train
    from config import parse_args

    config_path, metrics_path = kept / "config.json", kept / "metrics.jsonl"
    if not config_path.is_file() or not metrics_path.is_file():
        raise ReplayError(f"{kept} has no config.json and metrics.jsonl: give a recorded run's directory")
    try:
        config, rows = json.loads(config_path.read_text()), run_dir.read_rows(metrics_path)
    except checkpoint.CheckpointError as err:  # its metrics.jsonl cannot be read
        raise ReplayError(str(err)) from None
    if not rows or [r["step"] for r in rows] != list(range(1, len(rows) + 1)):
        raise ReplayError(f"{metrics_path} does not hold steps 1..N: it cannot be replayed")
    if config.get("world_size", 1) != 1 or config.get("device") != "cpu":
        raise ReplayError(f"{kept} ran on {config.get('world_size')} {config.get('device')} process(es): only a one-process CPU run replays bit for bit")
    import torch

    if config.get("torch") != torch.__version__:
        raise ReplayError(f"{kept} ran with torch {config.get('torch')}, this is {torch.__version__}: install that version to replay it")
    wanted = checkpoint_steps(rows, config["save_every_minutes"], config["save_every_steps"])
    recorded = {r["step"]: r for r in rows}
    if out_dir.exists() and any(p.name != run_dir.LOCK for p in out_dir.iterdir()):  # (a replay that stopped before its first step)
        raise ReplayError(f"{out_dir} is not empty: remove it first (a replay starts from step 0)")

    save = checkpoint.save

    def save_recorded_ones(out, model, optimizer, scheduler, state, rng, *world):
        if state["step"] not in wanted:
            return out / f"checkpoint-{state['step']}"  # the recorded run wrote none here
        return save(out, model, optimizer, scheduler, dict(state, elapsed_s=wanted[state["step"]]), rng, *world)

    write_row = progress.write_row

    def write_row_if_recorded(metrics_file, row: dict) -> None:
        write_row(metrics_file, row)
        wrong = differences(row, recorded[row["step"]])
        if wrong:
            raise ReplayError(f"step {row['step']} differs from {metrics_path} ({'; '.join(wrong[:3])}): this machine or "
                              f"library does not reproduce the run bit for bit, so its checkpoints cannot be rebuilt here")

    checkpoint.save, progress.write_row = save_recorded_ones, write_row_if_recorded
    try:
        args = parse_args(train.Args, replay_argv(config, dataclasses.fields(train.Args), out_dir, len(rows)))
        train.train(args)
    finally:
        checkpoint.save, progress.write_row = save, write_row
    missing = sorted(set(wanted) - {int(p.name.split("-")[-1]) for p in checkpoint.find(out_dir)})
    if missing:
        raise ReplayError(f"the replay ended without checkpoints {missing}")
    shutil.copyfile(config_path, out_dir / "config.json")
    shutil.copyfile(metrics_path, out_dir / "metrics.jsonl")
    return out_dir


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python reproduce/replay_run.py RECORDED_RUN_DIR OUT_DIR   (in the project root)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        out = replay(Path(argv[0]), Path(argv[1]))
    except ReplayError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"replayed {argv[0]} into {out}: every step matched the record; checkpoints at the recorded steps and minutes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
