"""cp-train entry point: ``torchrun --nproc-per-node N train.py --config FILE [flags] [--set key=value ...]``.

The command itself is ``cp_train/cli/train.py`` (also ``python -m cp_train`` where the package is installed).
See ``python train.py --help`` and ``launch/``.
"""

from __future__ import annotations

import sys

from cp_train.cli.train import dry_run, main, train

__all__ = ["dry_run", "main", "train"]

if __name__ == "__main__":
    sys.exit(main())
