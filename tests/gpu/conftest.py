"""The GPU suite: every test here is marked ``cuda`` and skipped (not failed) without a CUDA device.

    python -m pytest -q tests/gpu                      # one GPU: kernels, model, trainer, ring as threads
    torchrun --nproc-per-node 4 -m tests.gpu.ring_nccl  # a multi-GPU node: the ring over NCCL
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu)")
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)
