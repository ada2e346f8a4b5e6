"""cp-train entry point: ``torchrun --nproc-per-node N train.py --config FILE [flags] [--set key=value ...]``.

Parses the config (YAML < flags < ``--set``), initialises torch.distributed from torchrun's
environment (nccl on CUDA, gloo on CPU; every collective bounded by ``parallel.timeout_minutes``),
builds the run and trains. See ``python train.py --help`` and ``launch/``.

A failure ends the process with one line on stderr (rank 0 alone for config and input errors) and exit
code 2 for a config or input error, 1 for a failed run; ``--debug`` or ``CP_TRAIN_DEBUG=1`` adds the
traceback (``cp_train/errors.py``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from cp_train.cli import parse_config
from cp_train.collectives import explain_collective_failure, trace_collectives
from cp_train.errors import run_entry_point
from cp_train.trainer import run_training
from cp_train.validate import validate
from parallel.spawn import free_port
from parallel.state import parallel_context


def train(argv: list[str]) -> int:
    config = parse_config(argv)
    dp = validate(config, int(os.environ.get("WORLD_SIZE", "1")))
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one (on a free port: several may run)
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port())})
    parallel = config.parallel
    with parallel_context(parallel.tp, parallel.cp, dp, parallel.backend, parallel.timeout_minutes,
                          parallel.ulysses_size) as state:
        trace_collectives(state, parallel.timeout_minutes)
        run_training(config, state)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point("train.py", train, argv, explain=explain_collective_failure)


if __name__ == "__main__":
    sys.exit(main())
