"""Kernel plans built per step with packed documents: the CP ranks as persistent threads of one process.

    python -m bench.cudnn_graphs                      # GPU: cp 4 zigzag, 16 steps of 16,384 tokens, bf16
    python -m bench.cudnn_graphs --device cpu --seqlen 2048 --heads 4 --kv-heads 2 --head-dim 32   # CPU

cuDNN's SDPA builds one execution graph per call shape (forward and backward apart) and keeps it in a thread-local
cache; a step that meets a new shape waits ~40 ms per graph on the host. This runs the ring's forward and backward
on ``--world`` rank threads that live for the whole run (as a rank's threads do in training: the caches persist),
each step a new sample of lognormal packed documents (median 512 tokens), and records every dense kernel call's key
(the thread, forward or backward, causal, every operand's shape, strides past a single sample's batch and dtype): a
key seen for the first time is a graph cuDNN builds. Prints a JSON line per step (new keys, distinct keys so far,
milliseconds) and a summary; on CUDA with ``TORCH_CUDNN_SDPA_CACHE_DEBUG=1`` (set here) cuDNN's own cache lookups
and hit rate per thread are read from its warnings as a cross-check (``main`` sets it before cuDNN's first lookup,
which reads it once). The issue's bar: no new key after step 3. ``DenseKeys`` also serves ``bench.step_profile``
(the trainer's steps). ``--kernel cudnn_ragged``: the documents as one dense call each, keyed as PyTorch's ragged
graphs are (lengths rounded up to powers of two: ``cp_train.parallel.kernels.cudnn_ragged``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from cp_train.parallel.cp.layout import sequence_positions, shard_sequence
from cp_train.parallel.cp.plan.rank_plan import plan_for_documents
from cp_train.parallel.cp.ring import warm
from cp_train.parallel.cp.ring.backward import ring_backward
from cp_train.parallel.cp.ring.forward import ring_forward
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.kernels import cudnn_ragged
from cp_train.parallel.kernels import select as kernels

CACHE_LINE = re.compile(r"SDPA Cache Called (\d+) times\. Hit rate: (\d+)%")


class DenseKeys:
    """Records the dense calls of a kernel class (not those a varlen call makes segment by segment, which only
    kernels without a varlen entry do): ``step`` is set by the caller; ``new_by_step`` counts the keys first seen
    at each step (each one a graph cuDNN builds)."""

    def __init__(self) -> None:
        self.step, self.first_seen, self.lock, self.inside = 0, {}, threading.Lock(), threading.local()

    def note(self, kind: str, causal: bool, *tensors: torch.Tensor, ragged: bool = False) -> None:
        """One dense call's key; ``ragged``: as PyTorch's ragged dense path makes it (``cudnn_ragged.graph_key``:
        a kernel with ``ragged_graphs``)."""
        if getattr(self.inside, "varlen", False):
            return
        if ragged:  # the backward's (dout, q, out, k, v): the key is q's, k's and v's
            key = cudnn_ragged.graph_key(kind, causal, *(tensors[:3] if kind == "forward" else tensors[1:2] +
                                                         tensors[3:]))
        else:  # one sample: cuDNN's view has no batch stride (``cudnn.op_view``)
            key = tuple((tuple(x.shape), x.stride()[x.shape[0] == 1:], x.dtype) for x in tensors)
        with self.lock:
            self.first_seen.setdefault((threading.get_ident(), kind, causal, key), self.step)

    def new_by_step(self, steps: int) -> list[int]:
        counts = [0] * (steps + 1)
        for step in self.first_seen.values():
            counts[min(step, steps)] += 1
        return counts

    @contextmanager
    def recording(self, kernel_class: type) -> Iterator[DenseKeys]:
        """``kernel_class``'s dense forward and backward note their keys inside the block."""
        forward, backward = kernel_class.forward, kernel_class.backward
        varlen = {name: getattr(kernel_class, name) for name in ("varlen_forward", "varlen_backward")}

        def inside_varlen(method):  # noqa: ANN001, ANN202
            def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                self.inside.varlen = True
                try:
                    return method(*args, **kwargs)
                finally:
                    self.inside.varlen = False
            return call

        def noted_forward(kernel, q, k, v, causal, scale):  # noqa: ANN001, ANN202 - the kernel contract's
            self.note("forward", causal, q, k, v, ragged=getattr(kernel, "ragged_graphs", False))
            return forward(kernel, q, k, v, causal, scale)

        def noted_backward(kernel, rows, k, v, causal, scale):  # noqa: ANN001, ANN202
            self.note("backward", causal, rows.dout, rows.q, rows.out, k, v,
                      ragged=getattr(kernel, "ragged_graphs", False))
            return backward(kernel, rows, k, v, causal, scale)

        kernel_class.forward, kernel_class.backward = noted_forward, noted_backward
        for name, method in varlen.items():
            setattr(kernel_class, name, inside_varlen(method))
        try:
            yield self
        finally:
            kernel_class.forward, kernel_class.backward = forward, backward
            for name, method in varlen.items():
                setattr(kernel_class, name, method)


class CacheWarnings:
    """cuDNN's ``TORCH_CUDNN_SDPA_CACHE_DEBUG`` warnings, kept per thread (the last lookup count and hit rate)."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, int]] = {}
        self._shown = warnings.showwarning

    def __enter__(self) -> CacheWarnings:
        def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
            found = CACHE_LINE.search(str(message))
            if found:
                self.last[threading.current_thread().name] = (int(found[1]), int(found[2]))
            else:
                self._shown(message, category, filename, lineno, file, line)
        warnings.showwarning = show
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc: object) -> None:
        warnings.showwarning = self._shown


def lognormal_documents(seqlen: int, samples: int, seed: int, median: int = 512) -> torch.Tensor:
    """Document ids ``[samples, seqlen]``: lognormal lengths (``median``, sigma 1) packed back to back."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < seqlen * samples:
        lengths.append(max(1, int(rng.lognormal(np.log(median), 1.0))))
    return torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)[: seqlen * samples]).view(samples, seqlen)


class _Comm:
    """Rank ``rank``'s ring exchange between threads: a send is a copy put in the next rank's inbox."""

    def __init__(self, rank: int, world: int, inboxes: dict) -> None:
        self.rank, self.world, self.inboxes = rank, world, inboxes

    def exchange(self, send, recv_shapes=None, tag: int = 0, like=None) -> Any:  # noqa: ANN001
        if send:
            self.inboxes[(self.rank + 1) % self.world, tag].put([x.clone() for x in send])
        inbox, count = self.inboxes[self.rank, tag], len(recv_shapes) if recv_shapes is not None else len(send)
        return type("Received", (), {"wait": lambda _self: inbox.get(timeout=120) if count else []})()


def run(args: argparse.Namespace, kernel: Any = None, keys: DenseKeys | None = None) -> list[dict[str, Any]]:
    """``args.steps`` ring steps on persistent rank threads; one record per step and a summary record. ``kernel``:
    the attention kernel (default: the one selected for the device); ``keys``: the recorder (its ``step`` is the
    step running)."""
    import queue

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    kernel = kernel or kernels.select_kernel(device, dtype, args.head_dim, getattr(args, "kernel", None))
    ragged = getattr(kernel, "ragged_graphs", False)  # documents as dense calls (their full pieces varlen: rectangles)
    spec = AttentionSpec("ring", args.layout, True, args.head_dim ** -0.5, kernel, 1, True, varlen=not ragged,
                         rectangles=getattr(kernel, "varlen_rectangles", False))
    docs = lognormal_documents(args.seqlen, args.steps, seed=args.seed)
    world, rows = args.world, args.seqlen // args.world
    positions = torch.stack([sequence_positions(args.seqlen, r, world, args.layout) for r in range(world)])
    inboxes = {(rank, tag): queue.Queue() for rank in range(world) for tag in (0, 1)}
    start, done = threading.Barrier(world + 1), threading.Barrier(world + 1)
    errors: list[BaseException] = []
    gen = torch.Generator(device=device).manual_seed(args.seed)
    make = lambda heads: torch.randn(1, rows, heads, args.head_dim, generator=gen, device=device, dtype=dtype)  # noqa: E731
    local = [[make(args.heads), make(args.kv_heads), make(args.kv_heads), make(args.heads)] for _ in range(world)]

    def rank_main(rank: int) -> None:
        comm = _Comm(rank, world, inboxes) if world > 1 else None
        for step in range(args.steps):
            start.wait()
            try:
                sample = docs[step:step + 1]
                shards = torch.stack([shard_sequence(sample, r, world, args.layout) for r in range(world)])
                plan = plan_for_documents(shards, positions[:, None], rank, True)
                q, k, v, dout = local[rank]
                out, lse = ring_forward(q, k, v, comm, spec, plan)
                ring_backward(dout, q, k, v, out.to(dtype), lse, comm, spec, plan)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except BaseException as error:  # noqa: BLE001 - reported by the main thread
                errors.append(error)
            done.wait()

    keys, records = keys or DenseKeys(), []
    warm.ENABLED = not args.no_warm
    forced = args.plans_per_shape and not getattr(type(kernel), "plans_per_shape", False)
    if forced:  # a CPU kernel counted as if it built plans per shape (to see the warm-up's keys)
        type(kernel).plans_per_shape = True
    with CacheWarnings() as cache, keys.recording(type(kernel)):
        threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}", daemon=True) for r in range(world)]
        for thread in threads:
            thread.start()
        for step in range(args.steps):
            keys.step = step + 1
            began = time.perf_counter()
            start.wait()
            done.wait()
            if errors:
                raise errors[0]
            counts = keys.new_by_step(args.steps)
            records.append({"step": step + 1, "new_keys": counts[step + 1], "keys": sum(counts),
                            "ms": round(1000 * (time.perf_counter() - began), 1)})
            print(json.dumps(records[-1]), flush=True)
        for thread in threads:
            thread.join()
    late = sum(keys.new_by_step(args.steps)[4:])
    warm.ENABLED = True
    if forced:
        del type(kernel).plans_per_shape
    lookups = {name: {"lookups": n, "hit_rate_percent": p} for name, (n, p) in sorted(cache.last.items())}
    summary = {"summary": True, "kernel": kernel.name, "device": device.type, "world": world, "layout": args.layout,
               "seqlen": args.seqlen, "steps": args.steps, "warm": not args.no_warm, "keys": len(keys.first_seen),
               "new_after_step_1": sum(keys.new_by_step(args.steps)[2:]), "new_after_step_3": late,
               "cudnn_cache": lookups}
    print(json.dumps(summary), flush=True)
    return records + [summary]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layout", default="zigzag", choices=["zigzag", "stripe", "contiguous"])
    parser.add_argument("--seqlen", type=int, default=16384, help="tokens per sample (over all ranks)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernel", default=None, help="the attention backend (default: the automatic choice); "
                        "cudnn_ragged: the documents as dense calls on PyTorch's ragged graphs")
    parser.add_argument("--no-warm", action="store_true", help="without the ring's warm-up (parallel/cp/ring/warm.py)")
    parser.add_argument("--plans-per-shape", action="store_true",
                        help="treat the selected kernel as one that builds a plan per shape (CPU: see the warm-up)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCH_CUDNN_SDPA_CACHE_DEBUG", "1")  # read once, at cuDNN's first cache lookup
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --device cpu (counts the CPU kernel's keys)")
    if args.seqlen % (2 * args.world):
        parser.error(f"--seqlen {args.seqlen} must split into 2 x --world {args.world} chunks")
    return run(args)


if __name__ == "__main__":
    main()
