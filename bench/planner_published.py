"""The planner against every published run (``cp_train/plan/inputs/published.py``): predicted and measured, in
each row's own unit, with the relative error and the mean absolute error over all rows.

    python bench/planner_published.py            # JSON lines, then the table
    python bench/planner_published.py --markdown # the table as docs/planner.md shows it

Nothing is fitted to any row: each prediction uses the row's hardware profile and layout (``published_check``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/planner_published.py` from anywhere

from cp_train.plan.inputs.published import PUBLISHED  # noqa: E402
from cp_train.plan.published_check import compare  # noqa: E402

UNITS = {"tokens_per_s_per_gpu": "tok/s/GPU", "tflops_per_gpu": "TFLOP/s/GPU", "attention_fraction_of_ideal":
         "of ideal"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = []
    for run in PUBLISHED:
        result = compare(run)
        record = {"key": run.key, "model": run.model, "hardware": run.hardware, "gpus": run.gpus,
                  "seq_len": run.seq_len, "layout": f"tp{run.tp} cp{run.cp} dp{run.dp}" + (" fsdp" if run.fsdp else ""),
                  "precision": run.precision, "unit": result.unit, "measured": result.measured,
                  "predicted": result.predicted, "error": result.error,
                  "checkpointing": result.prediction.config.model.activation_checkpointing if result.prediction
                  else None}
        print(json.dumps(record))
        rows.append(record)
    mae = sum(abs(r["error"]) for r in rows) / len(rows)
    print(json.dumps({"rows": len(rows), "mean_absolute_error": mae}))
    header = ("row", "model", "GPUs", "seq", "layout", "precision", "measured", "predicted", "error")
    lines = [header] + [(r["key"], r["model"], str(r["gpus"]), f"{r['seq_len'] // 1024}k", r["layout"], r["precision"],
                         f"{r['measured']:,.3g} {UNITS[r['unit']]}", f"{r['predicted']:,.3g}", f"{r['error']:+.1%}")
                        for r in rows]
    if args.markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        print("\n".join("| " + " | ".join(line) + " |" for line in lines[1:]))
    else:
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        print("\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines))
    print(f"mean absolute error over {len(rows)} rows: {mae:.1%}")


if __name__ == "__main__":
    main()
