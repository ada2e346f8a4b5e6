"""Ring attention forward and backward pipelines (no autograd; see ring_attention.py).

Shapes: q, dout, out ``[B, n, H, D]``; k, v ``[B, n, Hk, D]``; lse ``[B, n, H]``
(float32 accumulator layout); ``n`` is the local sequence length of one CP rank.

The work runs over *head chunks* (groups of kv heads with their query heads)
and, inside each chunk, over the ring steps. Exactly one K/V transfer is in
flight at any time, always for the next step that needs remote data, so the
transfer overlaps the current kernel call. Splitting by head chunks bounds
the transient buffers (received K/V, travelling dK/dV) to one chunk's size,
and every hop carries only the prefix of rows that later ranks still use
(``ring_schedule.needed_kv_rows`` / ``covered_kv_rows``); empty hops are skipped.

Backward, per chunk: the local step first, written straight into dq/dk/dv;
then the remote steps. The dK/dV accumulator of a block starts on the first
rank that uses it, travels the ring with the K/V and arrives home at the
block's owner, which adds it to its own share. dQ stays local. Nothing saved
is recomputed. Buffers are dropped as soon as they are sent.

Overlap policy (``RingSpec.overlap``, chosen by device in ``ring_attention``): two hops of each
chunk's backward have no kernel call of their own chunk to hide behind, the first K/V hop and the
dK/dV accumulator's last hop home. With ``overlap`` (GPUs) the first K/V hop is posted before the
chunk's local step and the last dK/dV hop lands after the *next* chunk's local step, so both
travel during compute, at the price of one more K/V and one more dK/dV buffer alive at a time.
Without it (CPU, where memory is the tighter budget and the ring is compute-bound) each waits
in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parallel.kernels import KERNEL_CALLS, AttentionKernel
from parallel.ring_comm import RingComm, Transfer
from parallel.ring_schedule import BlockTask, block_task, covered_kv_rows, needed_kv_rows

KV_TAG, GRAD_TAG = 0, 1


def head_chunk_bounds(kv_heads: int, chunks: int) -> list[tuple[int, int]]:
    """Split ``range(kv_heads)`` into ``chunks`` contiguous, near-equal ranges."""
    chunks = max(1, min(chunks, kv_heads))
    edges = [round(i * kv_heads / chunks) for i in range(chunks + 1)]
    return [(edges[i], edges[i + 1]) for i in range(chunks)]


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out [B, m, h, D], lse [B, m, h]) into the running (out, lse), in place, in fp32."""
    weight = torch.sigmoid(block_lse - lse)
    lse.sub_(F.logsigmoid(lse - block_lse))
    out.lerp_(block_out.to(out.dtype), weight.unsqueeze(-1))


def _pass_kv(comm: RingComm, held: list[torch.Tensor], like: torch.Tensor, rows: tuple[int, int]) -> Transfer:
    """Send the first rows of the held [k, v] on; receive the next block's rows (``rows`` = (sent, received)).

    ``like`` ([B, n, hk, D]) gives the shape of the other dims, dtype and device.
    """
    send_rows, recv_rows = rows
    send = [x[:, :send_rows].contiguous() for x in held] if send_rows else []
    shapes = [(like.shape[0], recv_rows, *like.shape[2:])] * 2 if recv_rows else []
    return comm.exchange(send, shapes, tag=KV_TAG, like=like)


@dataclass(frozen=True)
class RingSpec:
    """How one ring attention call runs (decided once per call site): CP ``layout``, ``causal``, softmax
    ``scale``, the block ``kernel``, the number of kv-head chunks and the overlap policy (above)."""

    layout: str
    causal: bool
    scale: float
    kernel: AttentionKernel
    head_chunks: int
    overlap: bool


@dataclass(frozen=True)
class _Plan:
    """One rank's kernel calls and transfer sizes, from ring_schedule's pure rules."""

    layout: str
    causal: bool
    rank: int
    world: int
    n: int

    def task(self, step: int) -> BlockTask | None:
        return block_task(self.layout, self.causal, self.rank, (self.rank - step) % self.world, self.n)

    def kv_rows(self, step: int) -> tuple[int, int]:
        """(rows sent, rows received) when the K/V held at ``step`` moves on to hop ``step + 1``."""
        held, arriving = (self.rank - step) % self.world, (self.rank - step - 1) % self.world
        return (needed_kv_rows(self.layout, self.causal, held, step + 1, self.world, self.n),
                needed_kv_rows(self.layout, self.causal, arriving, step + 1, self.world, self.n))

    def grad_rows(self, step: int) -> tuple[int, int]:
        """(rows sent, rows received) of the dK/dV accumulators passed on after ``step``."""
        held, arriving = (self.rank - step) % self.world, (self.rank - step - 1) % self.world
        return (covered_kv_rows(self.layout, self.causal, held, step, self.world, self.n),
                covered_kv_rows(self.layout, self.causal, arriving, step, self.world, self.n))


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: RingComm | None,
                 spec: RingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over the ring: returns out [B, n, H, D] (accumulator dtype) and lse [B, n, H]."""
    batch, n, heads, dim = q.shape
    group_size = heads // k.shape[2]
    world, rank = (comm.world, comm.rank) if comm is not None else (1, 0)
    plan = _Plan(spec.layout, spec.causal, rank, world, n)
    acc = accumulator_dtype(q.dtype)
    out = torch.empty(batch, n, heads, dim, dtype=acc, device=q.device)
    lse = torch.empty(batch, n, heads, dtype=acc, device=q.device)
    for k0, k1 in head_chunk_bounds(k.shape[2], spec.head_chunks):
        qs = slice(k0 * group_size, k1 * group_size)
        q_c, out_c, lse_c = q[:, :, qs], out[:, :, qs], lse[:, :, qs]
        k_chunk = k[:, :, k0:k1]
        held = [k_chunk, v[:, :, k0:k1]]
        for step in range(world):
            # the next block travels while this one computes
            transfer = _pass_kv(comm, held, k_chunk, plan.kv_rows(step)) if step + 1 < world else None
            task = plan.task(step)
            if task is not None:
                KERNEL_CALLS["forward"] += 1
                block_out, block_lse = spec.kernel.forward(q_c[:, task.q_rows], held[0][:, task.kv_rows],
                                                           held[1][:, task.kv_rows], task.causal, spec.scale)
                block_lse = block_lse.transpose(1, 2)
                if step == 0:  # the local step always covers every row
                    out_c.copy_(block_out)
                    lse_c.copy_(block_lse)
                else:
                    merge_block(out_c[:, task.q_rows], lse_c[:, task.q_rows], block_out, block_lse)
                del block_out, block_lse
            held = transfer.wait() if transfer is not None else []
    return out, lse


def _block_grads(task: BlockTask | None, rows: tuple[torch.Tensor, ...], k_block: torch.Tensor,
                 v_block: torch.Tensor, dq: torch.Tensor, spec: RingSpec
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One block's backward: adds its dq share into ``dq``; returns (dk, dv) for ``task.kv_rows``.

    ``rows`` = (dout, q, out, lse) of the chunk's query heads; (None, None) when the block is skipped.
    """
    if task is None:
        return None, None
    dout, q, out, lse = (x[:, task.q_rows] for x in rows)
    KERNEL_CALLS["backward"] += 1
    dq_b, dk_b, dv_b = spec.kernel.backward(dout, q, k_block[:, task.kv_rows], v_block[:, task.kv_rows], out,
                                            lse.transpose(1, 2), task.causal, spec.scale)
    dq[:, task.q_rows] += dq_b
    return dk_b, dv_b


def _land(homecoming: list[tuple[Transfer, torch.Tensor, torch.Tensor]]) -> None:
    """Wait for each chunk's dK/dV accumulator arriving home and add it to the chunk's own (dk, dv)."""
    for transfer, dk_c, dv_c in homecoming:
        home = transfer.wait()
        if home:
            dk_c[:, :home[0].shape[1]] += home[0]
            dv_c[:, :home[1].shape[1]] += home[1]
    homecoming.clear()


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, comm: RingComm | None, spec: RingSpec
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward over the ring: dq [B, n, H, D], dk, dv [B, n, Hk, D] in the accumulator dtype."""
    batch, n, heads, dim = q.shape
    kv_heads = k.shape[2]
    group_size = heads // kv_heads
    world, rank = (comm.world, comm.rank) if comm is not None else (1, 0)
    plan = _Plan(spec.layout, spec.causal, rank, world, n)
    acc = accumulator_dtype(q.dtype)
    dq = torch.empty(batch, n, heads, dim, dtype=acc, device=q.device)
    dk = torch.empty(batch, n, kv_heads, dim, dtype=acc, device=q.device)
    dv = torch.empty_like(dk)
    homecoming: list[tuple[Transfer, torch.Tensor, torch.Tensor]] = []  # dK/dV hops still travelling home
    for k0, k1 in head_chunk_bounds(kv_heads, spec.head_chunks):
        qs = slice(k0 * group_size, k1 * group_size)
        rows = (dout[:, :, qs], q[:, :, qs], out[:, :, qs], lse[:, :, qs])
        k_c, v_c, dq_c, dk_c, dv_c = k[:, :, k0:k1], v[:, :, k0:k1], dq[:, :, qs], dk[:, :, k0:k1], dv[:, :, k0:k1]
        kv_transfer = _pass_kv(comm, [k_c, v_c], k_c, plan.kv_rows(0)) if comm is not None and spec.overlap else None
        dq_c.zero_()
        dk_b, dv_b = _block_grads(plan.task(0), rows, k_c, v_c, dq_c, spec)
        dk_c.copy_(dk_b)
        dv_c.copy_(dv_b)
        del dk_b, dv_b
        _land(homecoming)  # the previous chunk's last hop travelled during this local step
        if comm is None:
            continue
        if kv_transfer is None:  # posted only now, so the local step and the hop never hold memory at once
            kv_transfer = _pass_kv(comm, [k_c, v_c], k_c, plan.kv_rows(0))
        grad_transfer = None
        for step in range(1, world):
            held = kv_transfer.wait()
            kv_transfer = _pass_kv(comm, held, k_c, plan.kv_rows(step)) if step + 1 < world else None
            task = plan.task(step)
            dk_b, dv_b = _block_grads(task, rows, *held, dq_c, spec) if held else (None, None)
            del held
            arriving = grad_transfer.wait() if grad_transfer is not None else []
            send_rows, recv_rows = plan.grad_rows(step)
            grads = _accumulate(arriving, task, dk_b, dv_b, dk_c, send_rows)
            del arriving, dk_b, dv_b
            # pass the accumulator on; after the last hop every accumulator arrives at its owner
            shapes = [(batch, recv_rows, k1 - k0, dim)] * 2 if recv_rows else []
            grad_transfer = comm.exchange(grads, shapes, tag=GRAD_TAG, like=dk_c)
            del grads
        homecoming.append((grad_transfer, dk_c, dv_c))
        if not spec.overlap:
            _land(homecoming)
    _land(homecoming)
    return dq, dk, dv


def _accumulate(arriving: list[torch.Tensor], task: BlockTask | None, dk_b: torch.Tensor | None,
                dv_b: torch.Tensor | None, like: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """The travelling [dk, dv] accumulator with this rank's share added: its first ``rows`` rows.

    ``arriving`` holds the rows used by the earlier ranks (empty if none); ``like`` gives dtype/device.
    """
    if rows == 0:
        return []
    if not arriving and task is not None and task.kv_rows == slice(0, rows) and dk_b.dtype == like.dtype:
        return [dk_b, dv_b]  # the first contribution covers every row: send it as it is
    if arriving and arriving[0].shape[1] == rows:
        grads = arriving
    else:
        shape = (like.shape[0], rows, *like.shape[2:])
        grads = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(2)]
        for total, part in zip(grads, arriving, strict=False):
            total[:, :part.shape[1]] += part
    if task is not None:
        grads[0][:, task.kv_rows] += dk_b
        grads[1][:, task.kv_rows] += dv_b
    return grads
