"""Templated multi-turn dialogues written for this project (no third-party text; license-clean).

The answers follow from the questions by fixed rules (arithmetic, counting, spelling, calendars, unit
conversions, lists), so a small model can learn them and a draft can learn to predict that model.
The bundled data (eagle3/bundled/conversations.jsonl) is ``generate(300, seed=0)``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
WORDS = [
    "river",
    "garden",
    "window",
    "planet",
    "silver",
    "forest",
    "candle",
    "bridge",
    "market",
    "yellow",
    "puzzle",
    "rocket",
    "meadow",
    "harbor",
    "pencil",
    "orange",
    "valley",
    "castle",
    "thunder",
    "blanket",
]
COLORS = ["red", "orange", "yellow", "green", "blue", "indigo", "violet"]
ANIMALS = {"cat": "meow", "dog": "woof", "cow": "moo", "duck": "quack", "sheep": "baa", "owl": "hoot"}
NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]
SYSTEM = "You are a helpful assistant. Answer briefly and exactly."


def _arith(r: random.Random) -> list[tuple[str, str]]:
    a, b = r.randint(2, 99), r.randint(2, 99)
    turns = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.")]
    if r.random() < 0.6:
        c = r.randint(2, 9)
        turns.append((f"And what is that times {c}?", f"{a + b} times {c} is {(a + b) * c}."))
    if r.random() < 0.4:
        d = r.randint(1, a + b)
        turns.append((f"Now subtract {d} from {a + b}.", f"{a + b} minus {d} is {a + b - d}."))
    return turns


def _count(r: random.Random) -> list[tuple[str, str]]:
    a = r.randint(1, 30)
    b = a + r.randint(3, 12)
    turns = [(f"Count from {a} to {b}.", ", ".join(str(i) for i in range(a, b + 1)) + ".")]
    if r.random() < 0.5:
        turns.append(("Now count back down.", ", ".join(str(i) for i in range(b, a - 1, -1)) + "."))
    return turns


def _spell(r: random.Random) -> list[tuple[str, str]]:
    w = r.choice(WORDS)
    turns = [(f"Spell the word {w} letter by letter.", "-".join(w.upper()) + ".")]
    if r.random() < 0.6:
        turns.append(("Now write it backwards.", f"Backwards, {w} is {w[::-1]}."))
    if r.random() < 0.4:
        turns.append(("How many letters does it have?", f"The word {w} has {NUMBER_WORDS[len(w)]} letters."))
    return turns


def _calendar(r: random.Random) -> list[tuple[str, str]]:
    if r.random() < 0.5:
        i = r.randrange(7)
        n = r.randint(1, 5)
        return [
            (f"What day comes after {DAYS[i]}?", f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."),
            (
                f"And {n} days after {DAYS[i]}?",
                f"{NUMBER_WORDS[n].capitalize()} days after {DAYS[i]} is {DAYS[(i + n) % 7]}.",
            ),
        ]
    i = r.randrange(12)
    return [
        (f"Which month follows {MONTHS[i]}?", f"{MONTHS[(i + 1) % 12]} follows {MONTHS[i]}."),
        ("List the next three months after that.", ", ".join(MONTHS[(i + k) % 12] for k in (2, 3, 4)) + "."),
    ]


def _units(r: random.Random) -> list[tuple[str, str]]:
    kind = r.choice(["hours", "meters", "kilograms"])
    n = r.randint(2, 40)
    if kind == "hours":
        return [(f"How many minutes are in {n} hours?", f"{n} hours is {n * 60} minutes.")]
    if kind == "meters":
        return [(f"Convert {n} meters to centimeters.", f"{n} meters is {n * 100} centimeters.")]
    return [(f"How many grams are in {n} kilograms?", f"{n} kilograms is {n * 1000} grams.")]


def _lists(r: random.Random) -> list[tuple[str, str]]:
    if r.random() < 0.5:
        k = r.randint(3, 7)
        return [(f"Name the first {NUMBER_WORDS[k]} colors of the rainbow.", ", ".join(COLORS[:k]) + ".")]
    animal = r.choice(sorted(ANIMALS))
    return [
        (f"What sound does a {animal} make?", f"A {animal} says {ANIMALS[animal]}."),
        ("Say it three times.", " ".join([ANIMALS[animal].capitalize() + "!"] * 3)),
    ]


def _words(r: random.Random) -> list[tuple[str, str]]:
    n = r.randint(0, 20)
    turns = [(f"Write the number {n} in words.", f"{n} is written {NUMBER_WORDS[n]}.")]
    if n < 20 and r.random() < 0.5:
        turns.append(("And the number after it?", f"{n + 1} is written {NUMBER_WORDS[n + 1]}."))
    return turns


TOPICS: list[Callable[[random.Random], list[tuple[str, str]]]] = [
    _arith,
    _count,
    _spell,
    _calendar,
    _units,
    _lists,
    _words,
]


def conversation(r: random.Random) -> dict:
    """One conversation: optional system turn, then 1-3 topics of user/assistant turns."""
    messages = [{"role": "system", "content": SYSTEM}] if r.random() < 0.5 else []
    for _ in range(r.choice([1, 1, 2, 3])):
        for user, assistant in r.choice(TOPICS)(r):
            messages.append({"role": "user", "content": user})
            messages.append({"role": "assistant", "content": assistant})
    return {"messages": messages}


def generate(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    return [conversation(r) for _ in range(n)]


def write_jsonl(path: str | Path, conversations: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for c in conversations:
            f.write(json.dumps(c) + "\n")
    return path


BUNDLED = Path(__file__).parents[1] / "bundled" / "conversations.jsonl"
