"""The aten ops one rank dispatches in an optimizer step: the host work (Python, the dispatcher, autograd) a step
spends per op whatever the tensor sizes. The time model charges ``Rates.op_seconds`` for each: a CPU profile's
measured ``op_overhead_us``; 0 on a GPU profile (its launches run ahead of the kernels).

Counted with a dispatch mode (every aten and c10d op, the attention op's body included) over one
``Trainer.train_step`` of ``launch/configs/cpu-tiny.yaml`` variants, one document per sample, torch 2.13
(``python -m bench.planner --count-ops`` recounts them; tests/test_planner_cpu.py checks the cp 1 block).
Per layer and micro-batch, forward + backward, a block at cp 1 is about 250 ops:

====================================== =====  ========================================================
part                                     ops  what dispatches them
====================================== =====  ========================================================
two RMSNorms                              50  F.rms_norm decomposes on CPU: pow, mean, add, rsqrt, two
                                              muls forward; its backward about 19
QKV and output projections                28  a linear: t, view, mm, view forward; two mm and their t
                                              and views backward
q/k/v split, RoPE on q and k              52  slices and views; RoPE's slices, four muls, sub, add, cat
                                              forward and their backward, each of q and k
attention op at cp 1                      70  the custom op, its layout and the kernel's transposes and
                                              GQA expand forward, the flash backward and dK/dV sums
SwiGLU MLP, two residual adds             50  three linears, silu, mul, and their backward
====================================== =====  ========================================================

On top (measured, the same units): TP with sequence parallelism 60 (gathers, reduce-scatters and their
backward), without 10; DDP's hooks 10, FSDP2's 56 (its pre/post forward and backward hooks). Full checkpointing
recomputes the block's forward, 40% of its ops; selective recomputes the projections, RoPE and MLP, 102;
``mlp_chunks`` c > 1 checkpoints each slice, 73 per slice. Per micro-batch outside the blocks 43 (embedding,
final norm, head, loss; +42 with sequence parallelism, +16 TP without); per step 300 (loss-token sums, the
gradient norm, clipping, AdamW's foreach ops, zeroing the gradients). The CP algorithms' own ops (the ring at
cp 2 adds about 190 per layer, growing with the steps and kv-head chunks) are not counted here: on CPU the
calibration measures the CP attention op's whole cost per call, Python and messages included (``cpu_comm.py``).
"""

from __future__ import annotations

from cp_train.plan.workload import Workload

LAYER = 250.0
TP_SP, TP_PLAIN = 60.0, 10.0
DDP, FSDP = 10.0, 56.0
FULL_RECOMPUTE, SELECTIVE_RECOMPUTE, MLP_SLICE = 0.40, 102.0, 73.0
ROOT, ROOT_TP_SP, ROOT_TP_PLAIN = 43.0, 42.0, 16.0
STEP = 300.0


def layer_ops(work: Workload) -> float:
    """One layer's ops per micro-batch, forward + backward, with the recompute of activation checkpointing."""
    parallel, model = work.config.parallel, work.config.model
    block = LAYER
    if parallel.tp > 1:
        block += TP_SP if parallel.sequence_parallel_on else TP_PLAIN
    mode = model.activation_checkpointing
    recompute = {"full": FULL_RECOMPUTE * block, "selective": SELECTIVE_RECOMPUTE}.get(mode, 0.0)
    if mode == "none" and model.mlp_chunks > 1:
        recompute = MLP_SLICE * model.mlp_chunks
    hooks = 0.0
    if parallel.fsdp:
        hooks = FSDP
    elif (parallel.dp or 1) * parallel.cp > 1:
        hooks = DDP
    return block + recompute + hooks


def step_ops(work: Workload) -> float:
    """Ops of one optimizer step on this rank: every micro-batch's layers and root, and the step's own."""
    parallel = work.config.parallel
    root = ROOT
    if parallel.tp > 1:
        root += ROOT_TP_SP if parallel.sequence_parallel_on else ROOT_TP_PLAIN
    per_micro = work.config.model.num_layers * layer_ops(work) + root
    return work.accumulation * per_micro + STEP
