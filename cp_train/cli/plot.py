"""Loss, throughput and memory curves of one or several runs::

    python -m cp_train.cli.plot RUN_DIR [RUN_DIR ...] [--out DIR]

writes ``loss.png``, ``throughput.png`` and ``memory.png``, one line per run (``cp_train.metrics.plot``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cp_train.errors import run_entry_point
from cp_train.metrics.plot import plot_runs


def run(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m cp_train.cli.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run directories (logging.dir) holding metrics.jsonl; several share each chart")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default: the first RUN_DIR)")
    args = parser.parse_args(argv)
    written = plot_runs(args.run_dirs, args.out)
    for path in written:
        print(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point("python -m cp_train.cli.plot", lambda args: run(args) and None, argv)


if __name__ == "__main__":
    sys.exit(main())
