"""The planner's pruned search (``cp_train/perf/search.py``) against the exhaustive one.

Every valid layout of a small search (gpt-1b on 4 GPUs, with and without packed documents, at a reserve that puts
the fit boundary inside the space) is predicted; then:

- the orders the pruning relies on hold on every group: full checkpointing needs no more memory than any other
  setting of its micro-batch, a smaller accumulating micro-batch no more than a larger one, and no checkpointing
  with one MLP chunk is the fastest of its micro-batch;
- the pruned search predicts only fitting layouts, misses none that fits unless a layout of its group and
  micro-batch at least as fast fits, prunes as "cannot fit" exactly the layouts that do not fit, and ranks the same
  best layout;
- the progress callback and ``max_seconds`` (also through ``cp-train-plan --max-seconds``) report and stop.
"""

from __future__ import annotations

import argparse
import gc
import re
from collections import defaultdict

import pytest

from cp_train.cli.plan import base_config, build_parser, choices_of
from cp_train.cli.plan import main as plan_main
from cp_train.config.schema import ConfigError
from cp_train.config.validate import validate
from cp_train.memory.dry_run import reserve_gib
from cp_train.perf.inputs.documents import parse_document_lengths
from cp_train.perf.inputs.hardware import load_hardware
from cp_train.perf.predict import Prediction, predict
from cp_train.perf.rates import DeviceRates
from cp_train.perf.search import candidates, layout_name, search, state_bound_gib

GPUS = 4
ARGV = ["gpt-1b", "--seq-len", "32768", "--gpus", str(GPUS), "--reserve-gib", "50"]
CASES = {"one document": [], "packed documents": ["--document-lengths", "3000", "--cp-algorithm", "ring", "--cp", "4"]}


def _setting(args: argparse.Namespace):  # noqa: ANN202 - (base, rates, peak, device GiB, reserve, documents)
    hardware = load_hardware(args.hardware)
    reserve = reserve_gib(hardware.hbm_gib, args.reserve_gib, args.reserve_fraction)
    documents = parse_document_lengths(args.document_lengths) if args.document_lengths else None
    return (base_config(args), DeviceRates(hardware, "bf16", None), hardware.peak_tflops("bf16"), hardware.hbm_gib,
            reserve, documents)


def _key(p: Prediction) -> tuple:
    c = p.config
    return layout_name(c), c.parallel.ulysses_size, c.parallel.cp_layout


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def exhaustive(request) -> dict:
    """Every valid layout predicted, and the pruned search's result, for one case."""
    args = build_parser().parse_args(ARGV + CASES[request.param])
    base, rates, peak, device, reserve, documents = _setting(args)
    every = []
    for config in candidates(base, GPUS, rates.gpus_per_node, choices_of(args), documents is not None):
        try:
            validate(config, GPUS)
        except ConfigError:
            continue
        every.append(predict(config, GPUS, rates, peak, device, reserve, documents))
    pruned = search(base, GPUS, rates, peak, device, reserve, choices_of(args), documents)
    return {"every": every, "pruned": pruned}


def test_the_orders_the_pruning_relies_on_hold(exhaustive) -> None:
    by_micro: dict[tuple, dict[tuple[str, int], Prediction]] = defaultdict(dict)
    for p in exhaustive["every"]:
        c = p.config
        group = (c.parallel.tp, c.parallel.cp, c.parallel.cp_algorithm, c.parallel.ulysses_size,
                 c.parallel.cp_layout, c.parallel.fsdp)
        by_micro[group, c.train.micro_batch_size][c.model.activation_checkpointing, c.model.mlp_chunks] = p
        assert state_bound_gib(c, GPUS) <= p.memory_gib["total"], layout_name(c)
    assert len(by_micro) > 20
    samples = exhaustive["every"][0].config.train.global_batch_size
    for (group, micro), settings in by_micro.items():
        full = settings["full", 1].memory_gib["total"]
        assert all(full <= p.memory_gib["total"] for p in settings.values()), (group, micro)
        fastest = settings["none", 1].step_time_s
        assert all(fastest <= p.step_time_s for p in settings.values()), (group, micro)
        dp = settings["full", 1].config.parallel.dp
        larger = [m for g, m in by_micro if g == group and micro < m and m * dp < samples]  # both accumulate
        if micro * dp < samples:
            for m in larger:
                for setting, p in settings.items():
                    assert p.memory_gib["total"] <= by_micro[group, m][setting].memory_gib["total"], (group, micro)


def test_the_pruned_search_keeps_every_fitting_layout_it_does_not_beat(exhaustive) -> None:
    every, result = exhaustive["every"], exhaustive["pruned"]
    fitting = {_key(p): p for p in every if p.fits}
    assert 0 < len(fitting) < len(every), "the reserve puts the fit boundary inside the space"
    kept = {_key(p): p for p in result.ranked}
    assert all(p.fits for p in result.ranked) and set(kept) <= set(fitting)
    assert result.pruned["cannot fit"] == len(every) - len(fitting)
    assert result.pruned["dominated"] == len(fitting) - len(kept) > 0
    for key, p in fitting.items():
        if key in kept:
            assert kept[key].step_time_s == p.step_time_s
            continue
        c = p.config
        rivals = [q for q in result.ranked if (q.config.parallel, q.config.train.micro_batch_size) ==
                  (c.parallel, c.train.micro_batch_size)]
        assert rivals and min(q.step_time_s for q in rivals) <= p.step_time_s, key
    best = max(fitting.values(), key=lambda p: p.tokens_per_s_per_gpu)
    assert result.ranked[0].tokens_per_s_per_gpu == best.tokens_per_s_per_gpu
    assert result.evaluated == result.total == len(every) and not result.stopped
    assert re.fullmatch(rf"{len(every)} layouts: 0 refused by the trainer, \d+ cannot fit, \d+ slower than one that "
                        rf"fits, {len(kept)} predicted, {len(kept)} fit", result.summary())


def test_when_none_fits_the_nearest_are_predicted() -> None:
    args = build_parser().parse_args(["gpt-1b", "--seq-len", "32768", "--gpus", str(GPUS), "--reserve-gib", "78",
                                      "--cp-layout", "zigzag", "--cp-algorithm", "ring"])
    base, rates, peak, device, reserve, _ = _setting(args)
    result = search(base, GPUS, rates, peak, device, reserve, choices_of(args), keep=3)
    assert result.pruned["cannot fit"] == result.total and len(result.ranked) == 3
    needs = [p.memory_gib["total"] for p in result.ranked]
    assert not any(p.fits for p in result.ranked) and needs == sorted(needs)


def test_progress_lines_and_the_time_limit(capsys) -> None:
    args = build_parser().parse_args(ARGV)
    base, rates, peak, device, reserve, _ = _setting(args)
    seen = []
    result = search(base, GPUS, rates, peak, device, reserve, choices_of(args), progress=lambda r: seen.append(
        (r.progress_line(), gc.isenabled())), progress_every_s=0.0, max_seconds=0.0)
    assert result.stopped and 0 < result.evaluated < result.total and len(seen) == 1
    (line, collecting), = seen
    assert not collecting and gc.isenabled(), "the search runs without the cyclic collector and restores it"
    seen = [line]
    assert re.fullmatch(rf"searched {result.evaluated}/{result.total} layouts in \d+ s; (none fits yet|best so far "
                        r"[\d,]+ tokens/s per GPU \(tp \d .*\))", seen[0]), seen
    assert plan_main([*ARGV, "--max-seconds", "0", "--top", "2"]) == 0
    captured = capsys.readouterr()
    assert re.search(rf"cp-train-plan: stopped by --max-seconds 0: \d+ of {result.total} layouts searched; the best "
                     r"found so far follow", captured.err), captured.err
    assert re.search(rf"\d+ of {result.total} layouts searched: ", captured.out), captured.out
