"""Several train.py runs on one machine, taking turns a training step at a time, their clocks together.

A wall-clock comparison is fair only if every method meets the same machine, and a shared machine's
speed drifts (the CPU this project's reproduction ran on was 1.2-1.7x slower for hours at a time). Runs
started with the same turn directory compute one at a time, a training step per turn, and the next turn
goes to the run that has trained the fewest seconds so far. Their training clocks (train.py's
`elapsed_s`, the x axis of every curve) therefore stay within a step of each other, and a slow spell of
the machine falls on the same training minutes of every run. Nothing else about a run changes: it trains
on the same batches with the same random numbers as alone, and its `elapsed_s` still counts its own steps
only, because train.py times a step from its batch to its metrics row and the wait comes after the row.
A run's first turn also holds its start-up, and its last its final checkpoint.

    python reproduce/take_turns.py TURN_DIR train.py ARGS... &   # in the project root, once per run
    touch TURN_DIR/start                                     # once all have started: the first turn begins

Runs that have not yet stepped go first, in the order they were started; a tie goes to the run that
follows the last one in that order. Each turn is logged (run, step, its elapsed_s after the step, start
and end wall time) to TURN_DIR/turns.jsonl and to the run's own turns.jsonl in its --out-dir. A run that
dies leaves the rotation when the others notice that its process is gone.

A waiting run sleeps until it is handed the turn (a byte on its FIFO, TURN_DIR/PID.wake), waking otherwise
once a LIVENESS_S only to see whether the turn's holder is still alive. It must not poll: on 2 cores,
waiting runs that looked at the turn every 10 ms made the computing run's steps 1.16-1.31x as long as
alone (grpo-n8-s0's steps 2-6 in a group of four, 24 November 2026; reproduce/bench/bench_take_turns.sh).
Sleeping, they still read 1.11-1.19x in two pairs (updates more than generation), so taking turns keeps
a group's clocks together but is not free on 2 cores: measure it (reproduce/bench/bench_take_turns.sh) before
timing methods this way.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import sys
import time
from contextlib import contextmanager
from pathlib import Path

POLL_S = 0.2  # how often a run that has joined looks for TURN_DIR/start (before anyone computes)
LIVENESS_S = 1.0  # how often a waiting run wakes unasked, to drop a turn holder whose process is gone
NOT_STEPPED = -1.0  # the training clock of a run that has not finished a step here yet (it goes first)


class Turns:
    """The rotation, kept in TURN_DIR/state.json under a file lock: {"order": [pids in the order they
    joined], "clock": {pid: elapsed_s}, "turn": pid}."""

    def __init__(self, turn_dir: Path, out_dir: Path | None):
        self.dir, self.out_dir, self.pid = turn_dir, out_dir, os.getpid()
        self.name = out_dir.name if out_dir else str(self.pid)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.turn_start = None
        self.wake_fd = None

    @contextmanager
    def state(self):
        with open(self.dir / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.dir / "state.json"
            before = path.read_text() if path.exists() else json.dumps({"order": [], "clock": {}, "turn": None})
            state = json.loads(before)
            yield state
            if json.dumps(state) != before:
                path.write_text(json.dumps(state))

    def join(self) -> None:
        fifo = self.dir / f"{self.pid}.wake"
        fifo.unlink(missing_ok=True)  # left by an earlier process with this pid
        os.mkfifo(fifo)
        self.wake_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # read-write: never at end-of-file, so select sleeps
        with self.state() as state:
            state["order"].append(self.pid)
            state["clock"][str(self.pid)] = NOT_STEPPED
            if state["turn"] is None:
                state["turn"] = self.pid

    def wait(self) -> None:
        """Until it is this run's turn; a turn holder whose process is gone is dropped."""
        while True:
            with self.state() as state:
                if state["turn"] == self.pid:
                    break
                if not alive(state["turn"]):
                    pass_turn(state, state["turn"], leave=True)
                    wake(self.dir, state["turn"])
            if select.select([self.wake_fd], [], [], LIVENESS_S)[0]:  # handed the turn, or LIVENESS_S passed
                os.read(self.wake_fd, 4096)
        self.turn_start = time.time()

    def hand_on(self, step: int | None, elapsed_s: float | None = None, leave: bool = False) -> None:
        """The turn to the run furthest behind, after logging this one (`leave`: this run leaves the rotation)."""
        if self.turn_start is not None:
            line = json.dumps({"run": self.name, "pid": self.pid, "step": step, "elapsed_s": elapsed_s,
                               "start": self.turn_start, "end": time.time()})
            for log in (self.dir, self.out_dir) if self.out_dir and self.out_dir.is_dir() else (self.dir,):
                with open(log / "turns.jsonl", "a") as f:
                    f.write(line + "\n")
            self.turn_start = None
        with self.state() as state:
            pass_turn(state, self.pid, elapsed_s, leave)
            wake(self.dir, state["turn"])
        if leave and self.wake_fd is not None:
            os.close(self.wake_fd)
            (self.dir / f"{self.pid}.wake").unlink(missing_ok=True)
            self.wake_fd = None


def wake(turn_dir: Path, pid: int | None) -> None:
    """A byte on `pid`'s FIFO: it holds the turn now (nothing if it has gone, or already has one waiting)."""
    if pid is None:
        return
    try:
        fd = os.open(turn_dir / f"{pid}.wake", os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no FIFO (it left) or no reader (it died)
        return
    try:
        os.write(fd, b"t")
    except BlockingIOError:  # the FIFO is full of earlier wake-ups: it will wake anyway
        pass
    finally:
        os.close(fd)


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pass_turn(state: dict, pid: int, elapsed_s: float | None = None, leave: bool = False) -> None:
    """`pid` has trained `elapsed_s` (`leave`: it is done); if it holds the turn, the turn goes to the run
    with the fewest seconds trained, a tie to the first after `pid` in the order."""
    order, clock = state["order"], state["clock"]
    if pid not in order:
        return
    if elapsed_s is not None:
        clock[str(pid)] = elapsed_s
    i = order.index(pid)
    following = order[i + 1:] + order[:i + 1]  # `pid` itself last
    if leave:
        order.remove(pid)
        clock.pop(str(pid))
        following.remove(pid)
    if state["turn"] == pid:
        state["turn"] = min(following, key=lambda p: clock[str(p)]) if following else None


def main() -> int:
    if len(sys.argv) < 3 or not sys.argv[2].endswith("train.py"):
        print("usage: python reproduce/take_turns.py TURN_DIR train.py ARGS... (in the project root)", file=sys.stderr)
        return 2
    turn_dir, script, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    out_dir = Path(argv[argv.index("--out-dir") + 1]) if "--out-dir" in argv else None
    turns = Turns(turn_dir, out_dir)
    turns.join()
    try:
        while not (turn_dir / "start").exists():  # until the whole group has joined
            time.sleep(POLL_S)
        turns.wait()  # before torch is imported: a start-up is work too
        sys.path.insert(0, str(Path(script).resolve().parent))
        import progress
        import train

        write_row = progress.write_row

        def write_row_then_hand_on(metrics_file, row: dict) -> None:  # the step's time is taken by now
            write_row(metrics_file, row)
            turns.hand_on(row["step"], row["elapsed_s"])
            turns.wait()

        progress.write_row = write_row_then_hand_on
        return train.main(argv)
    finally:  # finished, failed or interrupted: the others go on without it
        turns.hand_on(None, leave=True)


if __name__ == "__main__":
    sys.exit(main())
