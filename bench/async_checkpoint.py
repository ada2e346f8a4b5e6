"""How long training waits for its checkpoints: saved in the step against written behind training.

    python -m bench.async_checkpoint [--cp 2] [--hidden 512] [--layers 4] [--steps 12] [--interval 3]

``launch/configs/cpu-tiny.yaml`` widened to ``--hidden`` and ``--layers`` trains ``--steps`` steps on ``--cp`` spawned
gloo ranks, saving every ``--interval`` steps, once with ``checkpoint.async_save`` off (the baseline) and once on,
in the same world. Per run: the training time (``Trainer.train``, the last save's wait included), the time the loop
spent in ``Trainer.save`` (the step's wait: the whole write, or the copy to host memory and the wait for the save
before), and the state's size per rank. On CPU the background write shares the cores with training, so its
cost shows partly in the steps; on GPUs the steps run on the device. Prints JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/async_checkpoint.py` from anywhere

from bench.common import emit  # noqa: E402
from cp_train.config.sources import load_config  # noqa: E402
from cp_train.parallel.mesh.state import ParallelState, run_with_parallel  # noqa: E402
from cp_train.parallel.spawn import SpawnedWorld  # noqa: E402
from cp_train.trainer import Trainer  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "launch" / "configs" / "cpu-tiny.yaml"


def timed_run(state: ParallelState, overrides: list[str]) -> dict[str, Any]:
    """On every rank: train the run of ``overrides``; the training time and the time spent in ``save``."""
    trainer = Trainer(load_config(CONFIG, overrides=overrides), state)
    save, in_save = trainer.save, [0.0]

    def timed_save() -> None:
        started = time.perf_counter()
        save()
        in_save[0] += time.perf_counter() - started

    trainer.save = timed_save  # type: ignore[method-assign]
    state_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) * 3  # params + AdamW's two
    started = time.perf_counter()
    trainer.train()
    return {"train_s": time.perf_counter() - started, "save_s": in_save[0], "state_mb": state_bytes / 2**20,
            "messages": [m for m in trainer.result.messages if m.startswith("saved checkpoint")]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=3)
    args = parser.parse_args()
    records = []
    with tempfile.TemporaryDirectory() as root, SpawnedWorld(args.cp, threads=max(1, 2 // args.cp)) as world:
        for background in (False, True):
            name = "async" if background else "in the step"
            overrides = [f"parallel.cp={args.cp}", f"model.hidden_size={args.hidden}",
                         f"model.num_layers={args.layers}", f"model.ffn_hidden_size={4 * args.hidden}",
                         f"train.steps={args.steps}",
                         "schedule.warmup_steps=1", "train.valid_interval=0", "logging.console=false",
                         "logging.wandb=false", f"logging.dir={root}/{name}/run", f"checkpoint.save={root}/{name}/ckpt",
                         f"checkpoint.interval={args.interval}", "checkpoint.keep=1",
                         f"checkpoint.async_save={background}"]
            ranks = world.run(run_with_parallel, (1, args.cp, 1), timed_run, overrides)
            slowest = max(ranks, key=lambda r: r["train_s"])
            records.append({"save": name, "cp": args.cp, "steps": args.steps, "saves": len(slowest["messages"]),
                            "state_mb_per_rank": slowest["state_mb"], "train_s": slowest["train_s"],
                            "in_save_s": slowest["save_s"], "last_save": slowest["messages"][-1]})
    for record in records:
        record["train_vs_in_step"] = record["train_s"] / records[0]["train_s"]
    emit(records, [("save", "save", str), ("saves", "saves", str),
                   ("state_mb_per_rank", "state MB/rank", lambda v: f"{v:.0f}"),
                   ("train_s", "train s", lambda v: f"{v:.1f}"), ("in_save_s", "in save s", lambda v: f"{v:.2f}"),
                   ("train_vs_in_step", "vs in the step", lambda v: f"{v:.2f}")])


if __name__ == "__main__":
    main()
