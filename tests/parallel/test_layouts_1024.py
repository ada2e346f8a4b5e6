"""1,024 ranks on the meta device: ``tests/parallel/layouts_1024.py`` run in its own process (PyTorch's fake
process group is the default group there), every rank's groups checked, three ranks' models and plans."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.entry_points import REPO, environment


def test_tp8_cp16_dp8_with_hsdp_builds_on_every_rank_in_under_two_minutes() -> None:
    done = subprocess.run([sys.executable, "-m", "tests.parallel.layouts_1024", "--tp", "8", "--cp", "16", "--dp", "8",
                           "--dp-replicate", "2", "--model", "llama3-70b"], cwd=REPO, env=environment(),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["world"] == result["ranks_checked"] == 1024 and result["models_checked"] == 3
    assert result["seconds"] < 120, result
