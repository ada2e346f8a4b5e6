"""``python -m cp_train.plan``: the planner's command line (``cli.py``)."""

import sys

from cp_train.plan.cli import main

sys.exit(main())
