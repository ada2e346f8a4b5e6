"""The ``cudnn_ragged`` backend on the GPU (``tests/gpu/ragged_check.py``, in a process of its own)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BOUND = 5e-2  # bf16 against float64, as the GPU suite's other bf16 document rings


def test_ragged_cudnn_ring_with_documents_matches_float64() -> None:
    """Admitted by its trial (else skipped, saying why: the trial is what decides), the ring with packed documents
    on cuDNN's ragged graphs matches float64 in every layout, as closely as the default cuDNN ring (documents on
    varlen calls) does: within twice its error plus bf16's rounding."""
    done = subprocess.run([sys.executable, "-m", "tests.gpu.ragged_check"], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    if not record["admitted"]:
        pytest.skip(record["why"])
    for case in record["cases"]:
        for name, error in case["ragged"].items():
            assert error < BOUND and error <= 2 * case["cudnn_varlen"][name] + 1e-2, (case, name)
