"""``cp-train-eval`` (``python -m cp_train.eval``): long-context evaluation of a DCP checkpoint or an HF
directory, teacher forced through the CP forward pass, under torchrun with the training parallel flags:

    torchrun --nproc-per-node 4 -m cp_train.eval --load runs/ckpt --cp-size 4 \\
        --tasks loss_by_position passkey niah --lengths 256 512 --depths 0 0.5 1 --trials 4

Rank 0 writes ``OUTPUT_DIR/eval.jsonl`` (one record per grid cell and per loss bucket), prints the table and
draws the PNGs (with matplotlib); ``--wandb`` logs them as tables and images. Bad input ends with one line
and exit code 2 (``cp_train/errors.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from cp_train import build
from cp_train.config.arg_types import positive_int
from cp_train.config.flags import FLAGS, MANY_WORDS
from cp_train.config.schema import Config, ConfigError
from cp_train.config.validate import validate
from cp_train.errors import DEBUG_FLAG, ensure_writable_dir, exit_now, launch_world_size, run_entry_point, this_rank
from cp_train.eval.context import build_context
from cp_train.eval.load import eval_config, load_model
from cp_train.eval.report import plots, table, wandb_log, write_jsonl
from cp_train.eval.tasks import TASKS, EvalSettings, Record, check_lengths, run_tasks
from cp_train.parallel.mesh.collectives import explain_collective_failure
from cp_train.parallel.mesh.state import parallel_context, world_of_one

# training flags the eval takes
PASSED_FLAGS = ("parallel.", "data.prefix", "data.valid_prefix", "data.tokenizer", "logging.wandb_")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see cp-train-eval --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cp-train-eval", description="Long-context evaluation through the CP forward pass.")
    parser.add_argument("--load", required=True, help="DCP checkpoint directory (or one step_*) or HF model directory")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), metavar="TASK", help=f"of {', '.join(TASKS)}")
    parser.add_argument("--lengths", nargs="+", type=positive_int, default=None, metavar="N",
                        help="sequence lengths in tokens (default: data.seq_len)")
    parser.add_argument("--depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0], metavar="F",
                        help="needle depths, fractions 0-1 (default 0 0.25 0.5 0.75 1)")
    parser.add_argument("--trials", type=positive_int, default=4, help="trials per grid cell (default 4)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the keys and haystack windows")
    parser.add_argument("--loss-samples", type=positive_int, default=16, help="held-out samples of loss_by_position")
    parser.add_argument("--haystack", default=None, metavar="PREFIX",
                        help="indexed dataset for the needle's haystack (default: the run's held-out data)")
    parser.add_argument("--output-dir", default="eval_out", help="records and PNGs (default eval_out)")
    parser.add_argument("--wandb", action=argparse.BooleanOptionalAction, default=False,
                        help="log tables and images to wandb (logging.wandb_project, --wandb-mode)")
    parser.add_argument("--config", help="YAML config layered over the source's (see launch/configs/)")
    for flag, (key, kind, text, aliases) in FLAGS.items():
        if key.startswith(PASSED_FLAGS):
            words = {"nargs": "+", "action": MANY_WORDS[flag]} if flag in MANY_WORDS else {}
            parser.add_argument(flag, *aliases, dest=key, type=kind, default=None, metavar=kind.__name__.upper(),
                                help=f"{text} [{key}]", **words)
    parser.add_argument("--fsdp", dest="parallel.fsdp", action=argparse.BooleanOptionalAction, default=None,
                        help="shard the parameters with FSDP2 [parallel.fsdp]")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="any config key (repeatable)")
    parser.add_argument(DEBUG_FLAG, action="store_true", help="print the Python traceback of an error")
    return parser


def publish(records: list[Record], out_dir: Path, config: Config, use_wandb: bool) -> None:
    """Rank 0: JSON lines, the table, the PNGs and (``use_wandb``) wandb."""
    path = write_jsonl(records, out_dir / "eval.jsonl")
    print(table(records))
    images, note = plots(records, out_dir)
    print(note or "plots: " + ", ".join(str(p) for p in images))
    print(f"records: {path}")
    if use_wandb:
        import wandb

        from cp_train.metrics.writers import wandb_mode

        run = wandb.init(project=config.logging.wandb_project, dir=str(out_dir), job_type="eval",
                         mode=wandb_mode(config.logging.wandb_mode))
        wandb_log(run, records, images)
        run.finish()


def evaluate(argv: list[str]) -> int:
    """Parse ``argv``, evaluate on every rank, publish on rank 0."""
    args = build_parser().parse_args(argv)
    if this_rank() == 0:  # rank 0 writes the results: a directory it cannot write is known before the run
        ensure_writable_dir(Path(args.output_dir), "--output-dir", create=False)  # made with the results
    flags = {k: v for k, v in vars(args).items() if "." in k and v is not None}
    config = eval_config(args.load, args.config, flags, args.overrides)
    settings = EvalSettings(tasks=args.tasks, lengths=args.lengths or [config.data.seq_len], depths=args.depths,
                            trials=args.trials, seed=args.seed, loss_samples=args.loss_samples)
    parallel = config.parallel
    check_lengths(settings.lengths, config.model, parallel.cp, parallel.cp_layout)
    config.data.seq_len = max(settings.lengths)
    config.train.valid_interval = 0
    dp = validate(config, launch_world_size())
    with world_of_one(), parallel_context(parallel.tp, parallel.cp, dp, parallel.backend,  # plain python: one
                                          parallel.timeout_minutes, parallel.ulysses_size,
                                          parallel.dp_replicate) as state:
        device = build.select_device(state)
        sources = build.resolve_data(config, state)
        model = load_model(config, state, args.load, device)
        context = build_context(config, state, model, sources.eval_prefix, sources.tokenizer, sources.eod_id,
                                sources.pad_id, device, build.autocast_dtype(config, device), args.haystack)
        records = run_tasks(settings, context)
        if state.rank == 0:
            publish(records, Path(args.output_dir), config, args.wandb)
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "cp-train-eval") -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    return run_entry_point(prog, evaluate, argv, explain=explain_collective_failure)


def console_main() -> NoReturn:
    """The ``cp-train-eval`` console script: ``main``, then the end of the process (``exit_now``: without the
    interpreter's teardown of the modules)."""
    exit_now(main())


if __name__ == "__main__":
    console_main()
