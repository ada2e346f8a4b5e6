"""``python -m cp_train`` (or ``torchrun --nproc-per-node N -m cp_train``): the same command as ``train.py``."""

from cp_train.cli.train import main
from cp_train.errors import exit_now

exit_now(main(prog="cp_train"))
