"""The calibration's measurements on spawned gloo ranks (``calibrate.py`` runs them): collectives, the CP
attention op's own cost per call, and how much ranks sharing the machine slow each other.

- Links: all-reduce, all-gather and a ring exchange of 4 KiB to 8 MiB at each world size, fitted to the time
  model's ``bytes / bandwidth + ring steps * step latency + call latency`` (``fit_link``).
- The CP attention op (``context_parallel_attention``, forward + backward, what every layer calls) at a negligible
  size (one sample, 8 rows per rank, head_dim 8) for ring, all-gather and Ulysses, with one and two kv-head chunks
  (one thread per rank: a chunk per kv head): its Python, dispatch, message posting and waiting, everything but
  the arithmetic and the bytes, per call, for the whole world as the CP group.
- FSDP2 at a negligible size: a tiny model's forward + backward sharded (each block and the root a unit, as
  ``model/parallelize.py`` shards it) against the same unsharded, per unit: its hooks, copies and collective calls,
  everything but the bytes.
- The same op at a moderate size (``SIZED_*``), its kernel included, each call after a GEMM as in a step:
  ``op_bytes.py`` takes out what the planner plans for it (the GEMM, the kernels, the negligible call's costs alone
  and in a step) and charges the rest per byte of the call's tensors (in a step the extra depends on the size: at
  2 ranks 5 ms for a negligible ring call and under 1 ms more at the moderate size, 3 and 6 ms for Ulysses).
- The model's forward + backward (``GPTModel``, cpu-tiny's shape at 512 tokens) on one rank alone, on all the
  cores' threads (the thread speedup), and on every rank of a world of ``cores``
  one-thread ranks at once: how much the ranks slow each other (memory bandwidth and caches are shared).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

ALGORITHMS = ("ring", "allgather", "ulysses")
def _collective_calls(size: int) -> dict[str, Callable[[], object]]:
    """The collectives of ``size`` bytes per rank (a reduce-scatter's or all-to-all's whole input, an all-gather's
    part), as calls: the all-reduce, all-gather (into a list) and ring exchange (send to the next rank, receive
    from the previous) the combined fit uses, and each kind as the trainer calls it (``KIND_CALLS``): functional
    all-gather and reduce-scatter (sequence parallelism, FSDP2), an async all-to-all (Ulysses and the all-gather
    algorithm), an async all-reduce (DDP's buckets)."""
    import torch.distributed as dist

    from cp_train.parallel.compat import functional_all_gather, functional_reduce_scatter

    world, rank = dist.get_world_size(), dist.get_rank()
    x, recv = torch.ones(size // 4), torch.empty(size // 4)
    parts = [torch.empty_like(x) for _ in range(world)]
    full = torch.ones(size // 4 // world * world)
    group = dist.group.WORLD

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return {"all_reduce": lambda: dist.all_reduce(x), "all_gather": lambda: dist.all_gather(parts, x), "p2p": exchange,
            "kind:all_reduce": lambda: dist.all_reduce(x, async_op=True).wait(),
            "kind:all_gather": lambda: functional_all_gather(x, 0, group).wait(),
            "kind:reduce_scatter": lambda: functional_reduce_scatter(full, "sum", 0, group).wait(),
            "kind:all_to_all": lambda: dist.all_to_all_single(recv, x, async_op=True).wait()}


def _collective_sweep(sizes: tuple[int, ...]) -> list[tuple[str, int, float]]:
    """On every rank of a spawned world: ``[(kind, bytes per rank, seconds)]`` of ``_collective_calls`` at each
    size, the median of three timings of the same number of calls on every rank."""
    import torch.distributed as dist

    out = []
    for size in sizes:
        calls = max(4, min(100, (4 << 20) // size))
        for kind, call in _collective_calls(size).items():
            call()
            samples = []
            for _ in range(3):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                samples.append((time.perf_counter() - start) / calls)
            out.append((kind, size, statistics.median(samples)))
    return out


def fit_link(world: int, samples: list[tuple[str, int, float]]) -> tuple[float, float, float]:
    """``(GB/s, step latency us, call latency us)`` fitted to ``time_model.collective_seconds``'s form, each sample
    weighted by 1/time (relative errors), coefficients kept >= 0."""
    import numpy as np

    from cp_train.plan.time_model import collective_seconds

    def row(kind: str, size: int) -> list[float]:
        moved = collective_seconds(kind, size, world, (1.0, 0.0))  # bytes moved per rank
        steps = collective_seconds(kind, 1, world, (math.inf, 1.0))  # ring steps
        return [moved, steps, 0.0 if kind == "p2p" else 1.0]

    a = np.array([row(kind, size) for kind, size, _ in samples])
    t = np.array([seconds for _, _, seconds in samples])
    keep = [0, 1, 2]
    while True:
        coef = np.zeros(3)
        solved = np.linalg.lstsq(a[:, keep] / t[:, None], np.ones(len(t)), rcond=None)[0]
        coef[keep] = solved
        negative = [i for i in keep if coef[i] < 0 and i != 0]
        if not negative:
            break
        keep.remove(negative[0])
    per_byte = max(float(coef[0]), 1e-12)
    return 1 / per_byte / 1e9, float(coef[1]) * 1e6, float(coef[2]) * 1e6


def _median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``call`` on this rank, every rank starting each repeat together."""
    import torch.distributed as dist

    for _ in range(2):
        call()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# the sized call (``attention_call_sweep``): rows per rank, head_dim, samples
SIZED_ROWS, SIZED_HEAD_DIM, SIZED_BATCH = 256, 32, 2
# the GEMM before each call in a step: 0.52 GFLOP, about one cpu-tiny layer's forward linears at cp 2 (0.40)
PHASE_SIZE = 640


def _attention_call(algorithm: str, chunks: int, rows: int = 8, head_dim: int = 8, batch: int = 1
                    ) -> Callable[[], None]:
    """The CP attention op's forward + backward over the whole world, ``rows`` per rank (a negligible size by
    default), with ``chunks`` kv-head chunks at one thread (Ulysses: kv heads per rank after its all-to-all)."""
    import torch.distributed as dist

    from cp_train.parallel.cp.attention import build_cp_plan, context_parallel_attention

    world = dist.get_world_size()
    kv = chunks * world if algorithm == "ulysses" else chunks
    q = torch.randn(batch, rows, 4 * world, head_dim, requires_grad=True)
    k, v = (torch.randn(batch, rows, kv, head_dim, requires_grad=True) for _ in range(2))
    plan = build_cp_plan(dist.group.WORLD, "zigzag", True, rows, algorithm=algorithm)

    def call() -> None:
        out = context_parallel_attention(q, k, v, dist.group.WORLD, "zigzag", True, backend="torch", plan=plan,
                                         algorithm=algorithm)
        out.backward(torch.ones_like(out))

    return call


def call_bytes(algorithm: str, world: int, rows: int = 8, head_dim: int = 8, batch: int = 1) -> int:
    """Bytes of ``_attention_call``'s q, k, v and output on one rank (fp32), its chunks 1."""
    kv = world if algorithm == "ulysses" else 1
    return batch * rows * (2 * 4 * world + 2 * kv) * head_dim * 4


def attention_call_sweep(repeats: int = 5, rounds: int = 3) -> tuple[list[tuple[str, int, float]],
                                                                     list[tuple[str, float]]]:
    """On every rank: ``([(algorithm, kv-head chunks, seconds)], [(algorithm, seconds)], [(algorithm, seconds)])``:
    ``_attention_call`` at a negligible size with one and two chunks; and in a step, each call after a ``PHASE_SIZE``
    GEMM as a layer's linears precede it (one chunk; the seconds of two GEMMs and two calls), at the negligible size
    and at the sized shape (``SIZED_*``, the kernel's arithmetic included: ``op_bytes.py`` takes what the planner
    plans for it out).
    Each the fastest of ``rounds`` medians of ``repeats`` calls, the rounds taking turns (a burst of other work on a
    shared machine spoils one round, not the figure)."""
    calls: dict[tuple[str, int], Callable[[], object]] = {
        (algorithm, chunks): _attention_call(algorithm, chunks) for algorithm in ALGORITHMS for chunks in (1, 2)}
    a, b = torch.randn(PHASE_SIZE, PHASE_SIZE), torch.randn(PHASE_SIZE, PHASE_SIZE)
    for algorithm in ALGORITHMS:  # 0: the sized call in a step, -1: the negligible one
        sized = _attention_call(algorithm, 1, SIZED_ROWS, SIZED_HEAD_DIM, SIZED_BATCH)
        for key, call in ((0, sized), (-1, calls[algorithm, 1])):
            calls[algorithm, key] = lambda call=call: (torch.mm(a, b), call(), torch.mm(a, b), call())
    best = {key: math.inf for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            best[key] = min(best[key], _median_seconds(call, repeats))
    return ([(algorithm, chunks, seconds) for (algorithm, chunks), seconds in best.items() if chunks > 0],
            [(algorithm, seconds) for (algorithm, chunks), seconds in best.items() if chunks == 0],
            [(algorithm, seconds) for (algorithm, chunks), seconds in best.items() if chunks < 0])


FSDP_LAYERS = 4


def fsdp_unit_seconds(repeats: int = 5, rounds: int = 3) -> float:
    """On every rank: seconds per FSDP unit of a forward + backward at a negligible size (``FSDP_LAYERS`` blocks
    and the root, sharded over the whole world), over the same model unsharded; the fastest of ``rounds``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cp_train.model.config import ModelConfig
    from cp_train.model.gpt import GPTModel
    from cp_train.model.parallelize import shard_with_fsdp

    config = ModelConfig(vocab_size=64, num_layers=FSDP_LAYERS, hidden_size=16, num_heads=2, num_kv_heads=1,
                         ffn_hidden_size=32, max_position_embeddings=8, tie_embeddings=True)
    plain, sharded = GPTModel(config), GPTModel(config)
    shard_with_fsdp(sharded, init_device_mesh("cpu", (dist.get_world_size(),)))
    tokens = torch.randint(0, 64, (1, 8))
    calls = [lambda model=model: model(tokens, labels=tokens).sum().backward() for model in (plain, sharded)]
    best = [math.inf, math.inf]
    for _ in range(rounds):
        for index, call in enumerate(calls):
            best[index] = min(best[index], _median_seconds(call, repeats))
    return max(0.0, best[1] - best[0]) / (FSDP_LAYERS + 1)


# cpu-tiny's model (launch/configs/cpu-tiny.yaml, the embedded corpus's vocabulary) and 4 x 128 tokens
MODEL = {"vocab_size": 8192, "num_layers": 4, "hidden_size": 192, "num_heads": 6, "num_kv_heads": 2,
         "ffn_hidden_size": 512, "max_position_embeddings": 128, "tie_embeddings": True}
BATCH, SEQ = 4, 128


def model_step_seconds(repeats: int = 5, threads: int = 1) -> float:
    """Seconds of the fastest of ``repeats`` forward + backward of ``MODEL`` on ``BATCH x SEQ`` tokens on ``threads``
    threads, glibc keeping freed memory as the trainer's CPU ranks do (``cpu_memory.keep_freed_memory``)."""
    from cp_train.memory.cpu_memory import keep_freed_memory
    from cp_train.model.config import ModelConfig
    from cp_train.model.gpt import GPTModel

    keep_freed_memory()
    torch.set_num_threads(threads)
    model = GPTModel(ModelConfig(**MODEL))
    tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ))
    samples = []
    for index in range(repeats + 2):
        start = time.perf_counter()
        model(tokens, labels=tokens).sum().backward()
        if index >= 2:
            samples.append(time.perf_counter() - start)
    return min(samples)


def measure_ranks(worlds: tuple[int, ...], sizes: tuple[int, ...], cores: int, repeats: int,
                  say: Callable[[str], None]) -> tuple[list, list, float, float, list, list, list, list]:
    """Gloo links, the CP attention op's cost per call and FSDP's per unit at each of ``worlds``, the sharing
    efficiency and the model step's speedup on all ``cores`` threads: ``([(ranks, GB/s, step us, call us)],
    [[ranks, algorithm, chunks, us]], efficiency, speedup, [[ranks, us per FSDP unit]], [(ranks, kind, GB/s, step
    us, call us)], [(ranks, algorithm, sized in-step pair s)], [(ranks, algorithm, in-step pair s)])``."""
    from cp_train.parallel.spawn import SpawnedWorld

    links, calls, units, kinds, sized, in_step = [], [], [], [], [], []
    with SpawnedWorld(1, threads=1, timeout_s=300) as spawned:
        alone = spawned.run(model_step_seconds)[0]
        speedup = min(float(cores), max(1.0, alone / spawned.run(model_step_seconds, threads=cores)[0]))
    shared = alone
    for world in worlds:
        with SpawnedWorld(world, threads=1, timeout_s=300) as spawned:
            samples = spawned.run(_collective_sweep, sizes)[0]
            links.append((world, *fit_link(world, [sample for sample in samples if ":" not in sample[0]])))
            for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
                mine = [(kind, size, t) for name, size, t in samples
                        if name == f"kind:{kind}" or (kind == "p2p" and name == "p2p")]
                kinds.append((world, kind, *fit_link(world, mine)))
            small, sized_calls, step_pairs = spawned.run(attention_call_sweep, repeats)[0]
            for algorithm, chunks, seconds in small:
                calls.append([world, algorithm, chunks, seconds * 1e6])
            sized.extend((world, algorithm, seconds) for algorithm, seconds in sized_calls)
            in_step.extend((world, algorithm, seconds) for algorithm, seconds in step_pairs)
            units.append([world, max(spawned.run(fsdp_unit_seconds, repeats)) * 1e6])
            if world == cores:
                shared = statistics.median(spawned.run(model_step_seconds))
        say(f"gloo {world} ranks: {links[-1][1]:.3g} GB/s per rank, {links[-1][2]:.4g} us per ring step, "
            f"{links[-1][3]:.4g} us a call; CP attention op per call: " + ", ".join(
                f"{a} x{c} {us / 1000:.2f} ms" for w, a, c, us in calls if w == world)
            + f"; FSDP {units[-1][1] / 1000:.2f} ms per unit; by kind (GB/s, step us, call us): " + ", ".join(
                f"{k} {gb:.3g} {step:.4g} {call:.4g}" for w, k, gb, step, call in kinds if w == world))
    efficiency = min(1.0, alone / shared)
    say(f"model step alone {alone * 1000:.1f} ms, {speedup:.2f}x faster on {cores} threads; sharing: {cores} "
        f"one-thread ranks at once each run at {efficiency:.2f} of one alone")
    return links, calls, efficiency, speedup, units, kinds, sized, in_step
