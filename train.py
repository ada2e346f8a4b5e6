"""cp-train entry point: ``torchrun --nproc-per-node N train.py --config FILE [flags]``."""

import sys

if __name__ == "__main__":
    sys.exit("train.py: the trainer is not built yet (see the trainer issue)")
