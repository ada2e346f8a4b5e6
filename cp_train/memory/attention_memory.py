"""What the CP attention keeps for the backward and holds transiently, per rank (the dry run).

Every algorithm's operator keeps q, k, v, its output and fp32 lse for the backward (``parallel/cp/op.py``); the
algorithm reports what it keeps beyond that and its transient working set (``CPAlgorithm.kept_bytes`` and
``buffer_bytes``, ``cp_train.parallel.cp.algorithms``: the ring's blocks in flight and fp32 dK/dV accumulators,
the all-gather's gathered chunks, Ulysses' all-to-all buffers and sequence-ordered copies). Here: the parts every
algorithm has, the output accumulator (forward) or the incoming gradient (backward), and one rank's local
kernel. On CPU the attention kernel repeats K/V to every query head (GQA) and returns their gradients repeated
too.
"""

from __future__ import annotations

from cp_train.parallel.cp.algorithms.costs import ACC, Shapes, expanded

__all__ = ["Shapes", "buffers", "kept"]


def kept(s: Shapes) -> int:
    """What the CP attention keeps for the backward: q, k, v, output and fp32 lse (and its algorithm's own)."""
    io = s.n * (2 * s.heads + 2 * s.kv_heads) * s.head_dim * s.compute + s.n * s.heads * ACC
    return io + (s.algorithm.kept_bytes(s) if s.cp > 1 else 0)


def buffers(s: Shapes, backward: bool) -> int:
    """The CP attention's transient working set in its forward or ``backward`` beyond what it keeps, with the
    incoming gradient and the dq, dk, dv it returns."""
    d, c = s.head_dim, s.compute
    if not backward:
        out = s.n * s.heads * (d + 1) * ACC if c < ACC else 0  # the fp32 output accumulator before its cast
    else:  # dout
        out = s.n * s.heads * d * c
    if s.cp == 1:  # the kernel's dq, dk, dv
        qkv = s.n * (s.heads + 2 * s.kv_heads) * d
        return out + (qkv * c if backward else 0) + expanded(s, s.n, s.heads, s.kv_heads, backward)
    return out + s.algorithm.buffer_bytes(s, backward)
