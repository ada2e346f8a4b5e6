"""Rank-side checks of sliding windows and learned sinks, run inside spawned gloo worlds (test_window_attention.py).

Every rank builds the same inputs, documents and sinks from a seed, runs ``context_parallel_attention`` with a
``window`` and ``sinks`` on its slice, gathers out, lse, dq, dk, dv by position and sums dsinks over the CP
ranks, and compares them with a float64 reference that builds the full mask and an explicit sink column.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_train.parallel.cp.attention import build_cp_plan, context_parallel_attention
from cp_train.parallel.cp.plan.window_plan import kv_rows_received
from cp_train.parallel.cp.ring import comm as ring_comm
from cp_train.parallel.kernels.torch_ops import expand_kv, reduce_kv_grad
from tests.document_cases import _take, documents, gather_by_position, inputs, layout_positions
from tests.numerics import rel_err

SCALE = 0.25


def window_reference(q, k, v, dout, docs, causal: bool, window: tuple[int, int] | None,
                     sinks: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """float64 out, lse [B, H, S], dq, dk, dv (and dsinks) of the whole sequence under the full mask: same
    document, causal, ``window`` = (left, right) keys around the query (None: unbounded), sinks as a column."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    heads, seqlen = q.shape[2], q.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, expand_kv(k64, heads)) * SCALE
    i = torch.arange(seqlen)
    distance = i[:, None] - i[None, :]  # query - key
    visible = (docs[:, :, None] == docs[:, None, :])
    if causal:
        visible = visible & (distance >= 0)
    if window is not None:
        left, right = window
        if left is not None:
            visible = visible & (distance <= left)
        if right is not None:
            visible = visible & (-distance <= right)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    grads = [q64, k64, v64]
    if sinks is not None:
        s64 = sinks.detach().double().requires_grad_()
        grads.append(s64)
        column = s64.view(1, heads, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, column], -1)
    probs = torch.softmax(scores, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs[..., :seqlen], expand_kv(v64, heads))
    result = dict(zip(("dq", "dk", "dv", "dsinks"), torch.autograd.grad(out, grads, dout.double()), strict=False))
    return {"out": out.detach(), "lse": torch.logsumexp(scores, -1).detach(), **result}


def run_window(q, k, v, dout, docs, layout: str, causal: bool, window, sinks, algorithm: str, group,
               masked: bool, use_plan: bool) -> dict[str, torch.Tensor]:
    """This rank's slice with ``window`` and ``sinks`` (through ``build_cp_plan`` when ``use_plan``); the full
    results, dsinks summed over the CP ranks."""
    rank, world = dist.get_rank(group.cp), dist.get_world_size(group.cp)
    positions = layout_positions(layout, docs, rank, world)
    local = [_take(x, positions).requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout))]
    s = None if sinks is None else sinks.clone().requires_grad_()
    doc_ids = _take(docs, positions) if masked else None
    pos_ids = positions if masked else None
    if use_plan:
        plan = build_cp_plan(group, layout, causal, q.shape[1] // world, doc_ids, pos_ids, algorithm, window=window)
        out, lse = context_parallel_attention(*local[:3], group, layout, causal, SCALE, return_lse=True,
                                              algorithm=algorithm, plan=plan, sinks=s)
    else:
        out, lse = context_parallel_attention(*local[:3], group, layout, causal, SCALE, return_lse=True,
                                              algorithm=algorithm, document_ids=doc_ids, position_ids=pos_ids,
                                              window=window, sinks=s)
    out.backward(local[3])
    got = {"out": out.detach(), "lse": lse.transpose(1, 2).contiguous(), "dq": local[0].grad,
           "dk": local[1].grad, "dv": local[2].grad}
    full = {name: gather_by_position(x, positions, q.shape[1]) for name, x in got.items()}
    full["lse"] = full["lse"].transpose(1, 2)
    if s is not None:
        dsinks = s.grad.clone()
        dist.all_reduce(dsinks, group=group.cp)
        full["dsinks"] = dsinks
    return full


def as_pair(window, causal: bool) -> tuple[int | None, int | None] | None:
    """The reference's (left, right) of a public ``window``."""
    if window is None:
        return None
    if isinstance(window, int):
        return (window - 1, 0 if causal else window - 1)
    left, right = window
    return (None if left < 0 else left, None if right < 0 else right)


def check_window_cases(state, algorithm: str, cases: list[tuple], seqlen: int) -> list[float]:
    """Worst relative error of each ``(layout, causal, heads, kv_heads, spec, window, sinks, use_plan)``."""
    worst = []
    for number, (layout, causal, heads, kv_heads, spec, window, with_sinks, use_plan) in enumerate(cases):
        q, k, v, dout = inputs(seqlen, heads, kv_heads, seed=number, dim=8)
        docs = documents(spec or "one", 2, seqlen, state.cp.size, seed=number)
        sinks = torch.randn(heads, generator=torch.Generator().manual_seed(number)) if with_sinks else None
        masked = spec is not None or layout == "balanced"
        ref = window_reference(q, k, v, dout, docs if masked else torch.zeros_like(docs), causal,
                               as_pair(window, causal), sinks)
        got = run_window(q, k, v, dout, docs, layout, causal, window, sinks, algorithm, state.cp_groups, masked,
                         use_plan)
        worst.append(max(error(got[name], ref[name], dout) for name in ref))
    return worst


def error(x: torch.Tensor, ref: torch.Tensor, dout: torch.Tensor) -> float:
    """``rel_err``, its denominator floored at 1e-2 ||dout||: a window of one key makes dq and dk exactly 0 in
    exact arithmetic (one key: the softmax is 1), where fp32 leaves rounding noise of ~1e-7 ||dout||."""
    floor = 1e-2 * float(dout.double().norm())
    return rel_err(x, ref) * min(1.0, float(ref.double().norm()) / floor) if ref.numel() else 0.0


def needle(state, layout: str, window: int, seqlen: int) -> tuple[float, float]:
    """Attention weight that the last query puts on a needle key at distance W-1 and at W (value 1 there, 0
    elsewhere, the needle's key matching the query strongly): the first ~1, the second exactly 0."""
    found = []
    for distance in (window - 1, window):
        q = torch.zeros(1, seqlen, 1, 8)
        k = torch.zeros(1, seqlen, 1, 8)
        v = torch.zeros(1, seqlen, 1, 8)
        q[0, -1, 0, 0] = 40.0
        k[0, seqlen - 1 - distance, 0, 0] = 1.0
        v[0, seqlen - 1 - distance, 0, 0] = 1.0
        rank, world = dist.get_rank(), dist.get_world_size()
        positions = layout_positions(layout, torch.zeros(1, seqlen, dtype=torch.long), rank, world)
        local = [_take(x, positions) for x in (q, k, v)]
        out = context_parallel_attention(*local, state.cp_groups, layout, True, 1.0, window=window)
        found.append(float(gather_by_position(out, positions, seqlen)[0, -1, 0, 0]))
    return found[0], found[1]


def sinks_once(state, layout: str, seqlen: int) -> float:
    """Relative error of out with sinks against the reference's: sinks applied at every ring step (scaling by
    sigmoid^P) would give an error of order 1."""
    q, k, v, dout = inputs(seqlen, 4, 2, seed=7, dim=8)
    docs = torch.zeros(2, seqlen, dtype=torch.long)
    sinks = torch.full((4,), 2.0)
    ref = window_reference(q, k, v, dout, docs, True, (5, 0), sinks)
    got = run_window(q, k, v, dout, docs, layout, True, 6, sinks, "ring", state.cp_groups, False, False)
    return rel_err(got["out"], ref["out"])


def halo_rows(state, layout: str, window: int, seqlen: int) -> tuple[int, int]:
    """(K/V rows this rank received in one forward, as counted by the plan; rows the bytes sent imply)."""
    world = state.cp.size
    plan = build_cp_plan(state.cp_groups, layout, True, seqlen // world, window=window)
    q, k, v, _ = inputs(seqlen, 2, 1, seed=1, dim=8)
    positions = layout_positions(layout, torch.zeros(1, seqlen, dtype=torch.long), dist.get_rank(), world)
    local = [_take(x[:1], positions) for x in (q, k, v)]
    ring_comm.BYTES_SENT.clear()
    context_parallel_attention(*local, state.cp_groups, layout, True, plan=plan, head_chunks=1)
    sent = sum(ring_comm.BYTES_SENT.values())
    total = torch.tensor([sent], dtype=torch.float64)
    dist.all_reduce(total)
    return kv_rows_received(plan, seqlen // world), int(total.item() / world / (2 * 8 * 4))


class NativeWindowMath:
    """A float64 kernel that takes flash-attn's ``window=(left, right)`` natively (bottom-right aligned, -1
    unbounded), as flash-attn, FA3 and PyTorch's CUDA flash do: Ulysses hands it the window."""

    name = "math with windows"
    native_window = True
    native_varlen = False
    calls: list = []

    def _scores(self, q, k, causal, scale, window):
        from cp_train.parallel.kernels.select import _math_scores
        scores = _math_scores(q, k, False, scale)
        rows, keys = q.shape[1], k.shape[1]
        i = torch.arange(rows)[:, None] + (keys - rows)
        j = torch.arange(keys)[None, :]
        left, right = window if window is not None else (-1, -1)
        visible = torch.ones(rows, keys, dtype=torch.bool)
        if causal or right >= 0:
            visible &= j <= i + (0 if causal else right)
        if left >= 0:
            visible &= j >= i - left
        return scores.masked_fill(~visible, float("-inf"))

    def forward(self, q, k, v, causal, scale, window=None):
        self.calls.append(window)
        scores = self._scores(q, k, causal, scale, window)
        lse = torch.logsumexp(scores, -1)
        out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), expand_kv(v, q.shape[2]).double())
        return out.to(q.dtype), lse.float()

    def backward(self, rows, k, v, causal, scale, window=None):
        """Closed form with the final out and lse (sinks included), as the real kernels read them."""
        dout, q, out, lse = (x.double() for x in rows)
        heads, kv_heads = q.shape[2], k.shape[2]
        k64, v64 = (expand_kv(x, heads).double() for x in (k, v))
        probs = torch.exp(self._scores(q, k64, causal, scale, window) - lse[..., None])
        delta = (dout * out).sum(-1).transpose(1, 2)
        dscores = probs * (torch.einsum("bqhd,bkhd->bhqk", dout, v64) - delta[..., None])
        dq = torch.einsum("bhqk,bkhd->bqhd", dscores, k64) * scale
        dk = reduce_kv_grad(torch.einsum("bhqk,bqhd->bkhd", dscores, q) * scale, kv_heads)
        dv = reduce_kv_grad(torch.einsum("bhqk,bqhd->bkhd", probs, dout), kv_heads)
        return tuple(g.to(x.dtype) for g, x in zip((dq, dk, dv), (rows.q, k, v), strict=True))


def check_native_window(state, window: int, seqlen: int) -> float:
    """Ulysses with one document hands a kernel that takes windows (``NativeWindowMath``) the whole sequence and
    flash-attn's window; worst relative error (sinks included) and whether every call carried the window."""
    from cp_train.parallel.cp import spec as spec_module
    original = spec_module.select_kernel
    spec_module.select_kernel = lambda *args, **kwargs: NativeWindowMath()
    NativeWindowMath.calls.clear()
    try:
        q, k, v, dout = inputs(seqlen, 4, 2, seed=3, dim=8)
        docs = torch.zeros(2, seqlen, dtype=torch.long)
        sinks = torch.randn(4, generator=torch.Generator().manual_seed(3))
        ref = window_reference(q, k, v, dout, docs, True, (window - 1, 0), sinks)
        got = run_window(q, k, v, dout, docs, "zigzag", True, window, sinks, "ulysses", state.cp_groups, False, False)
    finally:
        spec_module.select_kernel = original
    assert NativeWindowMath.calls and all(call == (window - 1, 0) for call in NativeWindowMath.calls)
    return max(error(got[name], ref[name], dout) for name in ref)
