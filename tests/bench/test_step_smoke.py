"""``bench/step.py`` runs on CPU at a toy shape: this model and transformers' Llama of the same shape, eager."""

from __future__ import annotations

import argparse

from bench import step


def test_step_benchmark_smoke_run(capsys) -> None:
    records = step.main(["--tiny", "--variants", "ours eager", "transformers eager"])
    assert [r["variant"] for r in records] == ["ours eager", "transformers eager"]
    assert records[0]["vs_ours_eager"] == 1.0 and all(r["step_ms"] > 0 and r["peak_mb"] >= 0 for r in records)
    assert "vs ours eager" in capsys.readouterr().out


def test_both_models_have_the_same_parameter_count() -> None:
    """The comparison is fair: transformers' Llama built from the same ModelConfig holds as many weights."""
    from transformers import LlamaForCausalLM

    from cp_train.model.gpt import GPTModel

    config = step.model_config(argparse.Namespace(
        vocab=512, layers=2, hidden=64, heads=4, kv_heads=2, ffn=None, seq=128))
    theirs = sum(p.numel() for p in LlamaForCausalLM(step.llama_config(config)).parameters())
    assert sum(p.numel() for p in GPTModel(config).parameters()) == theirs > 0
