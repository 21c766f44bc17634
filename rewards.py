"""The rule-based reward of the paper: correctness of the final answer plus a small format bonus.

The paper (Section 5) trains with a verifiable reward: 1 for a correct final answer, plus
credit for answering in the requested format

    <think> reasoning </think>
    <answer> final answer </answer>

An answer counts as correct when the content of the last <answer>...</answer>, or the last
number anywhere in the completion, equals the reference: the authors' grader accepts either (and
the whole text), so a right answer is scored right whatever its format. Numbers are compared
after normalization ("$1,000.00" == "1 000" == "1000", "3/4" == "0.75" == "\\frac{3}{4}", "12 apples" == "12").

Standard library only. No input string makes any function here raise, except
`parse_gsm8k_solution`, which reads the dataset and rejects a row without "#### N".

Run `python rewards.py` to see a few completions scored.
"""

from __future__ import annotations

import re
from fractions import Fraction

CORRECT_REWARD = 1.0  # a correct final answer
STRUCTURE_REWARD = 0.1  # the whole completion is <think>...</think> <answer>...</answer>
TAG_REWARD = 0.025  # each of the four tags present exactly once (0.1 for all four)
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# The system prompt of every rollout (chat_messages): it asks for the format format_reward checks.
SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think><answer> answer here </answer>."
)

MAX_NUMBER_CHARS = 64  # longer digit strings are not answers; also keeps int() within limits

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_STRUCTURE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
# A number: optional minus (not after a word character, so "5-3" reads as 5 and 3), digits
# with optional thousands commas or spaces ("1,000" and "18 000", as GSM8K's solutions write them, but not "1,2"),
# optional decimals, optional "/denominator" (with decimals too: "3/1.5" is 2, not 3/1 and .5); or ".5"; or a mixed
# number: whole digits (not after a letter, "^", "." or ","), a space and a fraction ("2 1/2", not "17 000/5").
_NUMBER = re.compile(r"(?:(?<![\w)])-\s?)?(?:(?<![\w^.,])\d+ {1,2}[1-9]\d*/\d+|(?:\d{1,3}(?:(?:,\d{3})+|(?: \d{3})+)(?!\d)|\d+)(?:\.\d+)?(?:\s?/\s?\d+(?:\.\d+)?)?|\.\d+)")
_MIXED = re.compile(r"(-)?\s?(\d+) {1,2}([1-9]\d*)/(\d+)")  # the parts of a mixed number _NUMBER found
# Digits that continue a number past one separator without forming a thousands group, "1,00", "1_000", "3,0",
# "1 00": a run that starts with 0 there is no number of its own (it read as 0, matching a reference of 0).
_CONTINUED = re.compile(r"\d[,_ ]0")
# What precedes the minus of a subtraction written with spaces, "10 - 3": a number or ")" and then spaces.
_OPERAND_BEFORE = re.compile(r"[\d)][ \t]+$")
# A markdown bullet: "-" starting a line (after optional indentation) and followed by a space or tab.
_BULLET = re.compile(r"^([ \t]*)-(?=[ \t])", re.MULTILINE)
# LaTeX fractions: \frac{3}{4}, \dfrac{-1}{2}, \frac{1.5}{2}, \tfrac34 (one-digit arguments need no braces).
_FRAC = re.compile(r"\\[dt]?frac\s*(?:\{\s*(-?\d+(?:\.\d+)?)\s*\}|(\d))\s*(?:\{\s*(\d+(?:\.\d+)?)\s*\}|(\d))")


def _numbers(text: str, list_markers: bool = True) -> list[str]:
    """The numbers in `text`, in order, as written ("- 3", "1,000", "3/4"). With `list_markers` (a completion's
    text), a "- " starting a line is a markdown bullet, not a minus; an answer already extracted has none."""
    if list_markers:
        text = _BULLET.sub(r"\1", text)  # "\n- 72" is a list item, not -72
    text = text.replace("\u2212", "-")  # Unicode's minus sign (U+2212), never a bullet: "\frac{\u22121}{2}" too
    text = _FRAC.sub(lambda f: f" {f[1] or f[2]}/{f[3] or f[4]}", text)  # the space keeps 2\frac{1}{2} from reading as 21/2
    text = text.replace("{,}", ",").replace("\\,", ",").replace("$", "")  # LaTeX thousands separators: 1{,}000, 1\,000
    found = []
    for number in _NUMBER.finditer(text):
        written = number[0]
        if number.start() >= 2 and _CONTINUED.match(text, number.start() - 2):
            continue  # "1,00" reads as 1, not as 1 and 00
        if written.startswith("-") and _OPERAND_BEFORE.search(text, max(0, number.start() - 16), number.start()):
            written = written[1:].lstrip()  # "10 - 3": a subtraction, whose last number is 3
        found.append(written)
    return found


def normalize_number(s: str | None, list_markers: bool = True) -> str | None:
    """The last number in `s` in canonical form, or None if there is none.

    Tolerates "$", thousands commas or spaces ("18 000", as GSM8K's solutions write it; "100 200 300" too reads
    as one number, as the authors' grader, which drops spaces, reads it), "%", a trailing ".", units and words
    around the number, and LaTeX ("\\boxed{12}", "\\frac{3}{4}", "1{,}000").
    With `list_markers` (`s` is a completion's text), a "- " that starts a line (or the text), after
    optional indentation, is a markdown bullet: "\\n- 72" gives "72". Without (`s` is an answer already
    extracted, such as an <answer> tag's content), "- 72" gives "-72". A minus after a number and a space
    is a subtraction: "10 - 3" gives "3", as the authors' grader reads it (its last number never has a sign).
    Any other minus is a sign: "-72", "\\n-72", "x = -3", "answer: - 3" and "\\boxed{- 5}" give negatives.
    "12.0" and "12" both give "12", "-3.50" gives "-3.5", "3/4" and "0.75" both give "0.75", "3/1.5"
    and "\\frac{3}{1.5}" give "2", "1/3" gives "1/3" (a fraction without a finite decimal stays a fraction).
    A whole number and a proper fraction are a mixed number: "2 1/2" and "2\\frac{1}{2}" give "2.5".
    Unicode's minus, "\u2212 5", is a minus.
    """
    if not s:
        return None
    found = _numbers(s, list_markers)
    if not found:
        return None
    written = found[-1]
    if len(re.sub(r"[\s,]", "", written)) > MAX_NUMBER_CHARS:
        return None
    mixed = _MIXED.fullmatch(written)
    if mixed:  # "2 1/2" is 2.5; "2 7/4" is no mixed number: it reads as its last number, 7/4
        sign, whole, numerator, denominator = mixed.groups()
        if int(numerator) < int(denominator):
            return _canonical((-1 if sign else 1) * (int(whole) + Fraction(int(numerator), int(denominator))))
        written = f"{numerator}/{denominator}"
    token = re.sub(r"[\s,]", "", written)
    numerator, _, denominator = token.partition("/")
    if denominator and Fraction(denominator) == 0:
        return None
    value = Fraction(numerator) / Fraction(denominator or 1)
    return _canonical(value)


def _canonical(value: Fraction) -> str:
    """Integers as "12", finite decimals as "0.75", anything else as "1/3"."""
    if value.denominator == 1:
        return str(value.numerator)
    q, twos, fives = value.denominator, 0, 0
    while q % 2 == 0:
        q, twos = q // 2, twos + 1
    while q % 5 == 0:
        q, fives = q // 5, fives + 1
    if q != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator
    sign = "-" if value < 0 else ""
    digits = str(scaled).rjust(places + 1, "0")
    return f"{sign}{digits[:-places]}.{digits[-places:]}".rstrip("0")


def parse_gsm8k_solution(text: str) -> str:
    """The final answer of a GSM8K reference solution: the number after "####", normalized.

    "... #### 1,000" gives "1000". Raises ValueError when the text has no "#### <number>".
    """
    _, marker, tail = text.rpartition("####")
    answer = normalize_number(tail, list_markers=False) if marker else None
    if answer is None:
        raise ValueError(f"a GSM8K solution must end in '#### <number>', got {text[-60:]!r}")
    return answer


def extract_answer(completion: str) -> str | None:
    """The model's final answer: the content of the last <answer>...</answer>, else the last number
    (as written: "\\boxed{- 5}" gives "- 5"). Read it with normalize_number(answer, list_markers=False):
    a line of the completion may start with a bullet, an answer extracted from it does not.

    None when there is neither a closed answer tag nor any number in the completion.
    """
    closed = completion.rfind("</answer>")  # (no tag opened after it can close: searching on took time quadratic in them)
    tagged = _ANSWER.findall(completion, 0, closed + len("</answer>")) if closed >= 0 else []
    if tagged:
        return tagged[-1].strip()
    found = _numbers(completion)
    return found[-1].strip() if found else None


def correctness_reward(completion: str, answer: str) -> float:
    """CORRECT_REWARD if the extracted answer or the last number anywhere in the completion equals
    `answer` (the reference answer: text, or a number) as a number; 0.0 otherwise.

    Either one suffices, as in the authors' grader: "<answer>seventy-two</answer> so 72" is correct. So is a
    hedge, "<answer>71</answer> or maybe 72", for 72 as for 71: a policy could learn to hedge (check its answers).
    The bullet rule belongs to the completion's lines only: "<answer>- 3</answer>" is -3, while
    "<answer>\\n- 3\\n</answer>" reads -3 as its answer and 3 as the completion's last number (a bullet).
    """
    if not isinstance(answer, str):  # a number, written out: str(1e-05) is "1e-05", whose last number is 5
        try:
            answer = _canonical(Fraction(str(answer)))
        except (ValueError, ZeroDivisionError):  # NaN, True, a tensor's "tensor(72)"
            raise ValueError(f"answer must be the reference answer, as text or a number; got {answer!r}") from None
    expected = normalize_number(answer, list_markers=False)  # a reference answer, not a completion: "- 5" is -5
    found = (normalize_number(extract_answer(completion), list_markers=False), normalize_number(completion))
    return CORRECT_REWARD if expected is not None and expected in found else 0.0


def chat_messages(question: str) -> list[dict]:
    """The chat a rollout answers: SYSTEM_PROMPT asking for <think>/<answer>, then the question."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def is_well_formatted(completion: str) -> bool:
    """The whole completion is <think>...</think> <answer>...</answer>, each tag exactly once."""
    return all(completion.count(tag) == 1 for tag in TAGS) and _STRUCTURE.match(completion) is not None


def format_reward(completion: str) -> float:
    """STRUCTURE_REWARD for a well-formatted completion, plus TAG_REWARD for each of the four
    tags that appears exactly once. At most 0.2."""
    tags_once = sum(completion.count(tag) == 1 for tag in TAGS)
    return (STRUCTURE_REWARD if is_well_formatted(completion) else 0.0) + TAG_REWARD * tags_once


def reward(completion: str, answer: str) -> float:
    """The paper's rule-based reward: correctness plus format."""
    return correctness_reward(completion, answer) + format_reward(completion)


if __name__ == "__main__":
    examples = [
        ("<think>48 / 2 = 24, 48 + 24 = 72</think>\n<answer>72</answer>", "72"),
        ("<think>48 + 24</think><answer>$72.00</answer>", "72"),
        ("She sold 48 + 24 = 72 clips.", "72"),
        ("<think>half of 48 is 24</think><answer>24</answer>", "72"),
        ("<think>48 + 24 = 72 so the answer is", "72"),
    ]
    for completion, answer in examples:
        print(f"{reward(completion, answer):.3f}  answer={answer:<4} {completion!r}")
