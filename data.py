"""Tasks: question/answer pairs from GSM8K, a GSM8K-style .jsonl file, or a built-in generator.

- `gsm8k`: the hub dataset openai/gsm8k (via `datasets`), the paper's task. With no hub (one quick
  connection attempt fails) it fails at once with what to pass instead; with the offline variables
  set (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE) `datasets` reads its local cache, and fails the same way
  without one.
- a path to a `.jsonl` file with `question` and `answer` per row; the answer is either a GSM8K
  solution ending in "#### N" or one number ("72", "$1,000", "72 apples"; "7 from 3" is refused, after
  "####" too).
- `arith`: procedurally generated arithmetic word problems with answers computed by the
  generator, in levels of increasing difficulty (`arith` = levels 1-3; `arith:1` one-digit
  sums only, `arith:12` levels 1 and 2). It is the task for CPU-scale experiments:
  the embedded 135M model already solves some one-digit sums (so GRPO has a signal to
  amplify) and has room to improve on the levels above.

`PromptStream` draws a run's prompts: a seeded permutation per epoch, each prompt tokenized as drawn.

Run `python data.py` to print a few problems of each level.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import urllib.request
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlparse

from rewards import MAX_NUMBER_CHARS, normalize_number, parse_gsm8k_solution
from rewards import _numbers as numbers_in  # (rewards.py's bytes key every stored evaluation: a rename would void them)

ARITH = "arith"
GSM8K = "gsm8k"
ARITH_TEST_SEED = 1_000_003  # test problems come from their own stream (not kept out of training: load_examples)
NAMES = ["Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Isla", "Jack", "Lena", "Omar"]
ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "cards", "shells"]


log = logging.getLogger("pods")


class DataError(ValueError):
    """A dataset that cannot be used; the message says what to pass instead."""


@dataclass(frozen=True)
class Example:
    question: str
    answer: str  # normalized number, compared with rewards.normalize_number


def arith_problem(rng: random.Random, level: int) -> Example:
    """One problem of the given level.

    1: "What is 7 + 5?" (one-digit sums)
    2: one-digit sums and differences in a one-sentence story
    3: two-digit sums and differences in a story
    4: two steps (a + b - c) in a story, a and b of two digits, c from 1 to a + b (answers from 0)
    """
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if level == 1:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return Example(f"What is {a} + {b}?", str(a + b))
    if level in (2, 3):
        low, high = (1, 9) if level == 2 else (10, 99)
        a, b = rng.randint(low, high), rng.randint(low, high)
        if rng.random() < 0.5:
            return Example(f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", str(a + b))
        a, b = max(a, b), min(a, b)
        return Example(f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?", str(a - b))
    if level == 4:
        a, b = rng.randint(10, 60), rng.randint(10, 60)
        c = rng.randint(1, a + b)
        return Example(
            f"{name} has {a} {item}, buys {b} more, then gives {c} to a friend. How many {item} does {name} have now?",
            str(a + b - c),
        )
    raise DataError(f"arithmetic level {level} does not exist; levels are 1 to 4")


def arith_examples(count: int, seed: int, levels: tuple[int, ...] = (1, 2, 3)) -> list[Example]:
    """`count` problems, levels drawn uniformly from `levels`, reproducible from `seed`."""
    rng = random.Random(seed)
    return [arith_problem(rng, rng.choice(levels)) for _ in range(count)]


def _example(row: dict) -> Example | None:
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, (int, float)):  # a JSON number: str(1e-05) is "1e-05", whose last number is 5
        answer = repr(answer)
    answer = plain_number(str(answer))
    if len(numbers_in(answer.rpartition("####")[2], list_markers=False)) > 1:
        return None  # "7 (from 3 apples)", "#### 7 from 3": not one number (its last, 3, was taken as the answer)
    try:
        parsed = parse_gsm8k_solution(answer) if "####" in answer else normalize_number(answer, list_markers=False)
    except ValueError:
        return None
    return Example(question, parsed) if parsed is not None else None


def plain_number(answer: str) -> str:
    """A reference answer written in scientific notation as plain digits ("2.5e3" is "2500", not its last number 3);
    anything else as it is. An exponent beyond rewards.MAX_NUMBER_CHARS digits gives no number."""
    try:
        value = Decimal(answer.strip())
    except ArithmeticError:  # decimal.InvalidOperation: not one number ("72 apples", "1,000", "#### 5")
        return answer
    return format(value, "f") if value.is_finite() and abs(value.adjusted()) <= MAX_NUMBER_CHARS else ""


def is_built_in(dataset: str) -> bool:
    """Whether --dataset names GSM8K or the arithmetic task (anything else is a file's path)."""
    return dataset == GSM8K or arith_levels(dataset) is not None


def check_dataset_file(dataset: str) -> None:
    """A --dataset that names neither GSM8K nor the arithmetic task must be a file (train.py checks it before anything
    else is said); the message has the path as typed ("./gsm8k", not "gsm8k")."""
    if is_built_in(dataset):
        return
    try:
        what = None if Path(dataset).is_file() else "is a directory, not a file" if Path(dataset).is_dir() else "does not exist"
    except OSError as err:  # a name too long, no permission on a directory on the way
        raise DataError(f"cannot read dataset file {dataset} ({err.strerror}); pass a .jsonl file you can read") from None
    if what:
        raise DataError(f"dataset file {dataset} {what}; pass a .jsonl path, '{GSM8K}' or '{ARITH}'")


def recorded(dataset: str) -> str:
    """--dataset as a run's config.json records it: a file by its absolute path (--resume and eval.py, run from another
    directory, read "d.jsonl" as the file there), GSM8K or the arithmetic task by name."""
    return dataset if is_built_in(dataset) else os.path.abspath(os.path.expanduser(dataset))


def read_jsonl(path: Path) -> list[Example]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8 JSON lines") from None
    except OSError as err:  # no permission, a name too long, a disk error
        raise DataError(f"cannot read dataset file {path} ({err.strerror}); pass a .jsonl file you can read") from None
    if text.lstrip().startswith("["):  # one JSON array over many lines: every row but the last ends in a comma
        raise DataError(f"{path} is a JSON array; write one JSON object per line (JSON lines)")
    examples, unusable = [], []
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines(): JSON may hold U+2028
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, a number of over 4,300 digits, brackets nested too deep
            row = None
        example = _example(row) if isinstance(row, dict) else None
        if example is not None:
            examples.append(example)
        elif line.strip():
            unusable.append(number)
    if unusable:  # skipped, and said: a silently shorter dataset would be a different experiment
        log.warning("%s: skipped %d unusable line(s) (not JSON with 'question' and an 'answer' that is one number or ends in "
                    "'#### N'), first at line %d",
                    path, len(unusable), unusable[0])
    if not examples:
        raise DataError(f"{path} has no usable rows: each line must be JSON with 'question' and 'answer' (one number, or '... #### N')")
    return examples


def arith_levels(dataset: str) -> tuple[int, ...] | None:
    """Levels of an arithmetic dataset name: "arith" is levels 1-3, "arith:12" levels 1 and 2;
    None for any other name."""
    name, _, digits = dataset.partition(":")
    if name != ARITH:
        return None
    if not digits:
        return (1, 2, 3)
    if not all(d in "1234" for d in digits):
        raise DataError(f"{dataset!r}: levels are digits 1 to 4, e.g. '{ARITH}:12'")
    return tuple(sorted({int(d) for d in digits}))


def is_set(variable: str) -> bool:
    """Whether an environment variable is on ("1", "true", "yes" or "on", as the hub client reads it)."""
    return os.environ.get(variable, "").lower() in ("1", "true", "yes", "on")


def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the hub (datasets and models) can't be reached, HF_HUB_OFFLINE set or no connection to it, found
    without the hub client's retries (25-50 s offline), in at most 2 x timeout_s; None when it may be."""
    if is_set("HF_HUB_OFFLINE"):
        return "HF_HUB_OFFLINE is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    name = host  # what is asked, as the answer names it
    proxy = urllib.request.getproxies().get(endpoint.scheme or "https")  # HTTPS_PROXY and the like: the hub is reached through it
    if proxy and not urllib.request.proxy_bypass(host):
        try:
            via = urlparse(proxy if "://" in proxy else f"http://{proxy}")
            host, port = via.hostname or host, via.port or {"https": 443}.get(via.scheme, 1080 if via.scheme.startswith("socks") else 80)
        except ValueError as err:  # "http://[::1": a traceback at start
            return f"the proxy {proxy!r} (HTTPS_PROXY or the like) is not a URL: {err}"
        name = f"{host} (the proxy)"
    answer = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            answer.append(None)
        except OSError as err:
            answer.append(f"{name} unreachable: {err}")

    # In a thread, because create_connection's timeout covers the connection but not the DNS lookup before
    # it, which a hanging resolver would hold for its own timeout: the lookup gets as long as the connection.
    attempt = threading.Thread(target=connect, daemon=True)
    attempt.start()
    attempt.join(2 * timeout_s)
    return answer[0] if answer else f"{name} unreachable: no answer in {2 * timeout_s:g} s"


def load_examples(dataset: str, split: str, arith_size: int = 20_000, seed: int = 0) -> list[Example]:
    """Examples of `dataset` ("gsm8k", "arith", "arith:LEVELS" or a .jsonl path); split is
    "train" or "test".

    For a .jsonl path the split is ignored. For "arith" the test split is a fixed stream of 500
    problems from its own seed, not a set kept out of training: arith:1 has 81 distinct questions and
    arith:2 ~9,400, so most of its test questions also occur among the 20,000 training ones (arith:3 and
    arith:4 almost none; reproduce/seen_test_questions.py counts what runs drew).
    """
    levels = arith_levels(dataset)
    if levels is not None:
        if split == "test":
            return arith_examples(500, ARITH_TEST_SEED, levels)
        if seed == ARITH_TEST_SEED:
            raise DataError(f"--seed {seed} draws the arithmetic task's test problems as its training problems; pick another seed")
        return arith_examples(arith_size, seed, levels)
    if dataset == GSM8K:
        try:
            offline = None if is_set("HF_HUB_OFFLINE") or is_set("HF_DATASETS_OFFLINE") else hub_unreachable()  # set: `datasets` reads its cache
            if offline:
                raise ConnectionError(offline)
            from datasets import load_dataset

            rows = load_dataset("openai/gsm8k", "main", split=split)
        except Exception as err:  # offline, hub down, no `datasets`: all end the same way
            raise DataError(
                f"could not download GSM8K ({type(err).__name__}: {str(err)[:80]}); pass a local GSM8K-style file "
                f"(--dataset path/to/{split}.jsonl) or the built-in task (--dataset {ARITH})"
            ) from None
        return [e for e in map(_example, rows) if e is not None]
    check_dataset_file(dataset)
    return read_jsonl(Path(dataset))


class PromptStream:
    """The training prompts in a seeded random order, epoch after epoch, each tokenized as it is drawn
    (the chat template over all 20,000 arithmetic problems would take ~9 s at every start); a prompt
    longer than `max_tokens` is skipped. `position`, the count of prompts drawn, makes it resumable."""

    def __init__(self, examples: list[Example], tokenize, max_tokens: int, seed: int, position: int = 0):
        self.examples, self.tokenize, self.max_tokens = examples, tokenize, max_tokens
        self.seed, self.position = seed, position
        self.epoch, self.order, self.too_long, self.skipped = -1, [], set(), 0  # too_long: the examples found too long

    def next_batch(self, size: int) -> list[tuple[list[int], str]]:
        """`size` (prompt token ids, reference answer) pairs."""
        batch = []
        while len(batch) < size:
            epoch, index = divmod(self.position, len(self.examples))
            if epoch != self.epoch:  # a fresh permutation each epoch, a function of (seed, epoch) only
                self.epoch = epoch
                self.order = random.Random(self.seed * 1_000_003 + epoch).sample(range(len(self.examples)), len(self.examples))
            example = self.examples[self.order[index]]
            self.position += 1
            ids = self.tokenize(example.question)
            if len(ids) <= self.max_tokens:
                batch.append((ids, example.answer))
                continue
            if self.skipped == 0:  # once: it came at every prompt kept after one skipped, above the progress bar
                log.info("skipping prompts longer than --max-prompt-tokens %d (this one: %d tokens; said once)", self.max_tokens, len(ids))
            self.skipped += 1
            self.too_long.add(self.order[index])  # counted by example: skips in a row may span two epochs' orders
            if len(self.too_long) == len(self.examples):
                raise DataError(f"every prompt is longer than --max-prompt-tokens {self.max_tokens}; raise it")
        return batch


if __name__ == "__main__":
    rng = random.Random(0)
    for level in (1, 2, 3, 4):
        for _ in range(2):
            e = arith_problem(rng, level)
            print(f"level {level}: {e.question}  -> {e.answer}")
