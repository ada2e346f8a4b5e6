"""The trainer reads nothing from the device between log steps, and what it logs is what it logged reading
every step.

On a GPU a read of a device tensor (``item``, ``tolist``, ``bool``/``float``/``int`` of a tensor) stalls the
CPU until the device catches up. On CPU nothing stalls, so the tests count the calls instead
(``tests.parallel.test_host_syncs``'s methods): in a run of the tiny model with ``logging.interval`` 4 every step
but the log steps, an evaluation step and the first (its setup record gathers every rank's sizes once) must
read nothing; the loader's own reads (on the CPU, in its workers in a real run) are not counted, nor the per-step
agreement on a stop signal, a host tensor of the gloo host group read as a numpy array (never on a GPU). The
optimizer is fused AdamW, the default (foreach AdamW reads its CPU step counters with ``item``). The
losses, gradient norms, evaluations and metrics records must be bitwise those of the same run logging every
step, and a step that diverged between log steps must still stop the run, named.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cp_train.metrics.step_scalars import DeviceBatch, DeviceStep, UnreadSteps
from cp_train.metrics.writers import METRICS_FILE
from cp_train.optim import clip_gradients, global_grad_norm
from cp_train.parallel.mesh.state import ParallelState, run_with_parallel
from cp_train.results import NonFiniteLossError
from cp_train.trainer import Trainer
from tests import trainer_cases
from tests.parallel.test_host_syncs import METHODS, counting_syncs

STEPS, INTERVAL, EVAL_AT = 8, 4, 6
LOGGED = {4, 8}
READ = LOGGED | {1, EVAL_AT}  # log steps, the evaluation step, and the first (the setup record)
OVERRIDES = {"train.steps": STEPS, "train.valid_interval": EVAL_AT, "optimizer.implementation": "fused"}


class _CountingLoader:
    """A trainer's loader whose every batch starts a new entry of ``per_step``; tensor reads while a batch
    is loaded are not counted (``paused``)."""

    def __init__(self, inner: Any, per_step: list[Counter[str]], paused: list[bool]) -> None:
        self.inner, self.per_step, self.paused = inner, per_step, paused

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.inner)
        while True:
            self.paused[0] = True
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                self.paused[0] = False
            self.per_step.append(Counter())
            yield batch


def _train(state: ParallelState, prefix: str, run_dir: str, interval: int, count: bool) -> dict[str, Any]:
    """The tiny run with ``logging.interval`` ``interval``: its losses, gradient norms, evaluations, train
    records (rank 0) and, with ``count``, the tensor reads of each step (entry 0: before the first batch)."""
    config = trainer_cases.tiny_config(prefix, run_dir, state.dims, **{**OVERRIDES, "logging.interval": interval})
    trainer = Trainer(config, state)
    per_step: list[Counter[str]] = [Counter()]
    paused = [False]
    trainer.data = dataclasses.replace(trainer.data, loader=_CountingLoader(trainer.data.loader, per_step, paused))
    saved = {name: torch.Tensor.__dict__.get(name) for name in METHODS}

    def counted(name: str, method: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not paused[0]:
                per_step[-1][name] += 1
            return method(*args, **kwargs)
        return wrapper

    if count:
        for name in METHODS:
            setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    try:
        result = trainer.train()
    finally:
        for name, method in saved.items() if count else ():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
    records = []
    if state.rank == 0:
        lines = (Path(run_dir) / METRICS_FILE).read_text().splitlines()
        records = [record for record in map(json.loads, lines) if record.get("kind") == "train"]
    return {"reads": [dict(c) for c in per_step], "losses": result.losses, "grad_norms": result.grad_norms,
            "eval_losses": result.eval_losses, "records": records}


def _train_both(state: ParallelState, prefix: str, run_dir: str) -> dict[str, dict[str, Any]]:
    return {"every": _train(state, prefix, f"{run_dir}/every", 1, count=False),
            "interval": _train(state, prefix, f"{run_dir}/interval", INTERVAL, count=True)}


def _train_until_nan(state: ParallelState, prefix: str, run_dir: str, nan_step: int) -> str:
    """The run with ``logging.interval`` 4 and every token loss NaN at ``nan_step``; the error it raised."""
    config = trainer_cases.tiny_config(prefix, run_dir, state.dims, **{**OVERRIDES, "logging.interval": INTERVAL})
    trainer = Trainer(config, state)
    forward = trainer.model.forward

    def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:
        losses = forward(*args, **kwargs)
        return losses * float("nan") if trainer.step + 1 == nan_step else losses

    trainer.model.forward = poisoned  # type: ignore[method-assign]
    try:
        trainer.train()
    except NonFiniteLossError as error:
        return f"{error} (after {len(trainer.result.losses)} steps, at step {trainer.step})"
    return "no error"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainer_cases.write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.fixture(scope="module")
def runs(spawn_world, corpus, tmp_path_factory) -> list[dict[str, dict[str, Any]]]:
    """Every rank's answer of ``_train_both`` at cp 2 (per-document masks: the attention pairs are summed)."""
    root = tmp_path_factory.mktemp("runs")
    return spawn_world(2).run(run_with_parallel, (1, 2, 1), _train_both, corpus, str(root))


def test_counters_count() -> None:
    x = torch.ones(2)
    with counting_syncs() as counts:
        for read in (lambda: x[0].item(), x.tolist, lambda: bool(x[0]), lambda: float(x[0]), lambda: int(x[0])):
            read()
    assert all(counts[name] == 1 for name in ("item", "tolist", "__bool__", "__float__", "__int__")), counts


def test_no_read_between_log_steps(runs) -> None:
    for rank, answer in enumerate(runs):
        reads = answer["interval"]["reads"]
        assert len(reads) == STEPS + 1, reads
        quiet = {step: reads[step] for step in range(1, STEPS + 1) if step not in READ}
        assert quiet and not any(quiet.values()), (rank, quiet)
        assert all(reads[step] for step in LOGGED), (rank, reads)  # the log steps do read: the counters count


def test_results_are_those_of_reading_every_step(runs) -> None:
    for answer in runs:
        every, interval = answer["every"], answer["interval"]
        assert sorted(interval["losses"]) == list(range(1, STEPS + 1))
        for key in ("losses", "grad_norms", "eval_losses"):
            assert interval[key] == every[key], key
        assert sorted(interval["eval_losses"]) == [EVAL_AT, STEPS]


def test_log_records_hold_what_every_step_logged(runs) -> None:
    every = {record["step"]: record for record in runs[0]["every"]["records"]}
    records = runs[0]["interval"]["records"]
    assert [record["step"] for record in records] == sorted(LOGGED) and sorted(every) == list(range(1, STEPS + 1))
    timing = {"tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "step_time_s", "data_time_s",
              "peak_memory_gib", "time", "tflops_per_device_dense", "mfu_dense", "step_time_max_s",
              "peak_memory_max_gib", "peak_memory_pct"}
    for record in records:
        steps = range(record["step"] - INTERVAL + 1, record["step"] + 1)
        mean_loss, imbalance = 0.0, 0.0
        for step in steps:  # as IntervalMeter sums them
            mean_loss, imbalance = mean_loss + every[step]["loss"], imbalance + every[step]["attention_imbalance"]
        ref = every[record["step"]]
        assert record.keys() == ref.keys()
        assert record["loss"] == mean_loss / INTERVAL and record["attention_imbalance"] == imbalance / INTERVAL
        same = {key for key in record if key not in timing | {"loss", "attention_imbalance"}}
        assert same >= {"grad_norm", "lr", "consumed_samples", "consumed_tokens", "step"}
        assert {key: record[key] for key in same} == {key: ref[key] for key in same}
        assert all(record[key] > 0 for key in ("tokens_per_s", "tflops_per_device", "step_time_s"))


def test_divergence_between_log_steps_stops_the_run_named(spawn_world, corpus, tmp_path) -> None:
    errors = spawn_world(2).run(run_with_parallel, (1, 2, 1), _train_until_nan, corpus, str(tmp_path), 2)
    assert all(error.startswith("loss is nan at step 2: stopping the run after the updates of steps 2 to 3, "
                                "which no checkpoint holds") for error in errors), errors
    assert all(error.endswith("(after 1 steps, at step 3)") for error in errors), errors


def test_step_scalars_are_read_once_for_many_steps() -> None:
    unread = UnreadSteps()
    for step in (1, 2, 3):
        value = torch.tensor(float(step), dtype=torch.float64)
        batch = DeviceBatch(loss=value, tokens=value * 10, local_tokens=5.0, local_loss_sum=value, imbalance=1.5)
        unread.add(DeviceStep.of(step, 0.1 * step, batch, value.float() * 2, None if step == 2 else value * 3))
    with counting_syncs() as counts:
        read = unread.read()
    assert dict(counts) == {"tolist": 1} and len(unread) == 0 and unread.read() == []
    assert [(step, out.loss, out.grad_norm, out.loss_tokens, out.attention_pairs) for step, out in read] == [
        (1, 1.0, 2.0, 10.0, 3.0), (2, 2.0, 4.0, 20.0, None), (3, 3.0, 6.0, 30.0, 9.0)]


@pytest.mark.parametrize("factor", [2.0, 1.0, 0.5, 0.1])
def test_clipping_reads_nothing_and_matches_the_host_coefficient(factor: float) -> None:
    """The coefficient computed on the device gives bitwise the gradients of the one computed on the host."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.zeros(shape)) for shape in ((7,), (3, 5), (2, 2, 2))]
    for param in params:
        param.grad = torch.randn(param.shape, generator=gen)
    grads = [param.grad.clone() for param in params]
    max_norm = factor * float(global_grad_norm(params, None))
    with counting_syncs() as counts:
        norm = global_grad_norm(params, None)
        clip_gradients(params, max_norm, norm)
    assert not counts, counts
    coefficient = max_norm / (float(norm) + 1e-6)  # what clipping on the host computed
    if coefficient < 1.0:
        torch._foreach_mul_(grads, coefficient)
    assert (coefficient < 1.0) == (factor < 2.0)
    assert all(torch.equal(param.grad, grad) for param, grad in zip(params, grads, strict=True))
