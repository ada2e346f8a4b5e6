"""The training command: parse the config, start torch.distributed from torchrun's environment, train.

``train.py`` at the repository root, the ``cp-train`` console script and ``python -m cp_train`` (``torchrun
--nproc-per-node N -m cp_train --config FILE``) all run ``main``. Parses the config (YAML < flags <
``--set``), initialises torch.distributed (nccl on CUDA, gloo on CPU; every collective bounded by
``parallel.timeout_minutes``), builds the run and trains; ``--dry-run`` plans the memory instead.

A failure ends the process with one line on stderr (rank 0 alone for config and input errors) and exit
code 2 for a config or input error, 1 for a failed run; ``--debug`` or ``CP_TRAIN_DEBUG=1`` adds the
traceback (``cp_train/errors.py``).
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from cp_train.config.flags import parse_args
from cp_train.config.schema import Config, ConfigError
from cp_train.data.blend_spec import parse_blend
from cp_train.errors import InputError, exit_now, launch_world_size, run_entry_point, this_rank

# torch and everything that imports it load once the command line has parsed: ``--help`` and a flag's error answer
# without them (tests/structure/test_layering.py)

DEFAULT_CPU_CONFIG = Path(__file__).resolve().parents[2] / "launch" / "configs" / "cpu-tiny.yaml"


def dry_run(config: Config, args: Namespace, source: str | Path | None = None) -> int:
    """Print every rank's planned memory (``cp_train/memory/dry_run_report.py``; ``parallel.fsdp_reduce`` auto
    resolved against the device less the reserve); rank 0 alone under torchrun. Exit status 1 when the largest rank
    does not fit the device (or, with activation offload, a node's offloaded activations its host memory).
    ``source``: the config file planned (the default one when no --config names it)."""
    import torch

    from cp_train.config.sources import unused_settings
    from cp_train.config.validate import with_accumulation
    from cp_train.memory.dry_run import checked_reserve_gib, dry_run_world
    from cp_train.memory.dry_run_report import report
    from cp_train.perf.run_check import dry_run_host, dry_run_line

    device_gib = args.device_memory_gib
    if device_gib is None:
        device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0
    try:
        reserve = checked_reserve_gib(device_gib, args.reserve_gib, args.reserve_fraction, "the device")
    except ConfigError as error:
        raise ConfigError(f"--dry-run: {error} or raise --device-memory-gib") from None
    world = dry_run_world(config)
    config = with_accumulation(config, world)
    planned = report(config, world, device_gib, str(source or args.config or "the command line"), reserve,
                     dry_run_host(config, world))  # a node's host memory: activation offload's check
    if this_rank() == 0:
        for note in (*config.deprecations, *unused_settings(config)):  # deprecated or foreign keys; unused values
            print(f"[cp-train] {note}")
        lines = planned.text.splitlines()
        predicted = dry_run_line(config, dry_run_world(config))  # the time beside the memory, before the verdict
        verdict = next((i for i, line in enumerate(lines) if line.startswith("reserve:")), len(lines))
        print("\n".join(lines[:verdict] + ([predicted] if predicted else []) + lines[verdict:]))
    return 0 if planned.fits else 1


def machine_default(argv: list[str]) -> Path | None:
    """The shipped config that fits this machine when ``argv`` names none: ``cpu-tiny.yaml`` without CUDA (None, the
    dataclass defaults, on CUDA); the same for training and ``--dry-run``. Its model shape gives way to
    ``--init-from-hf`` (``flags.parse_args``)."""
    if any(arg == "--config" or arg.startswith("--config=") for arg in argv) or (
            "-h" in argv or "--help" in argv) or not DEFAULT_CPU_CONFIG.is_file():
        return None
    import torch

    if torch.cuda.is_available():
        return None
    if this_rank() == 0:
        print(f"[cp-train] no --config: using {DEFAULT_CPU_CONFIG} (this machine has no CUDA GPU)", flush=True)
    return DEFAULT_CPU_CONFIG


def check_schedule(config: Config) -> None:
    """A training run's schedule must leave warmup: ConfigError with the fix when ``schedule.warmup_steps`` is
    at least ``train.steps`` (checked by the training command, not by the dry run)."""
    warmup, steps = config.schedule.warmup_steps, config.train.steps
    if warmup and warmup >= steps:
        raise ConfigError(f"schedule.warmup_steps {warmup} >= train.steps {steps}: the run would never leave warmup; "
                          f"lower it (e.g. --lr-warmup-iters {max(1, steps // 10)}, or 0) or raise --train-steps "
                          f"above {warmup}")


def check_input_files(config: Config) -> None:
    """The files a run reads must exist: checked first, before any setting derived from them is."""
    data, checkpoint = config.data, config.checkpoint
    for key, spec in (("data.prefix", data.prefix), ("data.valid_prefix", data.valid_prefix)):
        try:
            blend = parse_blend(spec, key) if spec else ()
        except ValueError as error:
            raise ConfigError(str(error)) from None
        for _, prefix in blend:
            if prefix.endswith((".bin", ".idx")):
                continue  # IndexedDataset names the prefix to pass instead
            for suffix in (".idx", ".bin"):
                if not Path(prefix + suffix).is_file():
                    name = Path(prefix).name
                    raise InputError(f"{key} {prefix}: {prefix}{suffix} is missing; an indexed dataset "
                                     f"needs both {name}.idx and {name}.bin (make them with cp-train-preprocess)")
    if data.tokenizer is not None and not Path(data.tokenizer).exists():
        raise InputError(f"data.tokenizer {data.tokenizer} does not exist: pass a SentencePiece .model, a Hugging "
                         f"Face tokenizer.json or its directory; train a SentencePiece model on text files with "
                         f"python -m cp_train.cli.train_tokenizer --input FILE... --vocab-size 8000 "
                         f"--output-prefix tok")
    if checkpoint.init_from and checkpoint.init_from_hf:
        raise ConfigError(f"checkpoint.init_from {checkpoint.init_from} and checkpoint.init_from_hf "
                          f"{checkpoint.init_from_hf} both name the weights a new run starts from: keep one")
    for key, path in (("checkpoint.init_from_hf (--init-from-hf)", checkpoint.init_from_hf),
                      ("checkpoint.init_from (--init-from)", checkpoint.init_from),
                      ("checkpoint.load (--load)", checkpoint.load)):
        if path and not Path(path).exists():
            raise InputError(f"{key} {path} does not exist")


def check_world(config: Config, world: int) -> None:
    """A world of one process cannot hold tp*cp > 1: ConfigError saying how to launch it."""
    ranks = config.parallel.tp * config.parallel.cp * (config.parallel.dp or 1)
    if world == 1 and ranks > 1:
        raise ConfigError(f"this is one process (world size 1) and parallel.tp*cp*dp = {ranks} needs {ranks}: "
                          f"launch with torchrun --nproc-per-node {ranks} train.py ... (or set --cp-size 1 "
                          f"--tp-size 1 to train in one process)")


def train(argv: list[str]) -> int:
    default = machine_default(argv)
    config, args = parse_args(argv, default_config=default)  # --help and the flags' errors end here
    if not args.dry_run:  # missing files first, then the settings derived from them
        check_input_files(config)
        check_world(config, launch_world_size())
        check_schedule(config)
    from cp_train.cli.launch import stop_with_launcher  # torch, from here on
    from cp_train.config.validate import validate, with_accumulation
    from cp_train.parallel.mesh.collectives import trace_collectives
    from cp_train.parallel.mesh.state import parallel_context, world_of_one

    stop_with_launcher()
    if args.dry_run:
        return dry_run(config, args, default)
    world = launch_world_size()
    config = with_accumulation(config, world)
    dp = validate(config, world)
    from cp_train.trainer import run_training  # the model, FSDP and DCP: after the config holds (fast errors)

    parallel = config.parallel
    with world_of_one(), parallel_context(parallel.tp, parallel.cp, dp, parallel.backend,  # plain `python train.py`
                                          parallel.timeout_minutes, parallel.ulysses_size,
                                          parallel.dp_replicate) as state:
        trace_collectives(state, parallel.timeout_minutes)
        run_training(config, state)
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "train.py") -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    return run_entry_point(prog, train, argv, explain=_explain_collective_failure)


def _explain_collective_failure(error: BaseException) -> str | None:
    """``parallel.mesh.collectives.explain_collective_failure``, imported when an error needs it."""
    from cp_train.parallel.mesh.collectives import explain_collective_failure

    return explain_collective_failure(error)


def console_main() -> NoReturn:
    """The ``cp-train`` console script: ``train.py`` under another name (ends the process: ``exit_now``)."""
    exit_now(main(prog="cp-train"))


if __name__ == "__main__":
    exit_now(main())
