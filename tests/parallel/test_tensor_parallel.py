"""Tensor-parallel mappings and layers at tp = 2 and 4 against the plain layers on full tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cp_train.parallel.mesh import state as ps
from cp_train.parallel.tp import layers as tpl
from cp_train.parallel.tp import mappings as tpm
from cp_train.parallel.tp.fused_loss import linear_cross_entropy
from tests.numerics import rel_err

TOL = 1e-6  # relative error of fp32 TP layers against float64 references




def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_close(errors: dict[str, float], name: str, x: torch.Tensor, ref: torch.Tensor) -> None:
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)}, reference {tuple(ref.shape)}"
    errors[name] = rel_err(x, ref)
    assert errors[name] <= TOL, f"{name}: relative error {errors[name]:.3e} > {TOL}"


def reference_linear(layer: nn.Module) -> nn.Linear:
    """A float64 nn.Linear holding the full weight of ``layer``'s seed (built with group=None)."""
    ref = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        if layer.bias is not None:
            ref.bias.copy_(randn(layer.out_features, seed=99))
    return ref


def check_mappings(group: dist.ProcessGroup, tp: int, rank: int, errors: dict[str, float]) -> None:
    per_rank = [randn(3, 4 * tp, seed=10 + r) for r in range(tp)]  # rank r's input / upstream grad
    total = sum(per_rank)
    x = per_rank[rank].clone().requires_grad_()
    y = tpm.copy_to_tensor_parallel_region(x, group)
    assert torch.equal(y, x), "copy_to forward must be the identity"
    y.backward(per_rank[rank])
    check_close(errors, "copy_to grad", x.grad, total)
    x = per_rank[rank].clone().requires_grad_()
    y = tpm.reduce_from_tensor_parallel_region(x, group)
    check_close(errors, "reduce_from fwd", y, total)
    y.backward(per_rank[rank])
    assert torch.equal(x.grad, per_rank[rank]), "reduce_from backward must be the identity"
    x = total.clone().requires_grad_()
    y = tpm.scatter_to_tensor_parallel_region(x, group)
    assert torch.equal(y, total.chunk(tp, dim=-1)[rank]), "scatter_to must keep this rank's chunk"
    y.backward(per_rank[rank].chunk(tp, dim=-1)[rank])
    expected = torch.cat([per_rank[r].chunk(tp, dim=-1)[r] for r in range(tp)], dim=-1)
    assert torch.equal(x.grad, expected), "scatter_to backward must all-gather the chunks in rank order"
    x = per_rank[rank].chunk(tp, dim=-1)[rank].clone().requires_grad_()
    y = tpm.gather_from_tensor_parallel_region(x, group)
    assert torch.equal(y, expected), "gather_from must concatenate the chunks in rank order"
    y.backward(per_rank[rank])
    assert torch.equal(x.grad, per_rank[rank].chunk(tp, dim=-1)[rank]), "gather_from backward must split"


def check_column(group: dist.ProcessGroup, tp: int, rank: int, gather_output: bool, bias: bool,
                 errors: dict[str, float]) -> None:
    name = f"column gather={gather_output} bias={bias}"
    full = tpl.ColumnParallelLinear(12, 8 * tp, bias=bias, seed=7)
    layer = tpl.ColumnParallelLinear(12, 8 * tp, bias=bias, gather_output=gather_output, group=group, seed=7)
    rows = slice(rank * 8, (rank + 1) * 8)
    assert layer.weight.shape == (8, 12) and torch.equal(layer.weight, full.weight[rows]), \
        f"{name}: the local weight must be rows {rows} of the full seeded weight"
    ref = reference_linear(full)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(ref.bias[rows])
    x_ref = randn(2, 5, 12, seed=1).double().requires_grad_()
    x = x_ref.detach().float().requires_grad_()
    upstream = randn(2, 5, 8 * tp, seed=2)
    y_ref = ref(x_ref)
    (y_ref * upstream).sum().backward()
    y = layer(x)
    if gather_output:
        check_close(errors, f"{name} out", y, y_ref)
        (y * upstream).sum().backward()
    else:
        check_close(errors, f"{name} out", y, y_ref[..., rows])
        (y * upstream[..., rows]).sum().backward()
    check_close(errors, f"{name} dx", x.grad, x_ref.grad)
    check_close(errors, f"{name} dW", layer.weight.grad, ref.weight.grad[rows])
    if bias:
        check_close(errors, f"{name} db", layer.bias.grad, ref.bias.grad[rows])


def check_row(group: dist.ProcessGroup, tp: int, rank: int, input_is_parallel: bool,
              errors: dict[str, float]) -> None:
    name = f"row parallel_input={input_is_parallel}"
    full = tpl.RowParallelLinear(8 * tp, 12, seed=8)
    layer = tpl.RowParallelLinear(8 * tp, 12, input_is_parallel=input_is_parallel, group=group, seed=8)
    cols = slice(rank * 8, (rank + 1) * 8)
    assert layer.weight.shape == (12, 8) and torch.equal(layer.weight, full.weight[:, cols]), \
        f"{name}: the local weight must be columns {cols} of the full seeded weight"
    ref = reference_linear(full)
    with torch.no_grad():
        layer.bias.copy_(ref.bias)
    x_ref = randn(2, 5, 8 * tp, seed=3).double().requires_grad_()
    upstream = randn(2, 5, 12, seed=4)
    (ref(x_ref) * upstream).sum().backward()
    x = (x_ref.detach()[..., cols] if input_is_parallel else x_ref.detach()).float().requires_grad_()
    y = layer(x)
    check_close(errors, f"{name} out", y, ref(x_ref))
    (y * upstream).sum().backward()
    check_close(errors, f"{name} dx", x.grad, x_ref.grad[..., cols] if input_is_parallel else x_ref.grad)
    check_close(errors, f"{name} dW", layer.weight.grad, ref.weight.grad[:, cols])
    check_close(errors, f"{name} db", layer.bias.grad, ref.bias.grad)


def check_mlp(group: dist.ProcessGroup, tp: int, errors: dict[str, float]) -> None:
    """Column (no gather) -> gelu -> Row (parallel input): one all-reduce, same as the full MLP."""
    up = tpl.ColumnParallelLinear(12, 4 * tp, group=group, seed=11)
    down = tpl.RowParallelLinear(4 * tp, 12, input_is_parallel=True, group=group, seed=12)
    ref_up = reference_linear(tpl.ColumnParallelLinear(12, 4 * tp, seed=11))
    ref_down = reference_linear(tpl.RowParallelLinear(4 * tp, 12, seed=12))
    with torch.no_grad():
        ref_up.bias.zero_()
        ref_down.bias.zero_()
    x_ref = randn(3, 12, seed=5).double().requires_grad_()
    x = x_ref.detach().float().requires_grad_()
    y_ref, y = ref_down(F.gelu(ref_up(x_ref))), down(F.gelu(up(x)))
    check_close(errors, "mlp out", y, y_ref)
    upstream = randn(3, 12, seed=6)
    (y_ref * upstream).sum().backward()
    (y * upstream).sum().backward()
    check_close(errors, "mlp dx", x.grad, x_ref.grad)


def check_embedding(group: dist.ProcessGroup, tp: int, rank: int, errors: dict[str, float]) -> None:
    vocab = 6 * tp
    full = tpl.VocabParallelEmbedding(vocab, 10, seed=9)
    layer = tpl.VocabParallelEmbedding(vocab, 10, group=group, seed=9)
    rows = slice(rank * 6, (rank + 1) * 6)
    assert layer.weight.shape == (6, 10) and torch.equal(layer.weight, full.weight[rows]), \
        "embedding: the local weight must be this rank's vocabulary rows of the full seeded weight"
    ref = nn.Embedding(vocab, 10, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(full.weight)
    ids = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(4))
    ids[0, :tp] = torch.arange(tp) * 6  # the first and last id of every rank's range
    ids[1, :tp] = torch.arange(tp) * 6 + 5
    upstream = randn(3, 7, 10, seed=5)
    y_ref, y = ref(ids), layer(ids)
    check_close(errors, "embedding out", y, y_ref)
    (y_ref * upstream).sum().backward()
    (y * upstream).sum().backward()
    check_close(errors, "embedding dW", layer.weight.grad, ref.weight.grad[rows])


def check_cross_entropy(group: dist.ProcessGroup | None, tp: int, rank: int, errors: dict[str, float],
                        scale: float = 3.0, offset: float = 0.0, tag: str = "") -> None:
    vocab = 10 * tp
    cols = slice(rank * 10, (rank + 1) * 10)
    logits_ref = (randn(2, 9, vocab, seed=6) * scale + offset).double().requires_grad_()
    targets = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(7))
    targets[0, :3] = torch.tensor([0, vocab - 1, vocab // 2])  # first, last and a middle class
    targets[1, 2] = -100  # ignored
    weights = randn(2, 9, seed=8)
    loss_ref = F.cross_entropy(logits_ref.transpose(1, 2), targets, reduction="none")
    (loss_ref * weights).sum().backward()
    logits = logits_ref.detach()[..., cols].float().requires_grad_()
    loss = tpl.vocab_parallel_cross_entropy(logits, targets, group)
    assert loss[1, 2].item() == 0.0, "an ignored target must give loss 0"
    check_close(errors, f"cross entropy{tag} loss", loss, loss_ref)
    (loss * weights).sum().backward()
    check_close(errors, f"cross entropy{tag} dlogits", logits.grad, logits_ref.grad[..., cols])
    assert not logits.grad[1, 2].any(), "an ignored target must get no gradient"


def check_fused_loss(group: dist.ProcessGroup | None, tp: int, rank: int, errors: dict[str, float]) -> None:
    """``linear_cross_entropy`` (the head and the loss fused, by chunks of 1, 7 and all 18 tokens) against the
    full float64 logits and cross entropy: the loss, dx and this rank's rows of dweight."""
    vocab, hidden = 12 * tp, 16
    rows = slice(rank * 12, (rank + 1) * 12)
    x_ref = randn(18, hidden, seed=9).double().requires_grad_()
    w_ref = (randn(vocab, hidden, seed=10) * 0.5).double().requires_grad_()
    targets = torch.randint(0, vocab, (18,), generator=torch.Generator().manual_seed(11))
    targets[:3] = torch.tensor([0, vocab - 1, -100])
    weights = randn(18, seed=12)
    loss_ref = F.cross_entropy(x_ref @ w_ref.t(), targets, reduction="none")
    (loss_ref * weights).sum().backward()
    for chunk in (1, 7, 18):
        x = x_ref.detach().float().requires_grad_()
        w = w_ref.detach()[rows].float().requires_grad_()
        loss = linear_cross_entropy(x, w, targets, group, chunk)
        check_close(errors, f"fused loss (chunk {chunk}) loss", loss, loss_ref)
        (loss * weights).sum().backward()
        dx = tpm.reduce_from_tensor_parallel_region(x.grad, group) if tp > 1 else x.grad
        check_close(errors, f"fused loss (chunk {chunk}) dx", dx, x_ref.grad)
        check_close(errors, f"fused loss (chunk {chunk}) dweight", w.grad, w_ref.grad[rows])
        assert loss[2].item() == 0.0, "an ignored target must give loss 0"


def check_bad_input(group: dist.ProcessGroup, tp: int) -> None:
    with pytest.raises(ValueError, match=f"out_features = 7 is not divisible by the tensor-parallel size {tp}"):
        tpl.ColumnParallelLinear(8, 7, group=group)
    with pytest.raises(ValueError, match=f"in_features = 5 is not divisible by the tensor-parallel size {tp}"):
        tpl.RowParallelLinear(5, 8, group=group)
    with pytest.raises(ValueError, match=f"num_embeddings = 13 is not divisible by the tensor-parallel size {tp}"):
        tpl.VocabParallelEmbedding(13, 8, group=group)
    with pytest.raises(ValueError, match=f"last dimension = 7 is not divisible by the tensor-parallel size {tp}"):
        tpm.scatter_to_tensor_parallel_region(torch.zeros(2, 7), group)
    row = tpl.RowParallelLinear(4 * tp, 3, input_is_parallel=True, group=group)
    with pytest.raises(ValueError, match="input_is_parallel expects the last dim to be in_features/tp = 4"):
        row(torch.zeros(2, 4 * tp))


def check_tp_on_rank(tp: int, cp: int) -> dict[str, float]:
    """Every TP check at tensor-parallel size ``tp`` (inside ``initialize_parallel(tp, cp)``)."""
    errors: dict[str, float] = {}
    with ps.parallel_context(tp=tp, cp=cp) as state:
        group, rank = state.tp.group, state.tp.rank
        check_mappings(group, tp, rank, errors)
        for gather_output in (False, True):
            for bias in (True, False):
                check_column(group, tp, rank, gather_output, bias, errors)
        for input_is_parallel in (False, True):
            check_row(group, tp, rank, input_is_parallel, errors)
        check_mlp(group, tp, errors)
        check_embedding(group, tp, rank, errors)
        check_cross_entropy(group, tp, rank, errors)
        check_cross_entropy(group, tp, rank, errors, scale=40.0, offset=1e4, tag=" (large logits)")
        check_fused_loss(group, tp, rank, errors)
        check_bad_input(group, tp)
    return errors


@pytest.mark.parametrize("tp,cp", [(2, 2), (4, 1)])
def test_tp_layers_match_full_layers(spawn_world, tp: int, cp: int) -> None:
    per_rank = spawn_world(8).run(check_tp_on_rank, tp, cp)
    worst = {name: max(errors[name] for errors in per_rank) for name in per_rank[0]}
    assert len(worst) >= 30, sorted(worst)
    assert max(worst.values()) <= TOL, worst


# ----------------------------------------------------------------------------- no TP (group=None)

def test_without_group_layers_are_the_plain_layers() -> None:
    x = randn(4, 12, seed=1)
    column = tpl.ColumnParallelLinear(12, 6, seed=3, gather_output=True)
    row = tpl.RowParallelLinear(12, 6, seed=3)
    assert torch.equal(column.weight, row.weight), "the same seed must give the same full weight"
    assert column.weight.tensor_model_parallel and column.weight.partition_dim == 0
    assert row.weight.partition_dim == 1 and not hasattr(row.bias, "tensor_model_parallel")
    plain = nn.Linear(12, 6)
    with torch.no_grad():
        plain.weight.copy_(column.weight)
        plain.bias.zero_()
    assert torch.equal(column(x), plain(x)) and torch.equal(row(x), plain(x))
    std = tpl.ColumnParallelLinear(256, 256, seed=0, init_std=0.5).weight.std().item()
    assert abs(std - 0.5) < 0.01, f"init_std=0.5 gave std {std}"
    custom = tpl.ColumnParallelLinear(4, 4, init_method=lambda w, g: w.fill_(0.25))
    assert torch.equal(custom.weight, torch.full((4, 4), 0.25))
    embedding = tpl.VocabParallelEmbedding(11, 5, seed=2)
    ids = torch.tensor([[0, 10, 3]])
    assert torch.equal(embedding(ids), F.embedding(ids, embedding.weight))
    for mapping in (tpm.copy_to_tensor_parallel_region, tpm.reduce_from_tensor_parallel_region,
                    tpm.scatter_to_tensor_parallel_region, tpm.gather_from_tensor_parallel_region):
        assert mapping(x, None) is x, f"{mapping.__name__} must be the identity without a group"


def test_cross_entropy_without_group_matches_torch() -> None:
    errors: dict[str, float] = {}
    check_cross_entropy(None, 1, 0, errors)
    check_cross_entropy(None, 1, 0, errors, scale=40.0, offset=-1e4, tag=" (large logits)")
    check_fused_loss(None, 1, 0, errors)
    logits = (randn(3, 20, seed=1) * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.tensor([1, 19, 7])
    loss = tpl.vocab_parallel_cross_entropy(logits, targets)
    assert loss.dtype == torch.float32, "bf16 logits must give an fp32 loss"
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = F.cross_entropy(logits.detach().double(), targets, reduction="none")
    assert rel_err(loss, ref) <= TOL, rel_err(loss, ref)


def test_cross_entropy_rejects_bad_input_and_a_second_backward() -> None:
    with pytest.raises(ValueError, match=r"targets shape \(2, 4\) must equal the logits shape without"):
        tpl.vocab_parallel_cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be an integer tensor of class ids, got torch.float32"):
        tpl.vocab_parallel_cross_entropy(torch.zeros(2, 5), torch.zeros(2))
    with pytest.raises(ValueError, match="token ids must be an integer tensor"):
        tpl.VocabParallelEmbedding(8, 4)(torch.zeros(3))
    logits = randn(2, 5, seed=0).requires_grad_()
    loss = tpl.vocab_parallel_cross_entropy(logits, torch.tensor([1, 2])).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="supports one backward pass per forward"):
        loss.backward()
