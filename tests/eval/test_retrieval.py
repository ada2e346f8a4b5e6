"""A hand-wired one-layer retrieval model through ``cp-train-eval``'s own prompts and scoring (issue 33, test 2).

A toy tokenizer gives every digit of a number a token of its place (the j-th digit of a run: class j) and
every word of the needle's answer phrase a token of its place in the phrase; other words get one id each.
The model: one-hot embeddings (no RoPE), one attention head (``context_parallel_attention``) whose query,
from the token before an answer token, points at the keys of the answer token's class (logit 30), values
the one-hot tokens, logits 10 x the output. So the prediction at an answer position is the needle's token
there, wherever the needle is: passkey and needle accuracy 1.0 at cp 1 and cp 4 (zigzag, needles on every
rank). With the ring's remote steps dropped (a mutant patched into the spawned worker) it falls to chance.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from cp_train.eval.prompts import (
    FILLER,
    NEEDLE,
    NEEDLE_ANSWER,
    NEEDLE_QUESTION,
    PASSKEY_LINE,
    PASSKEY_QUESTION,
    TASK_LINE,
    Haystack,
)
from cp_train.eval.scoring import EvalGroups, LocalBatch
from cp_train.eval.tasks import EvalContext, EvalSettings, prompt_of, run_tasks
from cp_train.parallel.cp.attention import context_parallel_attention
from cp_train.parallel.cp.layout import sequence_positions
from tests.eval.test_attention import ring_without_remote_steps

PLACES = 5  # digits of a pass key (1..50000)
PHRASE = NEEDLE_ANSWER.strip()
PIECE = re.compile(r"\d+|\w+|[^\w\s]|\n")
LENGTH = 320
DEPTHS = [i / 7 for i in range(8)]


def _pieces(text: str) -> list[str]:
    return PIECE.findall(text)


class ToyTokenizer:
    """Digits by place, the answer phrase by place, every other piece (word, punctuation, newline) one id."""

    def __init__(self) -> None:
        texts = [TASK_LINE, *FILLER, PASSKEY_LINE, PASSKEY_QUESTION, NEEDLE, NEEDLE_QUESTION]
        words = sorted({p for t in texts for p in _pieces(t) if not p.isdigit() and p not in "{}"} | {"key", "\n"})
        self.phrase = _pieces(PHRASE)
        self.digit_base = len(words)
        self.phrase_base = self.digit_base + 10 * PLACES
        self.vocab = self.phrase_base + len(self.phrase)
        self.ids = {w: i for i, w in enumerate(words)}
        self.text = {**{i: w for w, i in self.ids.items()},
                     **{self.digit_base + 10 * j + d: str(d) for j in range(PLACES) for d in range(10)},
                     **{self.phrase_base + i: w for i, w in enumerate(self.phrase)}}

    def encode(self, text: str) -> list[int]:
        out = []
        for part in re.split(f"({re.escape(PHRASE)})", text):
            if part == PHRASE:
                out += [self.phrase_base + i for i in range(len(self.phrase))]
                continue
            for piece in _pieces(part):
                if piece.isdigit():
                    out += [self.digit_base + 10 * j + int(c) for j, c in enumerate(piece)]
                else:
                    out.append(self.ids[piece])
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.text[int(i)] for i in ids)


class HandWired:
    """The one-layer retrieval model as an eval ``Forward`` (logits ``[B, n, vocab]``)."""

    def __init__(self, tok: ToyTokenizer, group: dist.ProcessGroup | None, layout: str) -> None:
        self.group, self.layout, vocab = group, layout, tok.vocab
        self.wq = torch.zeros(vocab, vocab, dtype=torch.float64)
        self.wk = torch.zeros(vocab, vocab, dtype=torch.float64)
        self.one_hot = torch.eye(vocab, dtype=torch.float64)  # the embedding; the values are the tokens themselves
        place = lambda j: j  # the direction a digit class j's keys take  # noqa: E731
        phrase = lambda i: PLACES + i  # noqa: E731
        self.wq[tok.ids["is"], place(0)] = self.wq[tok.ids["is"], phrase(0)] = 30.0
        for j in range(PLACES):
            for d in range(10):
                self.wk[tok.digit_base + 10 * j + d, place(j)] = 1.0
                if j + 1 < PLACES:
                    self.wq[tok.digit_base + 10 * j + d, place(j + 1)] = 30.0
        for i in range(len(tok.phrase)):
            self.wk[tok.phrase_base + i, phrase(i)] = 1.0
            if i + 1 < len(tok.phrase):
                self.wq[tok.phrase_base + i, phrase(i + 1)] = 30.0

    def __call__(self, batch: LocalBatch) -> torch.Tensor:
        q, k, x = self.wq[batch.tokens], self.wk[batch.tokens], self.one_hot[batch.tokens]  # rows of W: x @ W
        out = context_parallel_attention(q[:, :, None], k[:, :, None], x[:, :, None], self.group, self.layout, True,
                                         softmax_scale=1.0)
        return 10.0 * out[:, :, 0]


def haystack(tok: ToyTokenizer) -> Haystack:
    return Haystack(np.array(tok.encode(" ".join(FILLER * 200))), tok)


def evaluate_on_rank(mutant: bool = False) -> dict:
    """Passkey and niah accuracy of the hand-wired model on this world (zigzag), and the CP ranks that held
    each trial's first needle token."""
    tok = ToyTokenizer()
    world = dist.get_world_size() if dist.is_initialized() else 1
    group = dist.group.WORLD if world > 1 else None
    layout = "zigzag" if world > 1 else "contiguous"
    groups = EvalGroups(layout, cp=group)
    context = EvalContext(forward=HandWired(tok, group, layout), groups=groups, tokenizer=tok,
                          haystack=lambda: haystack(tok))
    settings = EvalSettings(tasks=["passkey", "niah"], lengths=[LENGTH], depths=DEPTHS, trials=1, seed=3)
    owner = torch.empty(LENGTH, dtype=torch.long)
    for rank in range(world):
        owner[sequence_positions(LENGTH, rank, world, layout)] = rank
    first = {"passkey": 5, "niah": 10}  # the needle's first scored token: the key's first digit, "eat"
    ranks = {task: sorted({int(owner[prompt_of(task, context, 3, LENGTH, d, 0).needle + first[task]])
                           for d in DEPTHS}) for task in first}
    with ring_without_remote_steps() if mutant else contextlib.nullcontext():
        records = run_tasks(settings, context)
    accuracy = {task: sum(r["accuracy"] for r in records if r["task"] == task) / len(DEPTHS)
                for task in ("passkey", "niah")}
    return {"accuracy": accuracy, "needle_ranks": ranks, "records": records}


def test_hand_wired_retrieval_at_cp1() -> None:
    got = evaluate_on_rank()
    assert got["accuracy"] == {"passkey": 1.0, "niah": 1.0}, got["records"]


def test_hand_wired_retrieval_at_cp4_and_without_remote_kv(spawn_world) -> None:
    world = spawn_world(4)
    got = world.run(evaluate_on_rank)
    assert all(g["records"] == got[0]["records"] for g in got), "ranks disagree"
    assert got[0]["accuracy"] == {"passkey": 1.0, "niah": 1.0}, got[0]["records"]
    assert got[0]["needle_ranks"] == {"passkey": [0, 1, 2, 3], "niah": [0, 1, 2, 3]}
    dropped = world.run(evaluate_on_rank, mutant=True)[0]["accuracy"]
    assert dropped["passkey"] <= 0.25 and dropped["niah"] <= 0.25, dropped
