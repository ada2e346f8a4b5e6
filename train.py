"""cp-train entry point: ``torchrun --nproc-per-node N train.py --config FILE [flags] [--set key=value ...]``.

The command itself is ``cp_train/cli/train.py`` (also ``python -m cp_train`` where the package is installed).
See ``python train.py --help`` and ``launch/``.
"""

from __future__ import annotations

from cp_train.cli.train import dry_run, main, train
from cp_train.errors import exit_now

__all__ = ["dry_run", "main", "train"]

if __name__ == "__main__":
    exit_now(main())  # without the interpreter's teardown of torch (about 1 s per rank)
