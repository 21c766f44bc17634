"""What a run shows and how it stops: its start line, the progress bar, the metrics rows, the
Ctrl-C/SIGTERM handler and the one line that ends a failed run. Display code never ends a run: a failure
here is logged and training goes on.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

import checkpoint
import config
import data
import distributed
import model
import run_dir
import vllm_sampler

log = logging.getLogger("pods")


def start_line(args, model_name: str, sampler, out_dir: Path, device: str, world: distributed.World = distributed.World()) -> str:
    """What a run is, in one log line: model, task, generation backend, processes, under --time-budget the two limits
    (--steps still ends a run first where its steps are fast: the bar, in minutes, then stops short), where it is written."""
    if isinstance(sampler, vllm_sampler.VLLMSampler):
        backend = "vLLM"
    else:
        how = ([f"a {str(sampler.merged_dtype).removeprefix('torch.')} copy, LoRA merged"] if getattr(sampler, "merged", False)
               else ["bfloat16 autocast"] if args.bf16_autocast else [])
        if config.merged_dtype(args) == torch.float32 and device == "cpu" and not model.computes_bfloat16(device):
            how.append(model.FLOAT32_CPU)  # (not when --bf16-autocast forces bfloat16 there)
        backend = "transformers" + (f" ({'; '.join(how)})" if how else "")
    name = "the embedded SmolLM2-135M-Instruct" if model_name == model.EMBEDDED else model_name
    auto = ""
    if device == "cpu" and args.model == "auto":  # what the CPU's profile chose for the user
        auto = ("; no GPU, so the embedded model and the built-in task (--model / --dataset choose others)" if args.dataset == data.ARITH
                else "; no GPU, so the embedded model (--model chooses another)")
    units = ("GPU", "GPUs") if device == "cuda" else ("process", "processes")
    ranks = f" on {world.size} {units[world.size > 1]} (DDP)" if world.launched else ""
    until = f" until --steps {args.steps} or {args.time_budget:g} min of training, whichever is first" if args.time_budget else ""
    return f"training {name} on {args.dataset} with {backend} generation{ranks}{until}, writing {out_dir}{auto}"


def progress_bar(args, state: dict, world: distributed.World = distributed.World()):
    """A tqdm bar over training minutes under --time-budget (the limit that ends such a run), else
    over steps; rank 0's only. Where stderr is a file (nohup, a scheduler's log), whose reader would find the bar's
    updates glued into one line by carriage returns, the bar is off and show_progress logs a line per step."""
    from tqdm import tqdm

    desc, shown = f"{args.rule} n={args.n} m={args.m}", world.is_main and on_a_terminal()
    if args.time_budget:  # a resumed run may already be past its budget: the total is never below the count
        bar = tqdm(total=max(args.time_budget, bar_position(args, state)), initial=bar_position(args, state), desc=desc, dynamic_ncols=True,
                   bar_format="{l_bar}{bar}| {n:.1f}/{total:g} min [{elapsed}{postfix}]", disable=not shown)
    else:
        bar = tqdm(total=args.steps, initial=bar_position(args, state), desc=desc, unit="step", dynamic_ncols=True, disable=not shown)
    bar.log_steps = world.is_main and not shown
    return bar


def on_a_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr (None), a closed one, or a stand-in without isatty
        return False


def bar_position(args, state: dict) -> float:
    return round(state["elapsed_s"] / 60, 3) if args.time_budget else state["step"]


def budget_spent(args, state: dict) -> bool:
    """Whether --time-budget (minutes; 0: none) is used up by the training time so far."""
    return bool(args.time_budget) and state["elapsed_s"] >= args.time_budget * 60


def nothing_left(args, state: dict) -> bool:
    """Whether the run is already at --steps or past --time-budget: resumed so, it trains nothing and keeps its
    config.json (whose sampling settings eval.py evaluates its checkpoints with)."""
    return state["step"] >= args.steps or budget_spent(args, state)


def say_resumed(args, state: dict, out_dir: Path, changes: list[str]) -> None:
    """After a checkpoint is loaded: that the run is at its --steps or past its --time-budget, or else the settings it
    trains on with that differ from the run's (run_dir.check_resume_config's warnings)."""
    if nothing_left(args, state):
        if budget_spent(args, state):
            reached = f"past --time-budget {args.time_budget:g}"
        else:
            reached = f"{'at' if state['step'] == args.steps else 'past'} --steps {args.steps}"
        log.info("%s is %s (step %d, %.1f min of training): nothing to train; a larger one continues it", out_dir, reached,
                 state["step"], state["elapsed_s"] / 60)
        return
    for change in changes:
        log.warning("%s", change)


def count_skipped(update: dict, skipped_in_a_row: int, step: int) -> int:
    """Updates skipped in a row for a non-finite loss or gradient norm (policy_update), logged."""
    if not update["skipped"]:
        return 0
    log.warning("step %d: non-finite loss (%s) or gradient norm (%s): update skipped, weights unchanged",
                step, update["loss"], update["grad_norm"])
    return skipped_in_a_row + 1


def show_progress(bar, args, state: dict, row: dict) -> None:
    """Move the bar to the step just finished. The last step of a time-budgeted run ends past the
    budget: the bar's total grows to the count (tqdm would otherwise drop its total once the count
    passes it by half a unit, and the minutes format would fail on it). Display code must never end
    a run, so anything else that fails here is logged and training goes on."""
    try:
        if bar.log_steps:
            log.info("%s", step_line(args, state, row))
            return
        position = bar_position(args, state)
        if bar.total is not None and position > bar.total:
            bar.total = position
        bar.update(position - bar.n)
        bar.set_postfix(step=state["step"], reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.3f}")
    except Exception as err:  # noqa: BLE001 - a display failure must not cost the checkpoint
        log.warning("progress bar failed (%s: %s); training goes on", type(err).__name__, err)


def step_line(args, state: dict, row: dict) -> str:
    """The bar's content as a log line: `step 7/100, 3.2 min: reward 0.412, accuracy 0.375 (generation 21.0 s, update 6.5 s)`."""
    minutes = f"{state['elapsed_s'] / 60:.1f}{f'/{args.time_budget:g}' if args.time_budget else ''} min"
    return (f"step {state['step']}/{args.steps}, {minutes}: reward {row['reward_mean']:.3f}, accuracy {row['accuracy']:.3f} "
            f"(generation {row['generation_s']:.1f} s, update {row['update_s']:.1f} s)")


def close_bar(bar) -> None:
    """Close the bar; a failure (its terminal or pipe gone: `| tee` dies of the same Ctrl-C) is logged, not raised."""
    try:
        bar.close()
    except Exception as err:  # noqa: BLE001 - a display failure must not change how the run ends
        log.warning("progress bar failed (%s: %s)", type(err).__name__, err)


def step_metrics(rounds, n, m) -> dict:
    """A step's rewards, accuracy and completions over the generation rounds given (train.Round: .scored, .kept): over all their
    rollouts (n per prompt), and `kept_*` over the kept ones (m per prompt)."""
    rewards, correct, formatted = (torch.cat([getattr(r.scored, k) for r in rounds]) for k in ("rewards", "correct", "formatted"))
    kept_rewards = torch.cat([r.scored.rewards[r.kept] for r in rounds]).view(-1, m)
    rollouts = [rollout for r in rounds for rollout in r.scored.rollouts]
    return {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.view(-1, n).std(dim=1).mean().item(),  # mean within-group std, all n
        "kept_reward_mean": kept_rewards.mean().item(),
        "kept_reward_std": kept_rewards.std(dim=1).mean().item(),  # what max_variance maximizes
        "accuracy": correct.mean().item(),
        "kept_accuracy": torch.cat([r.scored.correct[r.kept] for r in rounds]).mean().item(),
        "format_rate": formatted.mean().item(),
        "completion_len": float(np.mean([len(r.completion_ids) for r in rollouts])),
        "truncated_frac": float(np.mean([r.truncated for r in rollouts])),
    }


def write_row(metrics_file, row: dict) -> None:
    """Append one metrics.jsonl row. A failed write (a full disk) is logged, not raised, so that the
    step's checkpoint is still attempted; the row is lost (a resumed run only drops rows, of the steps it runs again)."""
    try:
        metrics_file.write(run_dir.metrics_line(row))
        metrics_file.flush()
    except OSError as err:
        log.warning("could not write metrics row %d (%s); training goes on", row["step"], err)


RANK_0_FIRST_S = 5.0  # how long the other ranks wait before they exit on an error, so that rank 0 leaves first


def say_at_exit(message: str, world: distributed.World = distributed.World(), this_rank_only: bool = False) -> None:
    """A message that ends the run, on stderr once: rank 0 prints it. torchrun stops every rank as soon as one has
    exited, so a rank that exits first, silently, can stop rank 0 before the line is out (on an H200, the refusal of
    more processes than GPUs: stderr held only torchrun's own summary). So the others wait RANK_0_FIRST_S first.
    `this_rank_only`: a failure of this rank, not of all alike (out of memory, with its own completion lengths): the
    rank says it at once, with its number (rank 0 may only see the others leave, as a lost connection)."""
    if world.is_main or this_rank_only:
        try:
            print(message if world.is_main else f"[rank {world.rank}] {message}", file=sys.stderr, flush=True)
        except OSError:  # stderr's reader is gone (`| tee`, killed by the same Ctrl-C): the exit status still says it
            pass
    else:
        time.sleep(RANK_0_FIRST_S)


def interrupted_line(out_dir: Path) -> str:
    """The last line of a run a Ctrl-C stopped: what --resume would continue from, if anything."""
    saved = checkpoint.find(out_dir) if out_dir.is_dir() else []
    if not saved:
        return f"interrupted: no checkpoint was saved in {out_dir}; the same command with --resume auto starts the run again"
    return f"interrupted: the last checkpoint is {saved[-1]} (--resume continues from it); metrics are in {out_dir / 'metrics.jsonl'}"


def out_of_memory_line(out_dir: Path) -> str:
    """The last line of a run out of memory: what to lower, what to turn on that the run's config.json shows off
    (--gradient-checkpointing, on by default on a GPU; with vLLM on a GPU, --vllm-sleep), and how to continue (from
    its last checkpoint, if any)."""
    saved = checkpoint.find(out_dir) if out_dir.is_dir() else []
    again = f"--resume from the last checkpoint in {out_dir}" if saved else f"run the same command with --resume auto (no checkpoint was saved in {out_dir})"
    try:
        ran = json.loads((out_dir / "config.json").read_text())  # written before the first step
    except (OSError, ValueError):
        ran = {}
    switches = [] if ran.get("gradient_checkpointing") else ["--gradient-checkpointing"]
    vllm = ran.get("backend") == "vllm" or (ran.get("backend") == "auto" and vllm_sampler.vllm_available())  # auto: before 1 Dec 2026
    if ran.get("device") == "cuda" and not ran.get("vllm_sleep") and vllm:
        switches.append("--vllm-sleep")  # vLLM's KV cache freed during the update
    switch = f" or pass {' or '.join(switches)}" if switches else ""
    return f"error: out of memory; lower --micro-batch (or --n, --prompts-per-step, --max-new-tokens){switch}, then {again}"


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_signals() -> tuple:
    """STOP_SIGNALS, and SIGHUP (the terminal closed, an ssh connection dropped: it killed the run without a checkpoint)
    where it would kill the process: not under nohup, which ignores it so that the run goes on."""
    hup = getattr(signal, "SIGHUP", None)
    return STOP_SIGNALS + ((hup,) if hup is not None and signal.getsignal(hup) == signal.SIG_DFL else ())


def set_handlers(handlers: dict) -> dict:
    """Install signal handlers and return the previous ones, for restore_handlers; none off the main thread
    (a notebook's worker thread), where Python sets no handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}


def restore_handlers(previous: dict) -> None:
    for sig, handler in previous.items():  # None: a handler set outside Python, which cannot be put back
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)


SAME_STOP_S = 1.0  # a SIGTERM (SIGHUP) this soon after a SIGTERM (SIGHUP) is the same stop, delivered twice


def ctrl_c_handler(stop: dict):
    """SIGINT and SIGTERM handler: the first signal asks the loop to stop after the current step and
    save; a second one quits without saving. SIGTERM is what cluster schedulers send before a kill
    (the step finishes and is saved if their grace period allows). Under torchrun the ranks run in
    their own sessions, out of the terminal's reach: torchrun passes its first Ctrl-C on to each rank
    once, and at a second one terminates them (SIGTERM), which, being their second signal, quits
    without saving. A scheduler's SIGTERM (Slurm's scancel, systemd's stop) reaches every process of the job,
    so a rank receives it twice, from the scheduler and from torchrun passing its own on: a SIGTERM within
    SAME_STOP_S of the first is that one stop, not a second (as a second, it lost the step's checkpoint)."""

    def on_signal(signum, frame):
        now = time.monotonic()
        if stop["requested"]:
            if signum == stop.get("signal") != signal.SIGINT and now - stop["at"] < SAME_STOP_S:  # SIGTERM, SIGHUP
                return
            raise KeyboardInterrupt
        stop.update(requested=True, signal=signum, at=now)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        log.info("%s: finishing this step, then saving a checkpoint (%s again to quit without saving)", name,
                 "Ctrl-C" if signum == signal.SIGINT else f"Ctrl-C or {name}")

    return on_signal
