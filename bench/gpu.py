"""Attention kernels and training steps on one GPU: TFLOP/s against PyTorch's SDPA flash path, and MFU.

    python -m bench.gpu                          # kernels at 4k-64k tokens, then gpt-125m and gpt-1b steps
    python -m bench.gpu --parts kernels --seqlens 8192 16384 --head-dims 128
    python -m bench.gpu --device cpu --tiny      # the same code on CPU at toy sizes (a smoke test)

Kernels (bf16, causal, batch 1, ``--hidden`` / head_dim heads): ``sdpa_flash`` is
``F.scaled_dot_product_attention`` restricted to its flash backend, the baseline; ``kernel:<name>`` is
each backend of ``cp_train.parallel.kernels.select`` present here, called directly (forward, then backward from
its own out/lse); ``ring_path`` is ``context_parallel_attention`` at cp=1 through autograd, the
path the model takes; ``ring_blocks`` is the ring's per-block machinery on one rank (head chunks,
fp32 accumulators, the merged-lse backward). ``ratio`` is TFLOP/s over the baseline's in the same run.

Training (``--models``): one optimizer step of a shipped config at cp=1 on this GPU, ``--train-seq``
tokens in two documents (a CP plan built on the CPU), micro batch 1, bf16 autocast, fused AdamW, eager and compiled
(``--modes``; ``train.compile``): tokens/s, model TFLOP/s (``model/family.py``), MFU against the GPU's dense bf16
peak (``cp_train/metrics/throughput.py``), peak memory, and ``host syncs``: "none" when one more step runs under
``torch.cuda.set_sync_debug_mode("error")``, else the first error.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import emit, median
from cp_train.config.sources import load_config
from cp_train.metrics.throughput import gpu_peak_tflops
from cp_train.model import GPTModel, model_flops_per_token
from cp_train.parallel.cp.attention import context_parallel_attention
from cp_train.parallel.cp.plan.rank_plan import plan_for_layout
from cp_train.parallel.cp.ring.backward import ring_backward
from cp_train.parallel.cp.ring.forward import ring_forward
from cp_train.parallel.cp.spec import AttentionSpec, default_head_chunks, default_overlap
from cp_train.parallel.kernels import select as kernels
from cp_train.parallel.kernels.contract import BackwardRows

MODELS = {"gpt-125m": "launch/configs/gpt-125m-cp8.yaml", "gpt-1b": "launch/configs/gpt-1b-128k-cp8.yaml"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` after ``warmup`` calls."""
    times = []
    for index in range(warmup + repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return median(times)


def attention_cases(q, k, v, dout, device: torch.device) -> dict[str, Callable[[], object]]:
    """name -> one fwd+bwd of that path on q [B, S, H, D], k, v [B, S, Hk, D]."""
    def sdpa() -> None:
        qt, kt, vt = (x.detach().requires_grad_().transpose(1, 2) for x in (q, k, v))
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
        out.backward(dout.transpose(1, 2))

    def ring_path() -> None:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        context_parallel_attention(*leaves, None, causal=True).backward(dout)

    scale = q.shape[-1] ** -0.5
    spec = AttentionSpec("ring", "contiguous", True, scale, kernels.select_kernel(device, q.dtype, q.shape[-1]),
                    default_head_chunks(device, k.shape[2]), default_overlap(device))

    plan = plan_for_layout("contiguous", True, 1, 0, q.shape[1])

    def ring_blocks() -> None:  # the ring's block machinery (head chunks, fp32 accumulators), one rank
        out, lse = ring_forward(q, k, v, None, spec, plan)
        ring_backward(dout, q, k, v, out.to(q.dtype), lse, None, spec, plan)

    cases: dict[str, Callable[[], object]] = {"sdpa_flash": sdpa, "ring_path": ring_path, "ring_blocks": ring_blocks}
    for backend in kernels.BACKENDS:
        if backend in ("math", "cudnn_ragged"):  # cudnn_ragged's dense calls are cudnn's (bench.document_attention)
            continue
        try:
            kernel = kernels.select_kernel(device, q.dtype, q.shape[-1], backend)
        except kernels.KernelUnavailable:
            continue

        def direct(kernel=kernel) -> None:
            out, lse = kernel.forward(q, k, v, True, scale)
            kernel.backward(BackwardRows(dout, q, out, lse), k, v, True, scale)

        cases.setdefault(f"kernel:{kernel.name}", direct)
    return cases


def bench_kernels(args: argparse.Namespace, device: torch.device) -> list[dict]:
    records = []
    for head_dim in args.head_dims:
        heads = args.hidden // head_dim
        for seqlen in args.seqlens:
            gen = torch.Generator(device=device).manual_seed(0)
            q, k, v, dout = (torch.randn(1, seqlen, h, head_dim, generator=gen, device=device, dtype=args.dtype)
                             for h in (heads, heads // args.gqa, heads // args.gqa, heads))
            flops = 4.0 * seqlen * seqlen * heads * head_dim * 3.5 / 2  # fwd + bwd, causal
            base = None
            for name, fn in attention_cases(q, k, v, dout, device).items():
                seconds = time_call(fn, device, args.warmup, args.repeats)
                tflops = flops / seconds / 1e12
                base = base or tflops
                records.append({"part": "kernels", "case": name, "seqlen": seqlen, "heads": heads,
                                "kv_heads": heads // args.gqa, "head_dim": head_dim, "dtype": str(args.dtype),
                                "ms": 1000 * seconds, "tflops": tflops, "ratio": tflops / base})
            del q, k, v, dout
    return records


def _sync_check(step: Callable[[], None], device: torch.device) -> str:
    """"none" when one more ``step()`` runs under ``torch.cuda.set_sync_debug_mode("error")``, else the error."""
    if device.type != "cuda":
        return "n/a"
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as error:
        return str(error).splitlines()[0][:120]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "none"


def training_step(name: str, args: argparse.Namespace, device: torch.device, peak: float | None,
                  compiled: bool) -> dict:
    """Time one optimizer step of the shipped config ``name`` at cp=1 on ``device``, eager or with
    ``GPTModel.compile_parts`` (``train.compile``), and check a further step for host syncs."""
    config = load_config(MODELS[name]).model
    config.vocab_size = 32768
    if args.tiny:
        config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads = 2, 64, 4, 2
        config.ffn_hidden_size, config.vocab_size = 128, 512
    config.activation_checkpointing = "none" if args.no_checkpointing else config.activation_checkpointing
    config.max_position_embeddings = max(config.max_position_embeddings, args.train_seq)
    model = GPTModel(config, device=device)
    if compiled:
        model.compile_parts()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (1, args.train_seq + 1), generator=gen, device=device)
    documents = torch.zeros(1, args.train_seq, dtype=torch.long)
    documents[:, args.train_seq // 3:] = 1  # two documents: the varlen path
    plan = model.build_cp_plan(args.train_seq, documents)  # on the CPU, as the loader's workers build it
    plan = plan.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else plan

    def train_step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            losses = model(tokens[:, :-1], labels=tokens[:, 1:], plan=plan)
        losses.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = time_call(train_step, device, args.warmup, args.repeats)
    tflops = model_flops_per_token(config, args.train_seq) * args.train_seq / seconds / 1e12
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
    return {"part": "training", "case": f"{name} {'compiled' if compiled else 'eager'}", "seqlen": args.train_seq,
            "parameters": sum(p.numel() for p in model.parameters()),
            "activation_checkpointing": config.activation_checkpointing, "ms": 1000 * seconds,
            "tokens_per_s": args.train_seq / seconds, "tflops": tflops, "mfu": tflops / peak if peak else math.nan,
            "peak_gib": peak_gib, "host_syncs": _sync_check(train_step, device)}


def bench_training(args: argparse.Namespace, device: torch.device) -> list[dict]:
    peak = gpu_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return [training_step(name, args, device, peak, compiled) for name in args.models
            for compiled in (False, True) if ("compiled" if compiled else "eager") in args.modes]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", nargs="+", default=["kernels", "training"], choices=["kernels", "training"])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head_dim")
    parser.add_argument("--gqa", type=int, default=1, help="query heads per kv head")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--train-seq", type=int, default=8192)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"],
                        help="training steps eager and/or with train.compile")
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="turn the configs' activation checkpointing off")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke test)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU, or pass --device cpu --tiny for a smoke run")
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.seqlens, args.head_dims, args.hidden, args.train_seq = [128], [16], 64, 64
        args.warmup, args.repeats = 1, 1
    records = []
    if "kernels" in args.parts:
        records += bench_kernels(args, device)
    if "training" in args.parts:
        records += bench_training(args, device)
    num = lambda digits: (lambda x: "" if x is None else f"{x:.{digits}f}")  # noqa: E731
    text = lambda x: "" if x is None else str(x)  # noqa: E731
    emit(records, [("part", "part", text), ("case", "case", text), ("seqlen", "seqlen", text),
                   ("head_dim", "head_dim", text), ("ms", "ms", num(2)), ("tflops", "TFLOP/s", num(1)),
                   ("ratio", "vs sdpa_flash", num(3)), ("tokens_per_s", "tokens/s", num(0)),
                   ("mfu", "MFU", num(3)), ("peak_gib", "peak GiB", num(1)),
                   ("host_syncs", "host syncs", text)])
    return records


if __name__ == "__main__":
    main()
