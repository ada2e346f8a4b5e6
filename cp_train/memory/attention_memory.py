"""One rank's activation shapes, and what the CP attention keeps and holds transiently, per algorithm (the dry run).

Counted from ``parallel/cp``: every algorithm's operator keeps q, k, v, its output and fp32 lse for the
backward (``op.py``); Ulysses also keeps its sequence-ordered q, k, v, output and lse for ``heads / u`` heads of the
group's ``u * n`` tokens (``ulysses/attention.py``; with packed documents only the rows that travel, fewer).
Transient, beyond the incoming gradient and the fp32 dq, dk, dv:

- ring (``ring/``): the K/V block held, the next one arriving and the copy sent, and in the backward the fp32
  dK/dV accumulators travelling (one leaving, one arriving), per kv-head chunk;
- all-gather (``allgather.py``): a kv-head chunk's K/V of the whole sequence (``cp * n`` rows) with the next
  chunk's gather in flight; in the backward each chunk's fp32 dK/dV of the whole sequence, held with its
  reduce-scatter output until the last chunk's lands;
- Ulysses (``ulysses/``): the all-to-alls' send and receive buffers and their re-ordered copies for the head
  chunk at hand and the next, and the returning outputs (gradients in the backward) of every head chunk, held
  until the last one lands; kv heads repeated up to the group size when fewer; hybrid adds its ring's buffers
  over the group's ``u * n`` tokens.

On CPU the attention kernel repeats K/V to every query head (GQA) and returns their gradients repeated too.
"""

from __future__ import annotations

from dataclasses import dataclass

ACC = 4  # bytes of the fp32 accumulators (lse, the ring's and all-gather's dq/dk/dv)


@dataclass(frozen=True)
class Shapes:
    """One rank's activation shapes: ``n`` tokens, per-rank heads, kv heads, ffn and vocab, dtype sizes, and
    how the rank is parallel (the CP algorithm and degrees, sequence parallelism, the kernel)."""

    n: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    compute: int  # bytes per element of the matmul inputs and outputs
    residual: int  # bytes per element of the residual stream
    autocast: bool  # True: fp32 weights under autocast (each linear keeps its own cast input)
    cp: int = 1
    algorithm: str = "ring"  # ring | allgather | ulysses | hybrid (canonical names)
    ulysses: int = 1  # the Ulysses degree: cp for ulysses, ulysses_size for hybrid
    tp: int = 1
    sequence_parallel: bool = False  # the residual stream and the norms hold n / tp tokens
    cuda: bool = False  # CUDA: fused RMSNorm (input and a per-token scale kept), GQA-native kernels, 2 head chunks

    @property
    def stream(self) -> int:
        """Tokens of the residual stream on this rank (``n / tp`` under sequence parallelism)."""
        return self.n // self.tp if self.sequence_parallel else self.n

    @property
    def uses_ulysses(self) -> bool:
        return self.cp > 1 and self.algorithm in ("ulysses", "hybrid")

    @property
    def ulysses_kv_heads(self) -> int:
        """kv heads Ulysses carries: each repeated until every rank of its group holds one."""
        return max(self.kv_heads, self.ulysses) if self.uses_ulysses else self.kv_heads

    @property
    def kv_chunk(self) -> int:
        """kv heads per chunk of the ring backward and the all-gather (``parallel/cp/spec.py``: two chunks on
        GPUs; on CPU one kv head each at one thread per rank)."""
        return -(-self.kv_heads // min(2, self.kv_heads)) if self.cuda else 1


def _expanded(s: Shapes, rows: int, q_heads: int, kv_heads: int, backward: bool) -> int:
    """The CPU kernel's GQA copies in one call: K and V repeated to ``q_heads`` (and their gradients)."""
    if s.cuda or q_heads == kv_heads:
        return 0
    return (4 if backward else 2) * rows * q_heads * s.head_dim * s.compute


def kept(s: Shapes) -> int:
    """What the CP attention keeps for the backward: q, k, v, output and fp32 lse (Ulysses: and its copies)."""
    io = s.n * (2 * s.heads + 2 * s.kv_heads) * s.head_dim * s.compute + s.n * s.heads * ACC
    if s.uses_ulysses:
        io += s.n * (2 * s.heads + 2 * s.ulysses_kv_heads) * s.head_dim * s.compute + s.n * s.heads * ACC
    return io


def _ring(s: Shapes, rows: int, heads: int, kv_heads: int, backward: bool) -> int:
    """A ring over ``rows`` query rows of ``heads`` / ``kv_heads`` (K/V blocks of ``rows`` rows)."""
    d, c, group = s.head_dim, s.compute, heads // kv_heads
    chunk = min(s.kv_chunk, kv_heads)
    if not backward:  # one chunk: the block held and the next arriving, a step's output before its merge
        return 2 * 2 * rows * kv_heads * d * c + rows * heads * d * c + _expanded(s, rows, heads, kv_heads, False)
    local = _expanded(s, rows, heads, kv_heads, True) + 2 * rows * chunk * d * c
    remote = (3 * 2 * rows * chunk * d * c + 2 * 2 * rows * chunk * d * ACC + rows * (group + 2) * chunk * d * ACC
              + _expanded(s, rows, group * chunk, chunk, True))
    return max(local, remote)


def _allgather(s: Shapes, backward: bool) -> int:
    d, c, group, chunk = s.head_dim, s.compute, s.heads // s.kv_heads, s.kv_chunk
    gathered = 2 * 2 * s.cp * s.n * chunk * d * c  # this chunk's whole K/V and the next chunk's in flight
    work = _expanded(s, s.n, group * chunk, chunk, backward) + s.n * (group + 2) * chunk * d * ACC
    if backward:  # every chunk's whole-sequence dK/dV and its reduce-scatter output
        gathered += 2 * s.cp * s.n * s.kv_heads * d * ACC + 2 * s.n * s.kv_heads * d * ACC
    return gathered + work


def _ulysses(s: Shapes, backward: bool) -> int:
    u, d, c = s.ulysses, s.head_dim, s.compute
    kv = s.ulysses_kv_heads
    chunks = max(k for k in range(1, 3) if s.heads % (k * u) == 0 and kv % (k * u) == 0)
    part = s.n * (s.heads + 2 * kv) // chunks * d * c  # one head chunk of q, k, v (either side of the all-to-all)
    rows, heads, kv_heads = u * s.n, s.heads // (u * chunks), kv // (u * chunks)
    ring = _ring(s, rows, heads, kv_heads, backward) if s.algorithm == "hybrid" else 0
    kernel = _expanded(s, rows, heads, kv_heads, backward)
    if not backward:  # q, k, v of this chunk (sent, received, re-ordered) and the next in flight; outputs returning
        return 5 * part + 2 * s.n * s.heads * (d * c + ACC) + max(kernel, ring)
    # dq, dk, dv (repeated kv heads) and every chunk's returning gradients (sent and received): at the last chunk's
    # kernel call, the earlier chunks' and that chunk's dout, kernel gradients and their copies; after it, all
    grads = s.n * (s.heads + 2 * kv) * d * c
    dout = s.n * s.heads // chunks * d * c
    at_kernel = grads * (1 + 2 * (chunks - 1) // chunks) + dout + part + max(kernel, ring)
    return max(at_kernel, 3 * grads + dout + 2 * part)


def buffers(s: Shapes, backward: bool) -> int:
    """The CP attention's transient working set in its forward or ``backward`` beyond what it keeps, with the
    incoming gradient and the dq, dk, dv it returns."""
    d, c = s.head_dim, s.compute
    qkv = s.n * (s.heads + 2 * s.kv_heads) * d
    if not backward:
        out = s.n * s.heads * (d + 1) * ACC if c < ACC else 0  # the fp32 output accumulator before its cast
    else:  # dout
        out = s.n * s.heads * d * c
    if s.cp == 1:  # the kernel's dq, dk, dv
        return out + (qkv * c if backward else 0) + _expanded(s, s.n, s.heads, s.kv_heads, backward)
    if s.uses_ulysses:
        return out + _ulysses(s, backward)
    if backward:  # dq, dk, dv accumulate in fp32, then are cast
        out += qkv * (ACC + (c if c < ACC else 0))
    if s.algorithm == "allgather":
        return out + _allgather(s, backward)
    return out + _ring(s, s.n, s.heads, s.kv_heads, backward)
