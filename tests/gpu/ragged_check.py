"""The ``cudnn_ragged`` backend on this GPU, in a process of its own (PyTorch reads its ragged switch at the process's
first cuDNN attention call, so the GPU suite's other tests would have decided it already):

    python -m tests.gpu.ragged_check      # one JSON line; tests/gpu/test_cudnn_ragged_cuda.py runs it

Admits the backend (its trial: exact at two lengths of a bucket, lse layout, one graph per bucket), then runs the
ring over thread ranks with packed documents in bf16, every layout, against the float64 reference of the
per-document mask, beside the same kernel with the documents on its varlen calls (``cudnn``'s way) on the same
inputs.
"""

from __future__ import annotations

import json

import torch

from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.kernels import cudnn_ragged
from cp_train.parallel.kernels import select as kernels
from cp_train.parallel.kernels.contract import AttentionKernel
from tests.document_cases import masked_reference
from tests.numerics import rel_err
from tests.ring_threads import run_threaded_ring

CASES = ((1, "contiguous"), (2, "zigzag"), (4, "zigzag"), (4, "stripe"), (4, "contiguous"))


def _errors(kernel: AttentionKernel, world: int, layout: str, seed: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    seqlen = 256 * world
    q, k, v, dout = (torch.randn(2, seqlen, heads, 64, generator=gen).bfloat16() for heads in (8, 2, 2, 8))
    starts = torch.rand(2, seqlen, generator=gen) < 0.03
    starts[:, 0] = False
    docs = torch.cumsum(starts.long(), 1)
    want = masked_reference(q.double(), k.double(), v.double(), dout.double(), docs, True, 0.125)
    q, k, v, dout = (x.cuda() for x in (q, k, v, dout))
    spec = AttentionSpec("ring", layout, True, 0.125, kernel, 2, True, varlen=kernel.native_varlen,
                         rectangles=kernel.varlen_rectangles)
    got = run_threaded_ring(q, k, v, dout, world, spec, docs.cuda())
    return {name: rel_err(got[name].double().cpu(), value) for name, value in want.items()}


def main() -> dict:
    try:
        kernel = kernels.select_kernel(torch.device("cuda"), torch.bfloat16, 64, "cudnn_ragged")
    except kernels.KernelUnavailable as error:
        record = {"admitted": False, "why": str(error)}
        print(json.dumps(record), flush=True)
        return record
    record = {"admitted": True, "lse_rows_major": kernel.lse_rows_major, "native_gqa": kernel.native_gqa,
              "cases": []}
    twin = cudnn_ragged.documents_on_varlen(kernel)  # cudnn in this process: the documents on its varlen kernel
    for number, (world, layout) in enumerate(CASES):
        ragged, varlen = (_errors(backend, world, layout, number) for backend in (kernel, twin))
        record["cases"].append({"world": world, "layout": layout, "ragged": ragged, "cudnn_varlen": varlen})
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
