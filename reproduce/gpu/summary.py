"""The GPU check's summary: a header (card, date, commit, versions, model), the CUDA tests' counts, and one
table of the timed stages, steps 2-3 of each, with the ratios of their step times to TRL's.

check.sh runs it last, on the folder where its stages wrote:
    python3 reproduce/gpu/summary.py LOGS > OUT/last_check.txt
    python3 reproduce/gpu/summary.py LOGS MORE_LOGS ...    # several check.sh calls on one machine, as one table
LOGS holds env.txt (the header, "key: value" lines), status.txt (a line per stage: name, exit status or
"skipped", seconds or the reason), tests.log (pytest's output), and for each timed stage STAGE.jsonl (a row
per step: train.py's metrics.jsonl, or trl_gpu.py's rows with the same keys) and STAGE.log (its last line
gives CUDA's peak memory, as peak.py prints it). Standard library only.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

TIMED_STEPS = (2, 3)  # step 1 holds CUDA's first calls (kernel loading, the allocator's growth): never timed
ROWS = {  # the timed stages, in the table's order
    "pods": "PODS, train.py --backend hf",
    "old": "PODS, train.py at {old}",
    "grpo": "GRPO, train.py --rule none",
    "trl": "GRPO, TRL GRPOTrainer",
    "vllm": "PODS, train.py --backend vllm",
}
RATIOS = (("pods", "trl"), ("grpo", "trl"), ("pods", "grpo"), ("pods", "old"), ("vllm", "pods"), ("vllm", "trl"))  # step time of the first / the second
PEAK = re.compile(r"CUDA peak allocated ([\d.]+) GiB, reserved ([\d.]+) GiB")
PHASES = re.compile(r"in the update ([\d.]+) GiB allocated, outside it ([\d.]+)")  # peak.py's split of the peak
KV_CACHE = re.compile(r"vLLM KV cache: ([\d,]+) tokens")  # vllm_sampler.py's line at vLLM's start
TIMED_OUT = {"124", "137"}  # timeout(1)'s exit status, and a KILL after its grace period


def read(path: Path) -> str:
    """A file the stages wrote; "" where a stage did not get to write it."""
    return path.read_text(errors="replace") if path.exists() else ""


def read_rows(text: str) -> list[dict]:
    """A stage's rows, one JSON object a line; a line cut short (the stage killed as it wrote) left out."""
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [row for row in rows if isinstance(row, dict)]


def read_env(text: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


def read_status(text: str) -> dict[str, tuple[str, str]]:
    """stage -> (exit status or "skipped", seconds or the reason)"""
    return {stage: (code, rest) for stage, code, rest in (line.split("\t", 2) for line in text.splitlines() if line)}


def status_text(code: str, rest: str) -> str:
    if code == "skipped":
        return f"skipped: {rest}"
    if code in TIMED_OUT:
        return f"timed out at {rest} s"
    return f"ok, {rest} s" if code == "0" else f"failed (exit {code}) after {rest} s"


def step_means(rows: list[dict], steps=TIMED_STEPS) -> dict[str, float]:
    """Means over `steps` (those that finished) of generation, update and whole-step seconds, completion length
    and sampler gap. A step's seconds are its rise in elapsed_s, as train.py counts them."""
    elapsed = {row["step"]: row["elapsed_s"] for row in rows}
    timed = [dict(row, step_s=row["elapsed_s"] - elapsed[row["step"] - 1])
             for row in rows if row["step"] in steps and row["step"] - 1 in elapsed]
    keys = ("generation_s", "update_s", "step_s", "completion_len", "sampler_gap_mean")
    means = {k: sum(row[k] for row in timed) / len(timed) for k in keys
             if timed and all(isinstance(row.get(k), (int, float)) for row in timed)}  # (null: a sampler gap not finite)
    return means | {"steps": [row["step"] for row in timed]}


def ms_per_token(means: dict) -> float | None:
    """Generation's milliseconds per token of the mean completion: a decode step's, where every rollout runs to
    the token limit (random weights), its prefill and scoring included."""
    return 1000 * means["generation_s"] / means["completion_len"] if means.get("completion_len") and "generation_s" in means else None


def peak(log_text: str) -> tuple[float, float] | None:
    """(allocated, reserved) GiB from the last peak line of a stage's log."""
    found = PEAK.findall(log_text)
    return tuple(map(float, found[-1])) if found else None


def outcome_lines(log_text: str) -> list[str]:
    """pytest's counts (its last line) and its FAILED / ERROR / SKIPPED lines; where it was stopped before them,
    each test's outcome as `pytest -v` printed it, and the test it was running."""
    counts = [line.strip("= ") for line in log_text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    named = [line[:200] for line in log_text.splitlines() if line.startswith(("FAILED ", "ERROR ", "SKIPPED "))]
    if counts:
        return counts[-1:] + named
    started = list(re.finditer(r"^(\S+\.py::\S+)", log_text, re.M))
    lines = ["stopped before pytest's summary:"] if started else []
    for k, test in enumerate(started):
        end = started[k + 1].start() if k + 1 < len(started) else len(log_text)
        outcome = re.search(r"\b(PASSED|FAILED|SKIPPED|ERROR)\b", log_text[test.end():end])
        lines.append(f"{test.group(1)} {outcome.group(1) if outcome else 'was running'}")
    return lines


def cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(lines: list[list[str]]) -> list[str]:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return ["  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip() for line in lines]


def summary(logs: Path, *more: Path) -> str:
    """The summary of the stages in `logs`, and in `more`, the LOGS of later check.sh calls on the same machine
    (a stage run in several: the last one's), under the first call's header."""
    env = read_env(read(logs / "env.txt"))
    status, where = {}, {}  # stage -> its status, and the folder that holds its logs
    for folder in (logs, *more):
        found = read_status(read(folder / "status.txt"))
        status |= found
        where |= dict.fromkeys(found, folder)
    out = ["GPU check (reproduce/gpu/check.sh)", *(f"{key}: {value}" for key, value in env.items())]
    if "tests" in status:
        out.append(f"tests (pytest -m cuda): {status_text(*status['tests'])}")
        out += [f"  {line}" for line in outcome_lines(read(where["tests"] / "tests.log"))]
    if "decode" in status:
        out.append(f"decode step (decode_bench.py): {status_text(*status['decode'])}")
        out += [f"  {line}" for line in read(where["decode"] / "decode.log").splitlines() if line.startswith(("decode:", "eval batch:", "kernels", "  "))]
    lines = [["stage", "what", "steps", "generation s", "ms/token", "update s", "step s", "peak GiB alloc/reserved",
              "completion len", "sampler gap", "status"]]
    step_s, failures, phases, notes = {}, [], [], []
    for stage, what in ROWS.items():
        if stage not in status:
            continue
        means = step_means(read_rows(read(where[stage] / f"{stage}.jsonl")))
        if "step_s" in means:
            step_s[stage] = means["step_s"]
        log = read(where[stage] / f"{stage}.log")
        memory = peak(log)
        if split := PHASES.findall(log):
            phases.append(f"{stage} {split[-1][0]} in the update, {split[-1][1]} outside it")
        if kv := KV_CACHE.findall(log):  # allocated whole at vLLM's start: its size is the flag's, not the step's need
            notes.append(f"{stage}: its peak holds vLLM's KV cache, {kv[-1]} tokens, as --gpu-memory-utilization sized it")
        if status[stage][0] not in ("0", "skipped", *TIMED_OUT):
            failures.append(f"{stage} failed: {(log.strip().splitlines() or ['(no output)'])[-1][:200]}")
        lines.append([stage, what.format(old=env.get("old", "OLD")), "-".join(map(str, means["steps"])) or "-",
                      cell(means.get("generation_s"), 1), cell(ms_per_token(means), 1),
                      cell(means.get("update_s"), 1), cell(means.get("step_s"), 1),
                      "-" if memory is None else f"{memory[0]:.2f} / {memory[1]:.2f}",
                      cell(means.get("completion_len"), 0), cell(means.get("sampler_gap_mean"), 4),
                      status_text(*status[stage])])
    if len(lines) > 1:
        out += ["", *table(lines)]
        out.append(f"seconds: means over steps {'-'.join(map(str, TIMED_STEPS))} (step 1 holds CUDA's first calls); "
                   f"peak: torch.cuda's over the whole run")
        if phases:
            out.append("peak GiB allocated by phase: " + "; ".join(phases))
        out += notes + failures
    ratios = [f"{a} / {b} {step_s[a] / step_s[b]:.2f}" for a, b in RATIOS if a in step_s and b in step_s]
    if ratios:
        out.append("step time ratios: " + ", ".join(ratios))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python3 reproduce/gpu/summary.py LOGS [MORE_LOGS ...]   (the folders check.sh's stages wrote)")
    for folder in sys.argv[1:]:
        if not (Path(folder) / "status.txt").is_file():
            sys.exit(f"summary.py: {folder} holds no status.txt: name the logs folder each check.sh call's logs.tar.gz unpacks "
                     "to (unpack each into a folder of its own: all are named logs)")
    print(summary(*map(Path, sys.argv[1:])), end="")
