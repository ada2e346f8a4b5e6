"""Command line of ``train.py``: ``--config FILE``, Megatron-style flags and ``--set key=value`` overrides.

Each layer wins over the one below it (YAML < flags < ``--set``), also between the global batch and gradient
accumulation: set in one layer, both must agree (``validate``); set in different layers, the higher one decides
(``--gradient-accumulation-steps`` over a YAML's ``global_batch_size``, ``--global-batch-size`` over a YAML's
``gradient_accumulation_steps``). A default config (``parse_args``' ``default_config``: the CPU demo when no
``--config`` is given) gives way to ``--init-from-hf``: the HF model's shape replaces its ``model.*`` keys.
The flags: ``flag_table.py``; torchtitan's names and Megatron-LM's other flags: ``foreign_flags.py``; Megatron-LM's
counts: ``megatron_counts.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cp_train.config.arg_types import fraction, non_negative_float, positive_float
from cp_train.config.flag_table import BOOLEAN_FLAGS, BOOLEAN_FLAGS_SPEC, FLAGS, MANY_WORDS, SWITCHES
from cp_train.config.foreign_flags import (
    FOREIGN_DEST,
    MEGATRON_AS_ALWAYS,
    MEGATRON_DEST,
    TORCHTITAN_KEYS,
    megatron_hint,
    read_megatron_as_always,
    read_torchtitan,
    torchtitan_spellings,
)
from cp_train.config.hf_init import hf_model_keys
from cp_train.config.megatron_counts import MEGATRON_COUNT_DEST, add_megatron_counts, read_megatron_counts
from cp_train.config.schema import Config, ConfigError, field_type
from cp_train.config.sources import build_config, flatten, parse_override, read_yaml
from cp_train.errors import DEBUG_ENV, DEBUG_FLAG, this_rank


class _Parser(argparse.ArgumentParser):
    """Usage errors become ``ConfigError`` (reported once, by rank 0); help is printed by rank 0 only."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see python train.py --help)")

    def _print_message(self, message: str, file=None) -> None:  # noqa: ANN001 - argparse's signature
        if this_rank() == 0:
            super()._print_message(message, file or sys.stdout)


def _type_name(kind: object) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")


def config_keys() -> dict[str, list[tuple[str, str, object]]]:
    """Every config key by section, from the dataclasses: ``{section: [(key, type name, default)]}``."""
    defaults = Config()
    keys: dict[str, list[tuple[str, str, object]]] = {}
    for section in dataclasses.fields(Config):
        kind = typing.get_type_hints(Config)[section.name]
        if not dataclasses.is_dataclass(kind):
            continue
        keys[section.name] = [(f"{section.name}.{f.name}", _type_name(field_type(f"{section.name}.{f.name}")),
                               getattr(getattr(defaults, section.name), f.name)) for f in dataclasses.fields(kind)]
    return keys


def _flag_of(key: str) -> str | None:
    found = (flag for flag, spec in {**FLAGS, **SWITCHES, **BOOLEAN_FLAGS_SPEC}.items() if spec[0] == key)
    return next(found, None)


def build_parser() -> argparse.ArgumentParser:
    """The parser; ``--help`` lists every config key by section with its type and default (and its flag)."""
    parser = _Parser(
        prog="train.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Context-parallel GPT pretraining. Precedence: YAML (--config) < flags < --set "
                    "section.key=value.\nEvery config key can be set with --set; the flags below are shortcuts "
                    "(Megatron-LM's names work too).",
        epilog="Launch with cp-train-launch (torchrun's flags, one line when it fails), e.g. cp-train-launch "
               "--nproc-per-node 2 train.py --config launch/configs/cpu-tiny.yaml --set train.steps=50; "
               "torchtitan's --parallelism.*/--training.* names of these keys are read too (with a note)")
    command = parser.add_argument_group("command")
    command.add_argument("--config", help="YAML file (see launch/configs/; default: cpu-tiny on a machine without "
                                          "CUDA)")
    command.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="any config key, e.g. --set model.hidden_size=512 (repeatable; wins over flags)")
    command.add_argument("--dry-run", action="store_true",
                         help="build on the meta device and print each rank's parameter, gradient, optimizer and "
                              "activation memory; train nothing (no torchrun needed)")
    command.add_argument("--device-memory-gib", type=positive_float, default=None, metavar="GIB",
                         help="--dry-run: memory per device (default: this GPU's, else 80)")
    command.add_argument("--reserve-gib", type=non_negative_float, default=3.0, metavar="GIB",
                         help="--dry-run: memory per device kept for the CUDA context, NCCL and fragmentation, "
                              "plus --reserve-fraction of the device (default 3)")
    command.add_argument("--reserve-fraction", type=fraction, default=0.05, metavar="F",
                         help="--dry-run: the share of the device kept on top of --reserve-gib (default 0.05)")
    command.add_argument(DEBUG_FLAG, action="store_true",
                         help=f"print the Python traceback of an error (also {DEBUG_ENV}=1)")
    for section, keys in config_keys().items():
        unflagged = [f"  {key}: {kind} = {default!r}" for key, kind, default in keys if _flag_of(key) is None]
        group = parser.add_argument_group(
            section, f"--set {section}.KEY=VALUE for these keys:\n" + "\n".join(unflagged) if unflagged else None)
        described = {key: f"{kind} = {default!r}" for key, kind, default in keys}
        for flag, (key, kind, text, aliases) in FLAGS.items():
            if key.startswith(section + "."):
                name = kind.__name__.upper() if kind is not str.lower else "STR"
                words = {"nargs": "+", "action": MANY_WORDS[flag]} if flag in MANY_WORDS else {}
                group.add_argument(flag, *aliases, dest=key, type=kind, default=None, metavar=name,
                                   help=f"{text} [{key}: {described[key]}]", **words)
        for flag, (key, value, text) in SWITCHES.items():
            if key.startswith(section + "."):
                group.add_argument(flag, dest=key, action="store_const", const=value, default=None,
                                   help=f"{text}: {key}={value} [{described[key]}]")
        for flag, key in BOOLEAN_FLAGS.items():
            if key.startswith(section + "."):
                group.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None,
                                   help=f"[{key}: {described[key]}]")
    add_megatron_counts(parser)  # --train-samples, --lr-decay-iters, ... (megatron_counts.py)
    for name in TORCHTITAN_KEYS:  # read as ours with a note (foreign_flags.py); not listed
        parser.add_argument(*torchtitan_spellings(name), dest=FOREIGN_DEST + name, default=None, help=argparse.SUPPRESS)
    for name, (accepted, _) in MEGATRON_AS_ALWAYS.items():  # accepted with a note (foreign_flags.py); not listed
        switch = {"action": "store_const", "const": True} if accepted == () else {}
        parser.add_argument(f"--{name}", dest=MEGATRON_DEST + name, default=None, help=argparse.SUPPRESS, **switch)
    return parser


# options of the command itself
NOT_CONFIG = ("config", "overrides", "debug", "dry_run", "device_memory_gib", "reserve_gib", "reserve_fraction")


def suggestion(unknown: list[str]) -> str:
    """``: did you mean ...?`` for the first unknown ``--flag`` of ``unknown``: the nearest flag or config key."""
    first = next((i for i, token in enumerate(unknown) if token.startswith("--")), None)
    if first is None:
        return ""
    name, _, value = unknown[first][2:].partition("=")
    if not value and first + 1 < len(unknown) and not unknown[first + 1].startswith("--"):
        value = unknown[first + 1]
    hint = megatron_hint(name, value or None)
    if hint:
        return f": {hint}"
    name = name.replace("_", "-")
    keys = [key for section in config_keys().values() for key, _, _ in section]
    targets = {flag[2:]: spec[0] for flag, spec in FLAGS.items() for flag in (flag, *spec[3])}
    targets |= {flag[2:]: spec[0] for flag, spec in {**SWITCHES, **BOOLEAN_FLAGS_SPEC}.items()}
    targets |= {key.split(".", 1)[1].replace("_", "-"): key for key in keys} | {key.replace("_", "-"): key
                                                                              for key in keys}
    score = {target: difflib.SequenceMatcher(None, name, target).ratio() for target in targets}
    best = max(score, key=lambda target: (score[target], -len(target)))
    if score[best] < 0.6:
        return ""
    key = targets[best]
    flag = "--" + best if "--" + best in {**FLAGS, **SWITCHES, **BOOLEAN_FLAGS} or any(
        "--" + best in spec[3] for spec in FLAGS.values()) else _flag_of(key)
    takes_value = flag in FLAGS or any(flag in spec[3] for spec in FLAGS.values())
    shown = value or (str(SWITCHES[flag][1]).lower() if flag in SWITCHES else "true" if flag else "VALUE")
    hint = f"--set {key}={shown}"
    if flag is None:
        return f": did you mean {hint}?"
    return f": did you mean {flag}{' ' + shown if takes_value else ''} ({hint})?"


def _batch_by_layer(config: Config, file_keys: set[str], command_keys: set[str]) -> None:
    """The global batch and gradient accumulation set in different layers: the command line's wins (the file's
    value of the other is dropped); set in the same layer, ``validate`` checks that they agree."""
    batch, steps = "train.global_batch_size", "train.gradient_accumulation_steps"
    for ours, theirs in ((steps, batch), (batch, steps)):
        if ours in command_keys and theirs not in command_keys and theirs in file_keys:
            if theirs == steps:
                config.train.gradient_accumulation_steps = None
            config.explicit_keys = config.explicit_keys - {theirs}


def parse_args(argv: Sequence[str] | None = None, default_config: str | Path | None = None
               ) -> tuple[Config, argparse.Namespace]:
    """The config from ``argv`` (YAML (``--config``, else ``default_config``) < flags < ``--set`` overrides, see the
    module docstring) and the parsed options."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{suggestion(unknown)}")
    options = {key: value for key, value in vars(args).items() if key not in NOT_CONFIG and value is not None}
    flags = {key: value for key, value in options.items()
             if not key.startswith((FOREIGN_DEST, MEGATRON_DEST, MEGATRON_COUNT_DEST))}
    stated = read_megatron_as_always({key[len(MEGATRON_DEST):]: value for key, value in options.items()
                                      if key.startswith(MEGATRON_DEST)})
    foreign, notes = read_torchtitan({key[len(FOREIGN_DEST):]: value for key, value in options.items()
                                      if key.startswith(FOREIGN_DEST)}, flags,
                                     {key: flag for key in TORCHTITAN_KEYS.values() if (flag := _flag_of(key))})
    flags |= foreign
    overrides = dict(parse_override(text) for text in args.overrides)
    path = args.config or default_config
    layers: list[tuple[str, dict[str, Any]]] = []
    file_keys: set[str] = set()
    if path is not None:
        values = flatten(read_yaml(Path(path)), str(path))
        if args.config is None and (flags.get("checkpoint.init_from_hf") or overrides.get("checkpoint.init_from_hf")):
            values = {key: value for key, value in values.items() if key not in hf_model_keys()}
        layers.append((str(path), values))
        file_keys = set(values)
    layers += [("command-line flags", flags), ("--set", overrides)]
    config = build_config(layers)
    _batch_by_layer(config, file_keys, set(flags) | set(overrides))
    counts = read_megatron_counts(config, {key[len(MEGATRON_COUNT_DEST):]: value for key, value in options.items()
                                           if key.startswith(MEGATRON_COUNT_DEST)}, set(flags), set(overrides))
    config.deprecations = (*config.deprecations, *notes, *stated, *counts)
    return config, args


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """The config from ``argv``: YAML (``--config``) < flags < ``--set`` overrides."""
    return parse_args(argv)[0]
