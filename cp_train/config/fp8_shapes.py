"""``model.fp8``'s shape rules, on the config alone: ``validate`` runs them, so a ``--dry-run`` on a CPU login node
refuses what the GPU would. They apply on the CPU too (torchao's emulation there takes any shape, but the config is
meant for a GPU, and every FP8 test config keeps them).

On CUDA torchao's FP8 GEMMs are ``torch._scaled_mm``, which needs the inner dim and the second operand's columns to be
multiples of 16. A block linear whose TP-local weight is ``[N, K]`` (``ModelFamily.block_linears``, split by tp) runs
three over ``M`` tokens: the output ``[M, K] x [K, N]``, the input's gradient ``[M, N] x [N, K]`` and the weight's
gradient ``[N, M] x [M, K]``; so N, K and M must all be multiples of 16. M is a micro-batch's tokens on one rank,
``train.micro_batch_size * data.seq_len / parallel.cp``: sequence parallelism gathers the sequence back before the
column-parallel layers (and the row-parallel ones run before the reduce-scatter), Ulysses exchanges heads inside the
attention, after the projections. With ``model.mlp_chunks`` the MLP's linears see each chunk
(``model/mlp.py``: ``tensor_split`` along the sequence, the first chunks one token longer).

``fp8_notes``: the lines a run with FP8 logs at its start (eager FP8 on a GPU; weights FSDP gathers in the compute
dtype, ``parallel/tp/fp8.py``'s ``fsdp_gathers_fp8``).
"""

from __future__ import annotations

import math

from cp_train.config.schema import Config, ConfigError
from cp_train.model.family import Linear, get_model_family
from cp_train.parallel.tp.fp8 import fsdp_gathers_fp8

MULTIPLE = 16  # torch._scaled_mm's GEMM dims


def check_fp8_shapes(config: Config) -> None:
    """ConfigError (one line, the keys to change) when ``model.fp8`` is on and a block linear's TP-local weight, a
    micro-batch's tokens per rank or an MLP chunk's tokens is no multiple of 16. Call after the model's own checks."""
    recipe = config.model.fp8
    if recipe == "none":
        return
    tp = config.parallel.tp
    for linear, shape in local_linears(config):
        if any(dim % MULTIPLE for dim in shape):
            raise ConfigError(f"model.fp8 {recipe}: the GPU's FP8 GEMMs need weight dims that are multiples of 16 and "
                              f"the blocks' {linear.name} weight is {list(shape)} on each TP rank (parallel.tp {tp}): "
                              f"change the model's widths (model.hidden_size, ffn_hidden_size, num_heads, "
                              f"num_kv_heads, head_dim) or parallel.tp, or set model.fp8=none")
    batch, seq, cp = config.train.micro_batch_size, config.data.seq_len, config.parallel.cp
    local = seq // cp
    if batch * local % MULTIPLE:
        raise ConfigError(f"model.fp8 {recipe}: the weights' gradients are GEMMs over a micro-batch's tokens per rank, "
                          f"train.micro_batch_size * data.seq_len / parallel.cp = {batch} * {seq} / {cp} = "
                          f"{batch * local}, and the GPU's FP8 GEMMs need a multiple of 16: make data.seq_len a "
                          f"multiple of {cp * MULTIPLE // math.gcd(batch, MULTIPLE)} or train.micro_batch_size a "
                          f"multiple of {MULTIPLE // math.gcd(local, MULTIPLE)}, or set model.fp8=none")
    chunks = config.model.mlp_chunks
    if not _chunks_fit(chunks, batch, local):
        sizes = sorted({batch * n for n in _chunk_lengths(chunks, local)}, reverse=True)
        below = max(c for c in range(1, chunks) if _chunks_fit(c, batch, local))  # 1 fits: the check above
        above = next((c for c in range(chunks + 1, 4 * chunks) if _chunks_fit(c, batch, local)), None)
        fix = f"{below} or {above}" if above else str(below)
        raise ConfigError(f"model.fp8 {recipe}: model.mlp_chunks {chunks} cuts a micro-batch's {batch} x {local} "
                          f"tokens per rank (train.micro_batch_size x data.seq_len / parallel.cp) into MLP chunks of "
                          f"{' and '.join(map(str, sizes))} tokens, and the GPU's FP8 GEMMs need multiples of 16: set "
                          f"model.mlp_chunks to {fix}, or model.fp8=none")


def _chunk_lengths(chunks: int, length: int) -> set[int]:
    """The lengths ``tensor_split`` cuts ``length`` into (``model/mlp.py``: at most one chunk per token)."""
    chunks = min(chunks, length)
    return {-(-length // chunks), length // chunks} if length % chunks else {length // chunks}


def _chunks_fit(chunks: int, batch: int, length: int) -> bool:
    return all(batch * n % MULTIPLE == 0 for n in _chunk_lengths(chunks, length))


def local_linears(config: Config) -> list[tuple[Linear, tuple[int, int]]]:
    """Each block linear with its weight's shape ``[out, in]`` on one TP rank."""
    tp = config.parallel.tp
    return [(linear, linear.shard(tp)[::-1]) for linear in get_model_family(config.model.family)
            .block_linears(config.model)]


def fp8_notes(config: Config, dp: int, cuda: bool) -> tuple[str, ...]:
    """The lines a run with ``model.fp8`` logs at its start: eager FP8 on a GPU (``cuda``) is slower than bf16; the
    block linears FSDP gathers in the compute dtype, not FP8 (``dp``: ``validate``'s). Empty without FP8."""
    recipe, parallel, notes = config.model.fp8, config.parallel, []
    if recipe == "none":
        return ()
    if cuda and not config.train.compile:
        notes.append(f"warning: model.fp8 {recipe} without train.compile runs many small cast and scale kernels around "
                     f"each matmul, usually slower than bf16: set train.compile=true (--compile)")
    if recipe == "tensorwise" and parallel.fsdp:
        shards = dp * parallel.cp // parallel.dp_replicate
        bf16 = [linear.name for linear, shape in local_linears(config)
                if not fsdp_gathers_fp8(shape, linear.split == "column", parallel.tp, shards)]
        if bf16:
            notes.append(f"model.fp8 tensorwise: FSDP gathers the blocks' {', '.join(bf16)} weights in the compute "
                         f"dtype, not FP8, as they do not split evenly over its {shards} ranks (their matmuls still "
                         f"run in FP8)")
    return tuple(notes)
