"""``python -m cp_train.plan``: ``cp-train-plan`` (``cp_train/cli/plan.py``)."""

from cp_train.cli.plan import console_main

console_main()
