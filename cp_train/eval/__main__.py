"""``python -m cp_train.eval``: the same command as ``cp-train-eval``."""

from cp_train.errors import exit_now
from cp_train.eval.cli import main

exit_now(main(prog="python -m cp_train.eval"))
