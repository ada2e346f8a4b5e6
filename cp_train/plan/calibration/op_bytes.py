"""The CP attention op's costs beyond what the planner plans for it: per byte (``cpu.attention_bytes``) and per
call inside a step (``cpu.attention_in_step``).

At a negligible size the op costs its Python, dispatch and message posting (``attention_calls``); at a real size it
costs more than that plus its kernels and its bytes at gloo's bandwidth: layout copies, the all-to-alls' buffers,
and the kernels running beside them. ``calibrate_ranks`` times the op at a moderate size (``SIZED_*``); this takes
out what the planner plans for that call on the profile being calibrated and charges the rest per byte of the
call's tensors.
"""

from __future__ import annotations

from collections.abc import Callable

from cp_train.plan.inputs.hardware import Hardware
from cp_train.plan.rates import DeviceRates


def _phase_seconds(rates: DeviceRates) -> float:
    """The planned seconds of the ``PHASE_SIZE`` GEMM that precedes each call timed in a step."""
    from cp_train.plan.calibration.calibrate_ranks import PHASE_SIZE

    return 2.0 * PHASE_SIZE**3 / rates.matmul(PHASE_SIZE, PHASE_SIZE, PHASE_SIZE)


def attention_byte_costs(hardware: Hardware, sized: list[tuple[int, str, float]], say: Callable[[str], None]
                         ) -> tuple[tuple[int, str, float], ...]:
    """``[(ranks, algorithm, us per MiB)]`` on the profile being calibrated (``hardware``, its ``cpu`` with
    ``attention_in_step`` and without these costs): the CP attention op's seconds at the sized shape after a GEMM
    (``sized``: ``[(ranks, algorithm, seconds of two PHASE_SIZE GEMMs and two calls)]``) above what the planner
    plans for a GEMM and the call on these rates (the GEMM, the call's kernels, its cost per call at a negligible
    size alone and in a step, its bytes at gloo's bandwidth), per byte of the call's q, k, v and output beyond the
    negligible call's."""
    from cp_train.config.schema import Config
    from cp_train.model.config import ModelConfig
    from cp_train.plan.calibration.calibrate_ranks import SIZED_BATCH, SIZED_HEAD_DIM, SIZED_ROWS, call_bytes
    from cp_train.plan.cpu_comm import cp_comm_seconds
    from cp_train.plan.time_model import attention_seconds
    from cp_train.plan.workload import build_workload

    out = []
    for world, algorithm, seconds in sized:
        heads, kv = 4 * world, world if algorithm == "ulysses" else 1
        config = Config()
        config.model = ModelConfig(vocab_size=64, num_layers=1, hidden_size=heads * SIZED_HEAD_DIM, num_heads=heads,
                                   num_kv_heads=kv, ffn_hidden_size=64, max_position_embeddings=SIZED_ROWS * world,
                                   tie_embeddings=True)
        config.data.seq_len = SIZED_ROWS * world
        config.parallel.cp, config.parallel.cp_algorithm, config.parallel.cp_layout = world, algorithm, "zigzag"
        config.parallel.backend = "gloo"
        config.train.micro_batch_size = config.train.global_batch_size = SIZED_BATCH
        rates, work = DeviceRates(hardware, world=world), build_workload(config, world, 4)
        forward, backward, _, _ = attention_seconds(work, rates)
        planned = forward + backward + sum(cp_comm_seconds(work, rates, 1))  # its small-call costs and its bytes
        seconds = seconds / 2 - _phase_seconds(rates)  # one call, the GEMM before it taken out
        extra = call_bytes(algorithm, world, SIZED_ROWS, SIZED_HEAD_DIM, SIZED_BATCH) - call_bytes(algorithm, world)
        out.append((world, algorithm, max(0.0, 1e6 * (seconds - planned)) / (extra / 2**20)))
        say(f"CP attention op {algorithm} at {world} ranks, {SIZED_ROWS} rows, in a step: {seconds * 1e3:.2f} ms "
            f"beyond the GEMM, kernels "
            f"planned {1e3 * (forward + backward):.2f} ms, the rest planned {1e3 * (planned - forward - backward):.2f} "
            f"ms, {out[-1][2]:.0f} us per MiB beyond")
    return tuple(out)


def attention_in_step_costs(hardware: Hardware, pairs: list[tuple[int, str, float]], say: Callable[[str], None]
                            ) -> tuple[tuple[int, str, float], ...]:
    """``[(ranks, algorithm, us per call)]``: what a negligible CP attention op call costs between GEMMs (``pairs``:
    ``[(ranks, algorithm, seconds of two PHASE_SIZE GEMMs and two calls)]``) beyond its cost alone and the GEMMs at
    the profile's rate for a rank of that world. Ranks that compute arrive at the op apart (more of them than cores:
    in the scheduler's time slices), and the op waits for the last."""
    from cp_train.plan.rates import DeviceRates

    out = []
    for world, algorithm, seconds in pairs:
        rates = DeviceRates(hardware, world=world)
        gemm = _phase_seconds(rates)
        alone = hardware.cpu.attention_call_us(algorithm, world, world, 1) * 1e-6 if hardware.cpu else 0.0
        out.append((world, algorithm, max(0.0, 1e6 * (seconds / 2 - gemm - alone))))
        say(f"CP attention op {algorithm} at {world} ranks in a step: {seconds / 2 * 1e3:.2f} ms a GEMM and a call, "
            f"the GEMM planned {gemm * 1e3:.2f} ms, the call alone {alone * 1e3:.2f} ms: "
            f"{out[-1][2] / 1e3:.2f} ms more")
    return tuple(out)
