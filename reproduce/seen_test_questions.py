"""How many of the test questions a run of the CPU reproduction had trained on.

The arithmetic task's test split is its own seeded stream (data.ARITH_TEST_SEED), not a set kept out of
training: arith:2 has ~9,400 distinct questions, so most test questions also occur among the 20,000
training ones. This prints, for the evaluation's first 256 test questions (README.md here, "Evaluation"):
how many are in the training pool of seed 0, and for each setting the number a run had drawn by its last
step (its prompt order is data.PromptStream's, replayed from the seed). For each comparison it prints the
paired difference PODS - GRPO at the last step, as a share of the 256: how far memorised test questions
could move the accuracy difference if each one a run had drawn were answered right for that reason alone.

    python reproduce/seen_test_questions.py     # reads reproduce/cpu-plateau/*/config.json and metrics.jsonl
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's data.py

import data

RUNS = Path(__file__).parent / "cpu-plateau"
DATASET, LIMIT = "arith:2", 256
PRIMARY = {("pods-n8-m4", "grpo-n8"): (0, 1, 2, 3, 9, 10), ("pods-n16-m4", "grpo-n4"): (0, 1, 2, 3, 9, 10, 11, 12, 13, 15)}


@functools.cache
def training_order(dataset: str, seed: int) -> list[str]:
    """A run's training questions in the order it draws them (data.PromptStream's first epoch; arith's are never skipped)."""
    examples = data.load_examples(dataset, "train", seed=seed)
    stream = data.PromptStream(examples, lambda question: [0], 1, seed)
    stream.next_batch(1)
    return [examples[i].question for i in stream.order]


def drawn_by_last_step(run: Path) -> list[str]:
    """The training questions a run drew up to its last step."""
    config = json.loads((run / "config.json").read_text())
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    return training_order(config["dataset"], config["seed"])[: last["step"] * config["prompts_per_step"]]


def main() -> None:
    test = {e.question for e in data.load_examples(DATASET, "test")[:LIMIT]}
    pool = {e.question for e in data.load_examples(DATASET, "train", seed=0)}
    print(f"{len(test)} distinct of the first {LIMIT} test questions; {len(test & pool)} of them in seed 0's training pool of {len(pool)} distinct")
    seen = {}
    for setting in sorted({s for pair in PRIMARY for s in pair}):
        seen[setting] = {int(run.name.rsplit("-s", 1)[1]): len(test & set(drawn_by_last_step(run))) for run in RUNS.glob(f"{setting}-s*")}
        counts = list(seen[setting].values())
        print(f"{setting:<12} {len(counts)} runs: test questions drawn by the last step, median {statistics.median(counts):g}, "
              f"range {min(counts)}-{max(counts)}")
    for (pods, grpo), seeds in PRIMARY.items():
        differences = [seen[pods][s] - seen[grpo][s] for s in seeds]
        print(f"{pods} - {grpo}, primary seeds {', '.join(map(str, seeds))}: {differences}, mean {statistics.mean(differences):+.1f} "
              f"questions = {statistics.mean(differences) / LIMIT:+.3f} of the accuracy at most")


if __name__ == "__main__":
    main()
