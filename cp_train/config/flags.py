"""Command line of ``train.py``: ``--config FILE``, Megatron-style flags and ``--set key=value`` overrides."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cp_train.config.schema import Config, ConfigError
from cp_train.config.sources import load_config
from cp_train.errors import DEBUG_ENV, DEBUG_FLAG, this_rank

# flag -> (dotted key, type, help); Megatron's long names are accepted as aliases
FLAGS: dict[str, tuple[str, type, str, tuple[str, ...]]] = {
    "--tp-size": ("parallel.tp", int, "tensor-parallel size", ("--tensor-model-parallel-size",)),
    "--cp-size": ("parallel.cp", int, "context-parallel size", ("--context-parallel-size",)),
    "--dp-size": ("parallel.dp", int, "data-parallel size (default: world / (tp*cp))", ()),
    "--cp-layout": ("parallel.cp_layout", str, "contiguous, zigzag, stripe or balanced", ()),
    "--cp-algorithm": ("parallel.cp_algorithm", str, "ring, allgather, ulysses or hybrid (or p2p, all_gather, a2a, "
                       "a2a+p2p)", ("--cp-comm-type",)),
    "--ulysses-size": ("parallel.ulysses_size", int, "hybrid: CP ranks per Ulysses group",
                       ("--hierarchical-context-parallel-size",)),
    "--seq-len": ("data.seq_len", int, "tokens per sample", ("--seq-length",)),
    "--micro-batch-size": ("train.micro_batch_size", int, "samples per micro-batch per DP rank", ()),
    "--global-batch-size": ("train.global_batch_size", int, "samples per optimizer step", ()),
    "--lr": ("optimizer.lr", float, "peak learning rate", ()),
    "--min-lr": ("optimizer.min_lr", float, "final learning rate of the decay", ()),
    "--train-steps": ("train.steps", int, "optimizer steps", ("--train-iters",)),
    "--eval-interval": ("train.eval_interval", int, "steps between evaluations (0: off)", ()),
    "--seed": ("train.seed", int, "runtime RNG seed", ()),
    "--data-path": ("data.prefix", str, "Megatron .bin/.idx prefix (default: the embedded corpus)", ()),
    "--tokenizer-model": ("data.tokenizer", str, "SentencePiece .model, or a HF tokenizer.json or its directory", ()),
    "--save": ("checkpoint.save", str, "checkpoint directory", ()),
    "--load": ("checkpoint.load", str, "checkpoint to resume from", ()),
    "--init-from-hf": ("checkpoint.init_from_hf", str, "Hugging Face Llama directory to start from", ()),
    "--save-interval": ("checkpoint.interval", int, "steps between checkpoints (0: off)", ()),
    "--log-interval": ("logging.interval", int, "steps between metric records", ()),
    "--run-dir": ("logging.dir", str, "run directory (JSONL, wandb, config)", ()),
    "--wandb-project": ("logging.wandb_project", str, "wandb project", ()),
    "--wandb-mode": ("logging.wandb_mode", str, "online, offline or disabled (default: online only with "
                     "WANDB_API_KEY)", ()),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors become ``ConfigError`` (reported once, by rank 0); help is printed by rank 0 only."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see python train.py --help)")

    def _print_message(self, message: str, file=None) -> None:  # noqa: ANN001 - argparse's signature
        if this_rank() == 0:
            super()._print_message(message, file or sys.stdout)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="train.py", description="Context-parallel GPT pretraining. Precedence: YAML < flags < --set.",
        epilog="Launch with torchrun, e.g. torchrun --nproc-per-node 2 train.py --config "
               "launch/configs/cpu-tiny.yaml --set train.steps=50")
    parser.add_argument("--config", help="YAML file (see launch/configs/)")
    for flag, (key, kind, text, aliases) in FLAGS.items():
        parser.add_argument(flag, *aliases, dest=key, type=kind, default=None, metavar=kind.__name__.upper(),
                            help=f"{text} [{key}]")
    parser.add_argument("--fsdp", dest="parallel.fsdp", action=argparse.BooleanOptionalAction, default=None,
                        help="shard parameters, gradients and optimizer state over DP x CP with FSDP2 "
                             "[parallel.fsdp]")
    parser.add_argument("--compile", dest="train.compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile each block and the head with its loss [train.compile]")
    parser.add_argument("--dry-run", action="store_true",
                        help="build on the meta device and print each rank's parameter, gradient, optimizer and "
                             "activation memory; train nothing (no torchrun needed)")
    parser.add_argument("--device-memory-gib", type=float, default=None, metavar="GIB",
                        help="--dry-run: memory per device (default: this GPU's, else 80)")
    parser.add_argument("--reserve-gib", type=float, default=3.0, metavar="GIB",
                        help="--dry-run: memory per device kept for the CUDA context, NCCL and fragmentation, "
                             "plus --reserve-fraction of the device (default 3)")
    parser.add_argument("--reserve-fraction", type=float, default=0.05, metavar="F",
                        help="--dry-run: the share of the device kept on top of --reserve-gib (default 0.05)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="any config key, e.g. --set model.hidden_size=512 (repeatable; wins over flags)")
    parser.add_argument(DEBUG_FLAG, action="store_true",
                        help=f"print the Python traceback of an error (also {DEBUG_ENV}=1)")
    return parser


# options of the command itself
NOT_CONFIG = ("config", "overrides", "debug", "dry_run", "device_memory_gib", "reserve_gib", "reserve_fraction")


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """The config from ``argv`` (YAML (``--config``) < flags < ``--set`` overrides) and the parsed options."""
    args = build_parser().parse_args(argv)
    flags = {key: value for key, value in vars(args).items() if key not in NOT_CONFIG and value is not None}
    return load_config(args.config, flags, args.overrides), args


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """The config from ``argv``: YAML (``--config``) < flags < ``--set`` overrides."""
    return parse_args(argv)[0]
