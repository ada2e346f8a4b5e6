"""Loss and throughput curves of a run::

    python -m cp_train.cli.plot RUN_DIR [--out DIR]

writes ``loss.png`` and ``throughput.png`` (``cp_train.metrics.plot``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cp_train.errors import run_entry_point
from cp_train.metrics.plot import plot_run


def run(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m cp_train.cli.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="the run directory (logging.dir) holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default: RUN_DIR)")
    args = parser.parse_args(argv)
    written = plot_run(args.run_dir, args.out)
    for path in written:
        print(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point("python -m cp_train.cli.plot", lambda args: run(args) and None, argv)


if __name__ == "__main__":
    sys.exit(main())
