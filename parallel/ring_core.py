"""Ring attention forward and backward pipelines (no autograd; see ring_attention.py).

Shapes: q, dout, out ``[B, n, H, D]``; k, v ``[B, n, Hk, D]``; lse ``[B, n, H]``
(float32 accumulator layout); ``n`` is the local sequence length of one CP rank.

The work runs over *head chunks* (groups of kv heads with their query heads)
and, inside each chunk, over the ring steps. Exactly one K/V transfer is in
flight at any time, always for the next step that needs remote data, so the
transfer overlaps the current kernel call. Splitting by head chunks bounds
the transient buffers (received K/V, travelling dK/dV) to one chunk's size.

Backward: for each chunk the remote steps run first; the dK/dV accumulator of
a block starts on the first rank that uses it, travels the ring with the K/V
and arrives at the block's owner, which adds its own (local-step) share. dQ
stays local. Nothing saved is recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.kernels import flash_backward, flash_forward
from parallel.ring_comm import RingComm, Transfer
from parallel.ring_schedule import BlockTask, block_task

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


def _start_local_kv(comm: RingComm | None, k: torch.Tensor, v: torch.Tensor) -> Transfer | None:
    """Send this rank's K/V chunk (packed [2, B, n, hk, D]) to the next rank, receive the previous one's."""
    if comm is None:
        return None
    return comm.exchange(torch.stack([k, v]), tag=KV_TAG)


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: RingComm | None, layout: str,
                 causal: bool, scale: float, backend: str | None, head_chunks: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over the ring: returns out [B, n, H, D] (accumulator dtype) and lse [B, n, H]."""
    batch, n, heads, dim = q.shape
    group_size = heads // k.shape[2]
    world, rank = (comm.world, comm.rank) if comm is not None else (1, 0)
    acc = accumulator_dtype(q.dtype)
    out = torch.empty(batch, n, heads, dim, dtype=acc, device=q.device)
    lse = torch.empty(batch, n, heads, dtype=acc, device=q.device)
    for k0, k1 in head_chunk_bounds(k.shape[2], head_chunks):
        qs = slice(k0 * group_size, k1 * group_size)
        q_c, out_c, lse_c = q[:, :, qs], out[:, :, qs], lse[:, :, qs]
        k_c, v_c = k[:, :, k0:k1], v[:, :, k0:k1]
        transfer = None
        for step in range(world):
            if step == 0:
                transfer = _start_local_kv(comm, k_c, v_c)
            else:
                held = transfer.wait()
                k_c, v_c = held[0], held[1]
                transfer = comm.exchange(held, tag=KV_TAG) if step + 1 < world else None
            task = block_task(layout, causal, rank, (rank - step) % world, n)
            if task is None:
                continue
            block_out, block_lse = flash_forward(q_c[:, task.q_rows], k_c[:, task.kv_rows],
                                                 v_c[:, task.kv_rows], task.causal, scale, backend)
            block_lse = block_lse.transpose(1, 2)
            if step == 0:  # the local step always covers every row
                out_c.copy_(block_out)
                lse_c.copy_(block_lse)
            else:
                merge_block(out_c[:, task.q_rows], lse_c[:, task.q_rows], block_out, block_lse)
    return out, lse


def _block_grads(task: BlockTask | None, rows: tuple[torch.Tensor, ...], k_block: torch.Tensor,
                 v_block: torch.Tensor, dq: torch.Tensor, scale: float, backend: str | None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One block's backward: adds its dq share into ``dq``; returns (dk, dv) for ``task.kv_rows``.

    ``rows`` = (dout, q, out, lse) of the chunk's query heads; (None, None) when the block is skipped.
    """
    if task is None:
        return None, None
    dout, q, out, lse = (x[:, task.q_rows] for x in rows)
    dq_b, dk_b, dv_b = flash_backward(dout, q, k_block[:, task.kv_rows], v_block[:, task.kv_rows], out,
                                      lse.transpose(1, 2), task.causal, scale, backend)
    dq[:, task.q_rows] += dq_b
    return dk_b, dv_b


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, comm: RingComm | None, layout: str, causal: bool, scale: float,
                  backend: str | None, head_chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward over the ring: dq [B, n, H, D], dk, dv [B, n, Hk, D] in the accumulator dtype."""
    batch, n, heads, dim = q.shape
    kv_heads = k.shape[2]
    group_size = heads // kv_heads
    world, rank = (comm.world, comm.rank) if comm is not None else (1, 0)
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(batch, n, heads, dim, dtype=acc, device=q.device)
    dk = torch.empty(batch, n, kv_heads, dim, dtype=acc, device=q.device)
    dv = torch.empty_like(dk)
    chunks = head_chunk_bounds(kv_heads, head_chunks)
    kv_transfer = _start_local_kv(comm, k[:, :, chunks[0][0]:chunks[0][1]], v[:, :, chunks[0][0]:chunks[0][1]])
    for index, (k0, k1) in enumerate(chunks):
        qs = slice(k0 * group_size, k1 * group_size)
        rows = (dout[:, :, qs], q[:, :, qs], out[:, :, qs], lse[:, :, qs])
        dq_c = dq[:, :, qs]

        grad_transfer = None
        for step in range(1, world):  # remote blocks first
            held = kv_transfer.wait()
            kv_transfer = comm.exchange(held, tag=KV_TAG) if step + 1 < world else None
            task = block_task(layout, causal, rank, (rank - step) % world, n)
            dk_b, dv_b = _block_grads(task, rows, held[0], held[1], dq_c, scale, backend)
            if grad_transfer is None:
                grads = torch.zeros(2, batch, n, k1 - k0, dim, dtype=acc, device=q.device)
            else:
                grads = grad_transfer.wait()
            if task is not None:
                grads[0][:, task.kv_rows] += dk_b
                grads[1][:, task.kv_rows] += dv_b
            del dk_b, dv_b
            grad_transfer = comm.exchange(grads, tag=GRAD_TAG)  # the last hop delivers it to its owner
        if index + 1 < len(chunks):  # prefetch the next chunk's first remote block during the local step
            n0, n1 = chunks[index + 1]
            kv_transfer = _start_local_kv(comm, k[:, :, n0:n1], v[:, :, n0:n1])
        local = block_task(layout, causal, rank, rank, n)
        dk_b, dv_b = _block_grads(local, rows, k[:, :, k0:k1], v[:, :, k0:k1], dq_c, scale, backend)
        if grad_transfer is None:
            dk[:, :, k0:k1] = dk_b
            dv[:, :, k0:k1] = dv_b
        else:
            home = grad_transfer.wait()
            dk[:, :, k0:k1].copy_(home[0]).add_(dk_b)
            dv[:, :, k0:k1].copy_(home[1]).add_(dv_b)
    return dq, dk, dv
