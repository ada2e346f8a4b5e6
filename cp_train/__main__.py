"""``python -m cp_train`` (or ``torchrun --nproc-per-node N -m cp_train``): the same command as ``train.py``."""

import sys

from cp_train.cli.train import main

sys.exit(main(prog="cp_train"))
