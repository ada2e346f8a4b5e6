"""``cp-train-plan --explain``: one layout's predicted step and memory in words, what bounds it and what would
move it."""

from __future__ import annotations

from cp_train.perf.inputs.hardware import Hardware
from cp_train.perf.predict import Prediction, cp_check_seconds
from cp_train.perf.ranges import MIN_RUNS
from cp_train.perf.rates import DeviceRates

SUGGESTED_CHECK_EVERY = 1000  # the GPU configs' train.check_cp_every
PARTS = {"matmuls": "the linear layers' matmuls", "attention": "the attention kernels",
         "elementwise": "memory-bound work (norms, residual adds, RoPE, SwiGLU, the loss)",
         "recompute": "activation checkpointing's recompute", "cp_comm": "exposed CP communication",
         "tp_comm": "TP communication", "data_comm": "exposed FSDP/DDP communication",
         "optimizer": "the optimizer step",
         "host": "the host (dispatching ops, building cuDNN graphs for new attention shapes)",
         "offload": "exposed activation offload (PCIe copies outlasting a block's compute)"}

# what moves each part, when it is the largest one not bound by the hardware's peak
MOVES = {"recompute": "less checkpointing (selective instead of full, or none where memory allows)",
         "cp_comm": "a CP algorithm that hides its traffic (ring) or a layout that keeps the CP group in one node",
         "tp_comm": "a smaller tp (TP's collectives are exposed; CP or FSDP scale instead)",
         "data_comm": "larger micro-batches or fewer data-parallel shards (gathers are per micro-batch)",
         "optimizer": "more tokens per step (the optimizer's cost is per step, not per token)",
         "elementwise": "a compiled step (fusing the memory-bound work) or larger matmuls",
         "attention": "a faster attention kernel (FA3 or cuDNN) or a layout that balances the causal work",
         "matmuls": "fp8 linears, or larger matmuls (a larger micro-batch)",
         "host": "a compiled step, larger micro-batches (fewer, larger ops), or documents in fewer kernel shapes",
         "offload": "offloading less (model.activation_checkpointing=full moves only the block inputs) or none"}


def explain(prediction: Prediction, hardware: Hardware) -> str:
    """Paragraph lines: the step's parts by share, the FLOP conventions, the memory against the device."""
    record = prediction.record()
    parts = record["breakdown_s"]
    step = prediction.step_time_s
    ranked = sorted(parts, key=parts.get, reverse=True)
    lines = [f"layout tp {record['tp']} x cp {record['cp']} x dp {record['dp']} ({record['cp_algorithm']}, "
             f"{record['cp_layout']}, {'FSDP' if record['fsdp'] else 'DDP'}, activation checkpointing "
             f"{record['activation_checkpointing']}, micro-batch {record['micro_batch']}): a step of "
             f"{prediction.tokens_per_step:,} tokens takes {step:.3g} s, {prediction.tokens_per_s_per_gpu:,.0f} "
             f"tokens/s per GPU."]
    band, low, high = prediction.band, *record["tokens_per_s_per_gpu_range"]
    lines.append(f"expected: {low:,.0f}-{high:,.0f} tokens/s per GPU, the planner's error ({band.low:+.0%} to "
                 f"{band.high:+.0%}, padded) on the {len(band.runs)} measured runs of regime {'/'.join(band.regime)} "
                 f"(model/sequence/precision/nodes; classes dropped from the right until {MIN_RUNS} runs share it): "
                 f"{', '.join(band.runs)}.")
    lines.append("where the time goes: " + ", ".join(
        f"{PARTS[name]} {parts[name]:.3g} s ({parts[name] / step:.0%})" for name in ranked if parts[name] > 0))
    half, full = record["tflops_per_gpu"]["causal_half"], record["tflops_per_gpu"]["causal_full"]
    lines.append(f"model FLOPs: {half:.0f} TFLOP/s per GPU with causal attention counted at half (Megatron-Bridge: "
                 f"6N + 6·L·d·s per token), {full:.0f} counted in full (torchtitan: 6N + 12·L·d·s): MFU "
                 f"{record['mfu']['causal_half']:.1%} and {record['mfu']['causal_full']:.1%} of "
                 f"{hardware.peak_tflops('bf16'):.4g} TFLOP/s bf16.")
    compute = parts["matmuls"] + parts["attention"]
    bound = "compute" if compute >= 0.5 * step else f"{PARTS[ranked[0]]}"
    movable = next((name for name in ranked if name not in ("matmuls",)), ranked[0])
    lines.append(f"bounded by {bound}; the largest part beyond the matmuls is {PARTS[movable]}: "
                 f"to move it, {MOVES[movable]}.")
    memory = record["memory_gib"]
    lines.append(f"memory per GPU: {memory['total']:.3g} GiB of {prediction.usable_gib:.3g} usable "
                 f"({'fits' if prediction.fits else 'does NOT fit'}): parameters {memory['parameters']:.3g}, "
                 f"gradients {memory['gradients']:.3g}, optimizer {memory['optimizer']:.3g}, gathered "
                 f"{memory['gathered']:.3g}, activations {memory['activations']:.3g}.")
    if "host" in memory:  # activation offload, checkpoint.async_save's copy of the state
        lines.append(f"host memory (activation offload, checkpoint copy): {memory['host']:.3g} GiB per GPU, "
                     f"{memory['host_per_node']:.3g} per node of {prediction.host_usable_gib:.3g} usable.")
    if record["cp"] > 1:  # the in-run CP check's forward of a whole sample (every 1000 steps unless set)
        every = prediction.config.train.check_cp_every or SUGGESTED_CHECK_EVERY
        check = cp_check_seconds(prediction.config, DeviceRates(hardware, prediction.precision, prediction.kernel))
        lines.append(f"CP check (train.check_cp_every {every}): {check:.3g} s per check (a forward of a whole "
                     f"{prediction.config.data.seq_len:,}-token sample on each GPU), {check / (every * step):.3%} of "
                     f"the run's time.")
    return "\n".join(lines)
