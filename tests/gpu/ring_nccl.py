"""Every CP algorithm over NCCL on a multi-GPU node, one rank per GPU, checked against float64.

    torchrun --nproc-per-node 4 -m tests.gpu.ring_nccl

Ring, all-gather, Ulysses and (with 4 or more GPUs) hybrid with Ulysses pairs; every static layout,
causal and not, with and without packed documents; fp32 (relative error <= 2e-5) and bf16 (<= 5e-2),
forward and backward through ``context_parallel_attention``. Rank 0 prints one line per case and the
script exits non-zero if any case fails.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.distributed as dist

from cp_train.parallel.cp.attention import context_parallel_attention
from cp_train.parallel.cp.layout import STATIC_LAYOUTS, gather_sequence, shard_sequence
from cp_train.parallel.mesh.model_parallel import CPGroups
from cp_train.parallel.mesh.state import parallel_context
from tests.document_cases import masked_reference
from tests.numerics import rel_err


def check(groups: CPGroups, algorithm: str, layout: str, causal: bool, dtype: torch.dtype, documents: bool,
          seqlen: int = 2048) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(0)
    full = [torch.randn(2, seqlen, h, 64, generator=gen, device="cuda").to(dtype) for h in (8, 2, 2, 8)]
    starts = torch.rand(2, seqlen, generator=torch.Generator().manual_seed(1)) < (8 / seqlen if documents else 0)
    starts[:, 0] = False
    docs = torch.cumsum(starts.long(), 1)
    ref = masked_reference(*(x.cpu() for x in full), docs, causal, 0.125)
    local = [shard_sequence(x, rank, world, layout).requires_grad_(i < 3) for i, x in enumerate(full)]
    local_docs = shard_sequence(docs, rank, world, layout).cuda() if documents else None
    out = context_parallel_attention(*local[:3], groups, layout, causal, softmax_scale=0.125, algorithm=algorithm,
                                     document_ids=local_docs)
    out.backward(local[3])
    got = {"out": out.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
    return {name: rel_err(gather_sequence(x, None, layout).cpu(), ref[name]) for name, x in got.items()}


def main() -> int:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    algorithms = [("ring", 1), ("allgather", 1), ("ulysses", 1)] + ([("hybrid", 2)] if world >= 4 else [])
    failures = 0
    for algorithm, ulysses in algorithms:
        with parallel_context(1, world, 1, ulysses_size=ulysses) as state:
            for dtype, bound in ((torch.float32, 2e-5), (torch.bfloat16, 5e-2)):
                for layout, causal, documents in itertools.product(STATIC_LAYOUTS, (True, False), (False, True)):
                    worst = max(check(state.cp_groups, algorithm, layout, causal, dtype, documents).values())
                    failures += worst > bound
                    if dist.get_rank() == 0:
                        print(f"{algorithm:9s} {dtype} {layout:10s} causal={causal!s:5s} documents={documents!s:5s} "
                              f"cp={world} worst rel err {worst:.2e} ({'ok' if worst <= bound else 'FAIL'})",
                              flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
