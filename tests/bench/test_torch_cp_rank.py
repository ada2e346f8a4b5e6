"""``bench/torch_cp_rank.py``: its fp32 merge is exact (the merged out is the attention over every call's keys),
and the benchmark runs end to end on CPU at toy sizes."""

from __future__ import annotations

import pytest
import torch

from bench import torch_cp_rank
from cp_train.parallel.kernels.torch_ops import TorchCpuFlash
from tests.numerics import rel_err


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls, scale: float) -> torch.Tensor:
    """float64 attention of q over the keys of every call side by side, each call's block masked as it runs."""
    rows, half = q.shape[1], q.shape[1] // 2
    keys, values, masks = [], [], []
    for kind, causal in calls:
        mask = torch.ones(rows, rows, dtype=torch.bool).tril() if causal else torch.ones(rows, rows, dtype=torch.bool)
        if kind == "khalf":
            keys.append(k[:, :half]), values.append(v[:, :half]), masks.append(mask[:, :half])
            continue
        if kind == "qhalf":
            mask[:half] = False
        keys.append(k), values.append(v), masks.append(mask)
    k_all, v_all, mask = torch.cat(keys, 1).double(), torch.cat(values, 1).double(), torch.cat(masks, 1)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k_all) * scale
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, v_all)


@pytest.mark.parametrize("rank,cp", [(0, 2), (1, 2), (1, 4), (3, 4)])
def test_the_framework_merge_is_the_attention_over_every_calls_keys(rank: int, cp: int) -> None:
    gen = torch.Generator().manual_seed(rank + cp)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen) for _ in range(3))
    calls = torch_cp_rank.rank_calls(rank, cp)
    out, _ = torch_cp_rank.rank_forward(TorchCpuFlash(), calls, q, k, v, 0.5, framework=True)
    assert rel_err(out, _reference(q, k, v, calls, 0.5)) < 1e-6
    assert torch_cp_rank.rank_pairs(rank, cp, 16) == 16 * 17 / 2 + (cp - 1) * 16 * 8


def test_torch_cp_rank_benchmark_smoke_run_on_cpu(capsys) -> None:
    records = torch_cp_rank.main(["--device", "cpu", "--tiny"])
    assert [(r["kernel"], r["rank"]) for r in records] == [("torch cpu flash", 0), ("torch cpu flash", 3)]
    assert all(r["ratio"] > 0 and r["kernels_tflops"] > 0 for r in records)
    assert "framework fwd ms" in capsys.readouterr().out
