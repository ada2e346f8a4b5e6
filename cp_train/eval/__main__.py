"""``python -m cp_train.eval``: the same command as ``cp-train-eval``."""

import sys

from cp_train.eval.cli import main

sys.exit(main(prog="python -m cp_train.eval"))
