"""Packed documents' attention at cp 1, kernel against kernel: the 1B step's attention alone, one process.

    python -m bench.document_attention                 # CUDA: 16 heads on 8, head dim 128, 16,384 tokens, bf16
    python -m bench.document_attention --device cpu --seqlen 1024 --heads 4 --kv-heads 2 --head-dim 32 \\
        --dtype float32 --backends torch              # the code path on CPU

Each sample is ``--seqlen`` tokens of documents packed back to back: lengths drawn from the default corpus (the
1B profile's data; ``--documents lognormal``: lognormal lengths with ``--median``, sigma 1). Every backend runs
the trainer's attention at cp 1 (``ring_forward`` and ``ring_backward`` on the sample's plan: the documents'
steps as its varlen calls, or, for a kernel without them such as ``cudnn_ragged``, one dense call per document),
forward and backward, on the same samples: ``--warmup`` passes over every sample first (graph builds, compilation),
then ``--rounds`` timed passes, backends taking turns; a backend's time per sample is the median of its rounds.
Also ``one document``: the first backend on each sample as one causal block (what the dense kernel does with no
document boundary). TFLOP/s count the pairs the document mask leaves (forward and backward: 14 x pairs x heads x
head dim FLOPs). ``vs first``: each time over the first backend's. On CUDA the times are synchronized; the ragged
switch (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE``) is set before the first cuDNN call when ``cudnn_ragged`` is asked for.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/document_attention.py` from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import emit, median  # noqa: E402
from cp_train.parallel.cp.balanced_layout import document_starts  # noqa: E402
from cp_train.parallel.cp.plan.rank_plan import plan_for_documents  # noqa: E402
from cp_train.parallel.cp.ring.backward import ring_backward  # noqa: E402
from cp_train.parallel.cp.ring.forward import ring_forward  # noqa: E402
from cp_train.parallel.cp.spec import AttentionSpec  # noqa: E402
from cp_train.parallel.kernels import cudnn_ragged  # noqa: E402
from cp_train.parallel.kernels import select as kernels  # noqa: E402


def corpus_lengths() -> np.ndarray:
    """The default corpus's document lengths in tokens (built on first use, as a run would)."""
    from cp_train.data.default_corpus import prepare_default_corpus
    from cp_train.data.indexed import IndexedDataset

    return np.asarray(IndexedDataset(str(prepare_default_corpus().data_prefix)).sequence_lengths, dtype=np.int64)


def sample_documents(seqlen: int, samples: int, seed: int, lengths: np.ndarray | None, median_tokens: int
                     ) -> list[torch.Tensor]:
    """``samples`` document-id rows ``[seqlen]``: documents in random order (from ``lengths``, else lognormal with
    ``median_tokens``) packed back to back, cut at the sample boundaries."""
    rng = np.random.default_rng(seed)
    drawn: list[int] = []
    while sum(drawn) < seqlen * samples:
        drawn.append(int(rng.choice(lengths)) if lengths is not None else
                     max(1, int(rng.lognormal(np.log(median_tokens), 1.0))))
    ids = np.repeat(np.arange(len(drawn)), drawn)[: seqlen * samples].reshape(samples, seqlen)
    return [torch.from_numpy(row) for row in ids]


def _pass(spec: AttentionSpec, plan, tensors: tuple[torch.Tensor, ...]) -> None:  # noqa: ANN001 - a RankPlan
    q, k, v, dout = tensors
    out, lse = ring_forward(q, k, v, None, spec, plan)
    ring_backward(dout, q, k, v, out.to(q.dtype), lse, None, spec, plan)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backends", default="cudnn,cudnn_ragged", help="comma-separated attention backends")
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--documents", choices=["corpus", "lognormal"], default="corpus")
    parser.add_argument("--median", type=int, default=2048, help="lognormal documents' median length")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device, dtype, names = torch.device(args.device), getattr(torch, args.dtype), args.backends.split(",")
    chosen = {}
    if "cudnn_ragged" in names:  # first: its trial decides the lse layout every cuDNN call of the process needs
        cudnn_ragged.enable()
        try:
            chosen["cudnn_ragged"] = kernels.select_kernel(device, dtype, args.head_dim, "cudnn_ragged")
        except kernels.KernelUnavailable as error:  # said, and the other backends timed all the same
            print(json.dumps({"backend": "cudnn_ragged", "unavailable": str(error)}), flush=True)
            names.remove("cudnn_ragged")
    for name in names:
        if name == "cudnn" and "cudnn_ragged" in chosen:  # the switch is on: cudnn is the ragged kernel's twin
            chosen[name] = cudnn_ragged.documents_on_varlen(chosen["cudnn_ragged"])
        elif name not in chosen:
            chosen[name] = kernels.select_kernel(device, dtype, args.head_dim, name)
    chosen = {name: chosen[name] for name in names}
    scale = args.head_dim ** -0.5
    specs = {name: AttentionSpec("ring", "contiguous", True, scale, kernel, 1, True, varlen=kernel.native_varlen)
             for name, kernel in chosen.items()}
    lengths = corpus_lengths() if args.documents == "corpus" else None
    samples = sample_documents(args.seqlen, args.samples, args.seed, lengths, args.median)
    index = torch.arange(args.seqlen)  # a token's position in its document: its index less its document's start
    plans = [plan_for_documents(d[None, None], (index - document_starts(d))[None, None], 0, True) for d in samples]
    whole = plan_for_documents(torch.zeros(1, 1, args.seqlen, dtype=torch.long),
                               torch.arange(args.seqlen)[None, None], 0, True)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    tensors = tuple(torch.randn(1, args.seqlen, heads, args.head_dim, generator=gen, device=device, dtype=dtype)
                    for heads in (args.heads, args.kv_heads, args.kv_heads, args.heads))
    cases = {name: (specs[name], plans) for name in names}
    cases["one document"] = (specs[names[0]], [whole] * len(plans))

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    times: dict[str, list[float]] = {name: [] for name in cases}
    for number in range(args.warmup + args.rounds):
        for name, (spec, case_plans) in cases.items():
            began = clock()
            for plan in case_plans:
                _pass(spec, plan, tensors)
            if number >= args.warmup:
                times[name].append((clock() - began) / len(case_plans))
    pairs = [sum(n * (n + 1) // 2 for n in torch.unique_consecutive(d, return_counts=True)[1].tolist())
             for d in samples]
    dense_pairs = args.seqlen * (args.seqlen + 1) // 2
    records, first = [], median(times[names[0]])
    for name, (spec, _) in cases.items():
        seconds = median(times[name])
        mean_pairs = dense_pairs if name == "one document" else sum(pairs) / len(pairs)
        records.append({"backend": name, "kernel": spec.kernel.name, "documents_per_sample": round(
            float(np.mean([len(torch.unique(d)) for d in samples])), 1) if name != "one document" else 1,
                        "ms": round(1e3 * seconds, 3), "vs_first": round(seconds / first, 3),
                        "tflops": round(14 * mean_pairs * args.heads * args.head_dim / seconds / 1e12, 1),
                        "seqlen": args.seqlen, "device": device.type, "dtype": args.dtype})
    emit(records, [("backend", "backend", str), ("kernel", "kernel", str), ("documents_per_sample", "docs", str),
                   ("ms", "ms fwd+bwd", lambda x: f"{x:.2f}"), ("tflops", "TFLOP/s", lambda x: f"{x:.1f}"),
                   ("vs_first", "vs first", lambda x: f"{x:.2f}")])
    return records


if __name__ == "__main__":
    main()
