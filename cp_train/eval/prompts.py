"""The token sequences of the retrieval tasks, built with the run's tokenizer.

- ``passkey``: Landmark's format: the task line, filler sentences ("The grass is green. ..."), the needle
  "The pass key is {k}. Remember it. {k} is the pass key." at a depth, more filler, then the question
  "What is the pass key? The pass key is" and the key itself (scored).
- ``niah``: gkamradt's needle sentence ("The best thing to do in San Francisco is eat a sandwich and sit in
  Dolores Park on a sunny day.") at a sentence boundary of a haystack of real text (the run's data), then the
  question and the needle's answer span (scored).

Every prompt is exactly ``length`` tokens: the filler fills what the fixed parts leave, and the needle goes
at the last sentence boundary at or before ``depth`` (0: first, 1: last) of the filler. ``answer`` is the
``[start, end)`` token span the score reads (teacher forced: the positions before it predict it).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cp_train.errors import InputError

TASK_LINE = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
             "I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
PASSKEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"
MAX_KEY = 50000  # Landmark draws the key from 1..50000
NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
NEEDLE_QUESTION = "What is the best thing to do in San Francisco? The best thing to do in San Francisco is"
NEEDLE_ANSWER = " eat a sandwich and sit in Dolores Park on a sunny day."


class TextTokenizer(Protocol):
    """What the prompts need of a tokenizer (``cp_train.data.tokenizers``' both kinds have it)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Prompt:
    """``tokens`` (exactly the length asked), the scored ``answer`` span ``[start, end)`` and where the needle
    starts (``needle``)."""

    tokens: list[int]
    answer: tuple[int, int]
    needle: int


def _place(head: list[int], filler: list[int], boundaries: Sequence[int], needle: list[int], tail: list[int],
           answer: list[int], depth: float) -> Prompt:
    """``head + filler[:b] + needle + filler[b:] + tail + answer`` with ``b`` the last boundary at or before
    ``depth`` of the filler (``boundaries`` ascending, starting at 0)."""
    target = round(depth * len(filler))
    cut = max(b for b in boundaries if b <= target)
    tokens = head + filler[:cut] + needle + filler[cut:] + tail + answer
    return Prompt(tokens, (len(tokens) - len(answer), len(tokens)), len(head) + cut)


def _room(task: str, length: int, fixed: int, unit: int) -> int:
    """Tokens left for the filler; ``InputError`` when not even one filler sentence (``unit`` tokens) fits."""
    room = length - fixed
    if room < unit:
        raise InputError(f"{task} at length {length}: this tokenizer's task, needle, question and answer take {fixed} "
                         f"tokens, leaving {max(room, 0)} for filler, which needs at least {unit}; evaluate at "
                         f"--lengths of at least {fixed + unit}")
    return room


def passkey_key(seed: int, length: int, depth: float, trial: int) -> int:
    """The pass key of one trial: drawn from 1..50000 by (seed, length, depth, trial) alone."""
    return random.Random(f"passkey-{seed}-{length}-{depth}-{trial}").randint(1, MAX_KEY)


def passkey_prompt(tokenizer: TextTokenizer, length: int, depth: float, key: int) -> Prompt:
    """Landmark's passkey prompt of exactly ``length`` tokens with ``key`` at ``depth``; the answer is the key."""
    sentences = [tokenizer.encode(" " + s if i else s) for i, s in enumerate(FILLER)]
    head = tokenizer.encode(TASK_LINE + "\n")
    needle = tokenizer.encode("\n" + PASSKEY_LINE.format(key=key) + "\n")
    tail = tokenizer.encode("\n" + PASSKEY_QUESTION)
    answer = tokenizer.encode(f" {key}")
    room = _room("passkey", length, len(head) + len(needle) + len(tail) + len(answer), min(map(len, sentences)))
    filler, boundaries = [], []
    while len(filler) < room:
        for sentence in sentences:
            boundaries.append(len(filler))
            filler.extend(sentence)
    return _place(head, filler[:room], [b for b in boundaries if b <= room], needle, tail, answer, depth)


class Haystack:
    """Real text to hide a needle in: the token stream of an indexed dataset's documents and the positions
    after a sentence end (a token whose text ends in ".", "!", "?" or a newline)."""

    def __init__(self, tokens: np.ndarray, tokenizer: TextTokenizer) -> None:
        if tokens.size == 0:
            raise InputError("the haystack's documents are empty: pass another --haystack (an indexed dataset)")
        self.tokens = np.asarray(tokens, dtype=np.int64)
        ids = np.unique(self.tokens)
        ends = {int(i) for i in ids if tokenizer.decode([int(i)]).rstrip(" ").endswith((".", "!", "?", "\n"))}
        self.after_end = np.isin(self.tokens, np.fromiter(ends, dtype=np.int64, count=len(ends)))

    def window(self, start: int, size: int) -> tuple[list[int], list[int]]:
        """``size`` tokens from ``start`` (wrapping around) and the sentence starts among them (0 included)."""
        index = (start + np.arange(size)) % self.tokens.size
        starts = [0] + [int(i) + 1 for i in np.flatnonzero(self.after_end[index][:-1])]
        return self.tokens[index].tolist(), starts


def niah_prompt(tokenizer: TextTokenizer, haystack: Haystack, length: int, depth: float, trial_seed: str) -> Prompt:
    """gkamradt's needle at a sentence boundary near ``depth`` of a haystack window drawn by ``trial_seed``;
    the answer is the needle's span after "...in San Francisco is"."""
    needle = tokenizer.encode("\n" + NEEDLE + "\n")
    tail = tokenizer.encode("\n\n" + NEEDLE_QUESTION)
    answer = tokenizer.encode(NEEDLE_ANSWER)
    room = _room("niah", length, len(needle) + len(tail) + len(answer), 1)
    start = random.Random(f"niah-{trial_seed}").randrange(haystack.tokens.size)
    filler, boundaries = haystack.window(start, room)
    return _place([], filler, boundaries, needle, tail, answer, depth)
