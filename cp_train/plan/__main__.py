"""``python -m cp_train.plan``: ``cp-train-plan`` (``cp_train/cli/plan.py``)."""

import sys

from cp_train.cli.plan import main

sys.exit(main())
