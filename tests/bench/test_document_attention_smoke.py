"""``bench.document_attention`` runs its cases on CPU (the GPU's comparison is cudnn against cudnn_ragged)."""

from __future__ import annotations

from bench import document_attention


def test_every_backend_and_the_one_document_case_are_timed() -> None:
    records = document_attention.main(["--device", "cpu", "--dtype", "float32", "--seqlen", "256", "--heads", "4",
                                       "--kv-heads", "2", "--head-dim", "16", "--backends", "torch,math",
                                       "--documents", "lognormal", "--median", "48", "--samples", "2",
                                       "--warmup", "1", "--rounds", "1"])
    assert [r["backend"] for r in records] == ["torch", "math", "one document"]
    assert records[0]["vs_first"] == 1.0 and all(r["ms"] > 0 and r["tflops"] >= 0 for r in records)
    assert records[0]["documents_per_sample"] > 2 and records[2]["documents_per_sample"] == 1


def test_a_backend_that_cannot_run_is_said_and_left_out(capsys, monkeypatch) -> None:
    """``cudnn_ragged`` on the CPU (no CUDA): one JSON line saying why, the other backends timed all the same."""
    monkeypatch.delenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", raising=False)  # the bench sets it: unset after
    records = document_attention.main(["--device", "cpu", "--dtype", "float32", "--seqlen", "128", "--heads", "4",
                                       "--kv-heads", "2", "--head-dim", "16", "--backends", "torch,cudnn_ragged",
                                       "--documents", "lognormal", "--median", "32", "--samples", "1",
                                       "--warmup", "1", "--rounds", "1"])
    assert [r["backend"] for r in records] == ["torch", "one document"]
    assert '"unavailable": "backend \'cudnn_ragged\' needs CUDA tensors' in capsys.readouterr().out
