"""How long ``cp-train-plan``'s search takes, now and with its three speed-ups undone (the baseline).

    python -m bench.planner_search [--cases 8b,70b,8b-docs]

Each case runs the search of ``cp-train-plan MODEL --seq-len 131072 --gpus N [--document-lengths 4096]`` in a
fresh process (no plan cached from another case), timing the search alone. ``baseline`` undoes, in that process:
the optimizer state from a probe (``dry_run.optimizer_state_bytes``; the baseline runs AdamW over meta tensors of
every parameter of the rank, as before), the cached plans of packed samples (``documents.search_rank_plans``) and the
search without the cyclic collector (``search.search``); both keep the cuDNN shape count's planning of each distinct
sample once (``host.new_shapes_per_micro_batch``). Both must print the same layouts; ``speedup`` is the
baseline's seconds over now's. Prints JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/planner_search.py` from anywhere

from bench.common import emit  # noqa: E402

CASES = {"8b": ["llama3-8b", "--gpus", "8"], "70b": ["llama3-70b", "--gpus", "64"],
         "8b-docs": ["llama3-8b", "--gpus", "8", "--document-lengths", "4096"]}


def _optimizer_bytes_by_stepping(optimizer: object, shapes: list) -> int:
    """The baseline's optimizer state: one AdamW step over meta parameters of every shape."""
    import torch

    from cp_train.optim import build_optimizer

    held = [torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in shapes]
    for param in held:
        param.grad = torch.empty_like(param)
    adamw = build_optimizer(torch.nn.ParameterList(held), replace(optimizer, implementation="foreach"),
                            torch.device("meta"))
    adamw.step()
    return sum(value.numel() * value.element_size() for state in adamw.state.values() for value in state.values()
               if torch.is_tensor(value))


def run_case(name: str, baseline: bool) -> dict:
    """In this process: the case's search (undone to the baseline when asked), timed."""
    from cp_train.cli import plan
    from cp_train.memory import dry_run
    from cp_train.perf import search as search_module
    from cp_train.perf import workload
    from cp_train.perf.inputs import documents as documents_module

    if baseline:
        dry_run.optimizer_state_bytes = _optimizer_bytes_by_stepping
        workload.search_rank_plans = documents_module.rank_plans
        search_module.search = search_module.search.__wrapped__
    args = plan.build_parser().parse_args([*CASES[name], "--seq-len", "131072"])
    hardware = plan.load_hardware(args.hardware)
    base = plan.base_config(args)
    rates = plan.DeviceRates(hardware, plan.linear_precision(base.model.fp8), args.attention_kernel)
    reserve = plan.reserve_gib(hardware.hbm_gib, args.reserve_gib, args.reserve_fraction)
    documents = plan.parse_document_lengths(args.document_lengths) if args.document_lengths else None
    start = time.perf_counter()
    result = search_module.search(base, args.gpus, rates, hardware.peak_tflops("bf16"), hardware.hbm_gib, reserve,
                                  plan.choices_of(args), documents, keep=10)
    seconds = time.perf_counter() - start
    return {"case": name, "variant": "baseline" if baseline else "now", "seconds": seconds,
            "layouts": result.total, "predicted": len(result.ranked),
            "tokens_per_s": [round(p.tokens_per_s_per_gpu, 3) for p in result.ranked[:10]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # NAME:now|baseline, run in this process
    args = parser.parse_args()
    if args.one:
        name, variant = args.one.split(":")
        print(json.dumps(run_case(name, variant == "baseline")))
        return
    records = []
    for name in args.cases.split(","):
        by_variant = {}
        for variant in ("baseline", "now"):
            done = subprocess.run([sys.executable, "-m", "bench.planner_search", "--one", f"{name}:{variant}"],
                                  cwd=ROOT, capture_output=True, text=True, check=True)
            by_variant[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        now, before = by_variant["now"], by_variant["baseline"]
        now.update(baseline_s=before["seconds"], speedup=before["seconds"] / now["seconds"],
                   same=now["tokens_per_s"] == before["tokens_per_s"] and now["predicted"] == before["predicted"])
        records.append(now)
    emit(records, [("case", "case", str), ("layouts", "layouts", lambda v: f"{v:,}"),
                   ("predicted", "predicted", str), ("baseline_s", "baseline s", lambda v: f"{v:.1f}"),
                   ("seconds", "now s", lambda v: f"{v:.1f}"), ("speedup", "speedup", lambda v: f"{v:.1f}x"),
                   ("same", "same layouts", str)])


if __name__ == "__main__":
    main()
