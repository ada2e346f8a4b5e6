"""The planner with packed documents (``cp_train/plan/inputs/documents.py``, ``--document-lengths``).

- Its attention work per rank equals the kernel area the CP attention executes on the same packed sample, with
  ``document_ids`` (counted at the CPU kernel), in every layout the loader uses, balanced included; its bytes equal
  what the ring and the all-gather send.
- One document as long as the sample plans exactly as no documents at all; shorter documents plan less attention,
  and the MFU counts the pairs inside the documents, as the trainer does.
- The steps the documents shape are varlen calls, timed on the profile's ``varlen_kernel``; the attention is the
  mean over the first samples, not the first sample's alone.
- A bad ``--document-lengths`` is one line.
"""

from __future__ import annotations

import dataclasses

import pytest

from cp_train.cli.plan import main as plan_main
from cp_train.perf.inputs.documents import document_pieces, packed_document_ids, parse_document_lengths
from cp_train.perf.inputs.hardware import HardwareError, from_dict, load_hardware
from cp_train.perf.rates import DeviceRates
from cp_train.perf.time_model import attention_seconds
from cp_train.perf.workload import TIME_SAMPLES, KernelCall, planned_samples
from tests import planner_cases
from tests.perf.test_planner import SEQ, _workload

DOCUMENTS = (5, 19, 2, 30, 12)  # packed: 5, 19, 2, 30 and 8 (cut at the sample's end)
CASES = [(2, "zigzag", "ring"), (4, "balanced", "ring"), (4, "contiguous", "ring"), (4, "stripe", "allgather"),
         (2, "balanced", "allgather"), (4, "zigzag", "ulysses")]


def test_a_sample_packs_the_lengths_in_order_and_cuts_the_last() -> None:
    assert document_pieces(DOCUMENTS, SEQ) == [5, 19, 2, 30, 8]
    assert document_pieces((40,), 100) == [40, 40, 20]
    assert packed_document_ids((2, 1), 5).tolist() == [[0, 0, 1, 2, 2]]


@pytest.mark.parametrize(("cp", "layout", "algorithm"), CASES, ids=lambda x: str(x))
def test_planned_document_work_equals_what_the_attention_runs(spawn_world, cp, layout, algorithm) -> None:
    work = _workload(cp, layout, algorithm, DOCUMENTS)
    (sample,) = planned_samples(DOCUMENTS, SEQ, cp)  # the one sample planned above cp 1: the attention runs it
    answers = spawn_world(cp).run(planner_cases.count_attention, SEQ, layout, algorithm, sample)
    for answer in answers:
        steps = work.attention[answer["rank"]]
        area = sum(call.area for step in steps for call in step.calls) * work.attention_heads * work.batch
        assert answer["area"] == area, (answer, area)
        if algorithm != "ulysses":
            planned = sum(step.send_forward + step.send_backward for step in steps) * work.batch
            assert sum(answer["sent"].values()) == planned, (answer["sent"], planned)
    pairs = sum(c * (c + 1) // 2 for c in sample)
    assert sum(a["area"] for a in answers) == pairs * planner_cases.HEADS * planner_cases.BATCH


def test_varlen_calls_plan_on_the_varlen_kernel_and_the_samples_average() -> None:
    """A sample of several documents runs as varlen calls (the trainer's ``route_by_documents``), timed on the
    profile's ``varlen_kernel`` (an H200's: PyTorch's flash varlen, 1.6x slower than cuDNN in the 1B step's profile,
    2026-11-30); one document stays a dense call on ``attention_kernel``. The attention is the mean over the first
    ``TIME_SAMPLES`` samples at cp 1 (here a dense sample and one of 16 documents in turn); above cp 1 one of them,
    the nearest their mean, is planned (a CP plan per sample and layout would triple a search's time)."""
    h200 = load_hardware("h200")
    flash2, cudnn = DeviceRates(h200), DeviceRates(dataclasses.replace(h200, varlen_kernel=""))
    one, short = _workload(1, "contiguous", "ring", (SEQ,)), _workload(1, "contiguous", "ring", (SEQ // 16,))
    assert not any(c.varlen for c in one.attention[0][0].calls) and all(c.varlen for c in short.attention[0][0].calls)
    assert attention_seconds(one, flash2) == attention_seconds(one, cudnn)
    curves = h200.attention_fraction(planner_cases.DIM, 1.0, True, "cudnn") / h200.attention_fraction(
        planner_cases.DIM, 1.0, True, "flash2")  # both below their first point: the ratio of the first points
    assert attention_seconds(short, flash2)[0] == pytest.approx(curves * attention_seconds(short, cudnn)[0])
    # the trainer's cudnn_ragged: the documents' causal squares as cuDNN calls, their full pieces (cp > 1) varlen
    ragged = DeviceRates(h200, "bf16", "cudnn_ragged")
    assert (ragged.kernel, ragged.varlen_kernel, ragged.ragged) == ("cudnn", "flash2", True)
    assert attention_seconds(short, ragged) == attention_seconds(short, cudnn)  # cp 1: every call a causal square
    ring = _workload(2, "contiguous", "ring", (40, 24))  # cp 2: rank 0's own block is one document, dense
    assert [[c.varlen for step in rank for c in step.calls] for rank in ring.attention] == [[False], [True] * 3]
    assert [[c.causal for step in rank for c in step.calls] for rank in ring.attention] == [[True],
                                                                                             [True, True, False]]
    assert attention_seconds(ring, flash2)[0] > attention_seconds(ring, cudnn)[0]
    assert attention_seconds(ring, cudnn)[0] < attention_seconds(ring, ragged)[0] == attention_seconds(ring, flash2)[0]
    square, piece = (KernelCall(512, 512, True, True), KernelCall(512, 1024, False, True))
    assert ragged.attention(square, 128) == cudnn.attention(square, 128) > flash2.attention(square, 128)
    assert ragged.attention(piece, 128) == flash2.attention(piece, 128) < cudnn.attention(piece, 128)
    mixed = _workload(1, "contiguous", "ring", (SEQ,) + (SEQ // 16,) * 16)
    assert len(mixed.attention_samples) == TIME_SAMPLES
    mean = (attention_seconds(one, flash2)[0] + attention_seconds(short, flash2)[0]) / 2
    assert attention_seconds(mixed, flash2)[0] == pytest.approx(mean, rel=1e-12)
    assert len(_workload(2, "contiguous", "ring", (SEQ,) + (SEQ // 16,) * 16).attention_samples) == 1  # one CP plan
    first = dataclasses.replace(mixed, attention_samples=())  # the first sample alone: what was planned before
    assert attention_seconds(first, flash2) == pytest.approx(attention_seconds(one, flash2), rel=1e-12)
    with pytest.raises(HardwareError, match="varlen_kernel 'fa9' has no attention curve; choose one of cudnn, "):
        from_dict({**h200.to_dict(), "varlen_kernel": "fa9"}, "h200.yaml")


def _plan_json(capsys, *extra: str) -> dict:
    import json

    assert plan_main(["llama3-8b", "--seq-len", "131072", "--gpus", "8", "--cp", "8", "--tp", "1", "--fsdp",
                      "--activation-checkpointing", "full", "--micro-batch", "1", "--cp-algorithm", "ring",
                      "--cp-layout", "zigzag", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[0])


def test_one_document_per_sample_plans_as_none_and_short_ones_plan_less(capsys) -> None:
    plain = _plan_json(capsys)
    whole = _plan_json(capsys, "--document-lengths", "131072")
    assert whole["step_time_s"] == pytest.approx(plain["step_time_s"], rel=1e-12)
    # the documents' count is the mask's pairs, s (s + 1) / 2, where the convention counts s^2 / 2
    assert whole["mfu"] == pytest.approx(plain["mfu"], rel=1e-4)
    short = _plan_json(capsys, "--document-lengths", "4096")
    assert short["breakdown_s"]["attention"] < plain["breakdown_s"]["attention"] / 10
    assert short["breakdown_s"]["matmuls"] == pytest.approx(plain["breakdown_s"]["matmuls"], rel=1e-12)
    # 32 documents of 4096: the attention FLOPs per token are 1/32 of one 131072 document's; the MFU stays a
    # fraction (counting the whole sample's attention it would exceed 1)
    def per_token(record: dict) -> float:
        return record["tflops_per_gpu"]["causal_half"] / record["tokens_per_s_per_gpu"]
    assert per_token(short) < per_token(plain) * 0.6
    assert 0 < short["mfu"]["causal_half"] < 1


@pytest.mark.parametrize(("spec", "message"), [("0", "lengths >= 1"), ("nope.txt", "not a length"),
                                               ("3,x", "not a length")])
def test_bad_document_lengths_are_one_line(capsys, spec, message) -> None:
    assert plan_main(["llama3-8b", "--seq-len", "8192", "--gpus", "8", "--document-lengths", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_a_lengths_file_reads(tmp_path) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("100 200\n300\n")
    assert parse_document_lengths(str(path)) == (100, 200, 300)


def test_an_indexed_datasets_lengths_read_shuffled(tmp_path) -> None:
    from cp_train.data.indexed import IndexedDatasetWriter

    writer = IndexedDatasetWriter(tmp_path / "docs")
    for length in (3, 5, 7, 11):
        writer.add_document(list(range(length)))
    writer.finalize()
    lengths = parse_document_lengths(str(tmp_path / "docs"))
    assert sorted(lengths) == [3, 5, 7, 11] and lengths == parse_document_lengths(str(tmp_path / "docs"))
