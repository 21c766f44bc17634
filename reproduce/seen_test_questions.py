"""How many of the test questions a run of the CPU reproduction had trained on.

The arithmetic task's test split is its own seeded stream (data.ARITH_TEST_SEED), not a set kept out of
training: arith:2 has ~9,400 distinct questions, so most test questions also occur among the 20,000
training ones. This prints, for the evaluation's first 256 test questions (README.md here, "Evaluation"):
how many are in the training pool of seed 0, and for each setting the number a run had drawn by its last
step (its prompt order is data.PromptStream's, replayed from the seed). For each comparison it prints the
paired difference PODS - GRPO at the last step, as a share of the 256: how far memorised test questions
could move the accuracy difference if each one a run had drawn were answered right for that reason alone;
and, as the primary reading reads accuracy (headline.py: the mean over the horizon on the reference clock), the
drawn share's own mean over that horizon, each seed's accuracy difference less it, and their mean with its t interval:
the reading if every drawn test question had been answered right for that alone from the step that drew it.

    python reproduce/seen_test_questions.py     # reads reproduce/cpu-plateau/*/config.json, metrics.jsonl and eval-*.json
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's data.py

import data
from headline import pair
from plot import compare, label_of, read_metrics
from reference_clock import ReferenceClock
from stats import mean_accuracy_difference, t_interval

RUNS = Path(__file__).parent / "cpu-plateau"
DATASET, LIMIT = "arith:2", 256
PRIMARY = {("pods-n8-m4", "grpo-n8"): (0, 1, 2, 3, 9, 10), ("pods-n16-m4", "grpo-n4"): (0, 1, 2, 3, 9, 10, 11, 12, 13, 15)}
REFERENCE_SEEDS = (0, 1, 2, 3)  # the reference clock's runs: those on the machine of seeds 0-3 (cpu_reproduction.sh reference_runs)


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


def mean_drawn_share(run: Path, test: set[str], clock: ReferenceClock, horizon: float) -> float:
    """The share of the `test` questions a run had drawn, averaged over [0, horizon] seconds on the reference clock:
    a question counts from the end of the step that drew it."""
    config, rows = json.loads((run / "config.json").read_text()), read_metrics(run)
    ends, order = clock.elapsed(label_of(config), rows), training_order(config["dataset"], config["seed"])
    drawn = [len(test & set(order[: step * config["prompts_per_step"]])) / LIMIT for step in range(1, len(rows) + 1)]
    edges = [min(t, horizon) for t in ends] + [horizon]  # drawn[k] holds from the end of step k + 1 to the next end
    return sum(d * (b - a) for d, a, b in zip(drawn, edges, edges[1:])) / horizon


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
    clock = ReferenceClock([run for setting in ("grpo-n8", "pods-n8-m4", "grpo-n4", "pods-n16-m4") for run in
                            (RUNS / f"{setting}-s{seed}" for seed in REFERENCE_SEEDS)])
    for (pods, grpo), seeds in PRIMARY.items():
        comparison = compare([RUNS / f"{setting}-s{seed}" for setting in (grpo, pods) for seed in seeds], None, None, clock)
        base, other = pair(comparison)  # (the labels of grpo's runs and pods')
        accuracy = mean_accuracy_difference(comparison.groups[base], comparison.groups[other], comparison.horizon)
        drawn = [mean_drawn_share(RUNS / f"{pods}-s{seed}", test, clock, comparison.horizon)
                 - mean_drawn_share(RUNS / f"{grpo}-s{seed}", test, clock, comparison.horizon) for seed in comparison.seeds[base]]
        mean, low, high = t_interval([a - d for a, d in zip(accuracy["differences"], drawn)])
        print(f"{pods} - {grpo} over the primary reading's {comparison.horizon / 60:.1f} min: drawn share {statistics.mean(drawn):+.3f} "
              f"(mean over the horizon); mean accuracy {accuracy['mean']:+.3f} [{accuracy['low']:+.3f}, {accuracy['high']:+.3f}], "
              f"less it seed by seed {mean:+.3f} [{low:+.3f}, {high:+.3f}] (95% t interval)")


if __name__ == "__main__":
    main()
