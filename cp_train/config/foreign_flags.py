"""Other frameworks' flags on ``train.py``'s command line (``flags.py``).

- torchtitan's dotted names (``--parallelism.context_parallel_degree 2``, also with dashes) for the keys cp-train
  has are read as ours, each with a one-line note naming our flag (``config.deprecations``, logged at the start of
  the run); one given with our own flag for the same key is an error;
- Megatron-LM's flags that have no alias here (``--use-distributed-optimizer``, ``--rotary-base``, ``--split``,
  ``--test-data-path``, ``--finetune``, ``--no-load-optim``, the FP8 ones: ``--fp8-format``, ``--fp8-recipe``,
  ``--first-last-layers-bf16``, ``--num-layers-at-start-in-bf16``, ``--num-layers-at-end-in-bf16``) are refused
  with a one-line hint naming ours.
"""

from __future__ import annotations

from typing import Any

from cp_train.config.schema import ConfigError

# torchtitan's name -> our key (torchtitan's JobConfig: parallelism, training, optimizer, lr_scheduler, ...)
TORCHTITAN_KEYS = {
    "parallelism.context_parallel_degree": "parallel.cp",
    "parallelism.tensor_parallel_degree": "parallel.tp",
    "parallelism.data_parallel_shard_degree": "parallel.dp",  # FSDP's degree: read with parallel.fsdp=true
    "training.steps": "train.steps",
    "training.seq_len": "data.seq_len",
    "training.local_batch_size": "train.micro_batch_size",
    "training.global_batch_size": "train.global_batch_size",
    "training.max_norm": "optimizer.clip_grad",
    "training.seed": "train.seed",
    "optimizer.lr": "optimizer.lr",
    "optimizer.eps": "optimizer.eps",
    "optimizer.weight_decay": "optimizer.weight_decay",
    "lr_scheduler.warmup_steps": "schedule.warmup_steps",
    "checkpoint.interval": "checkpoint.interval",
    "metrics.log_freq": "logging.interval",
    "activation_checkpoint.mode": "model.activation_checkpointing",
}
FOREIGN_DEST = "torchtitan:"  # argparse dest prefix of torchtitan's names
SHARD_DEGREE = "parallelism.data_parallel_shard_degree"


def torchtitan_spellings(name: str) -> tuple[str, str]:
    """``--a.b_c`` and ``--a.b-c``, the two ways torchtitan's command line writes ``a.b_c``."""
    section, _, field = name.partition(".")
    return f"--{name}", f"--{section.replace('_', '-')}.{field.replace('_', '-')}"


def read_torchtitan(given: dict[str, Any], flags: dict[str, Any], flag_of: dict[str, str]) -> tuple[dict[str, Any],
                                                                                                   list[str]]:
    """``({our key: value}, notes)`` for torchtitan's names ``given`` (name -> value as typed); ``flags``: the keys
    our own flags set (ConfigError when one sets the same key); ``flag_of``: our flag of a key, where there is one."""
    values: dict[str, Any] = {}
    notes = []
    for name, value in given.items():
        key = TORCHTITAN_KEYS[name]
        ours = flag_of.get(key)
        shown = f"{ours} {value}" if ours else f"--set {key}={value}"
        if name == SHARD_DEGREE:
            fsdp = str(value).strip() != "1"
            value = None if str(value).strip() == "-1" else value  # -1: the rest of the world
            values["parallel.fsdp"] = fsdp
            shown = f"--dp-size {'(the rest)' if value is None else value}{' --fsdp' if fsdp else ''}"
        if key in flags:
            raise ConfigError(f"--{name} (torchtitan's name) and {flag_of.get(key, key)} both set {key}: keep one")
        values[key] = value
        notes.append(f"command line: --{name} is torchtitan's name: read as {shown} ({key})")
    return values, notes


def _valid_fraction(split: str | None) -> str:
    """Megatron's ``--split 969,30,1`` (train, valid, test weights) as ``data.valid_fraction``."""
    try:
        weights = [float(w) for w in (split or "").replace("/", ",").split(",")]
        return f"{weights[1] / sum(weights):g}"
    except (ValueError, IndexError, ZeroDivisionError):
        return "F"


MEGATRON_HINTS = {
    "use-distributed-optimizer": lambda value: "use --fsdp (parallel.fsdp=true: FSDP2 shards the optimizer state, "
                                               "the gradients and the parameters over dp x cp)",
    "rotary-base": lambda value: f"use --set model.rope_theta={value or 'THETA'}",
    "split": lambda value: f"use --set data.valid_fraction={_valid_fraction(value)} (the last fraction of the "
                           f"documents is held out; there is no test split)",
    "finetune": lambda value: "use --init-from CHECKPOINT in place of --load CHECKPOINT --finetune (its model "
                              "weights, resharded: step 0, a fresh optimizer, schedule and data stream)",
    "no-load-optim": lambda value: "use --init-from CHECKPOINT in place of --load CHECKPOINT (its model weights "
                                   "only: a fresh optimizer, and step 0)",
    "test-data-path": lambda value: f"there is no test split: evaluate a checkpoint on that data with cp-train-eval "
                                    f"--load CHECKPOINT --valid-data-path {value or 'PREFIX'}",
    "fp8-format": lambda value: "use --set model.fp8=tensorwise (torchao's float8 training: e4m3 forward, e5m2 "
                                "gradients, as Megatron's hybrid) or rowwise",
    "fp8-recipe": lambda value: f"use --set model.fp8={value if value in ('tensorwise', 'rowwise') else 'tensorwise'}"
                                f" (torchao's dynamic scaling: tensorwise or rowwise)",
    "first-last-layers-bf16": lambda value: "use --set model.fp8_bf16_layers_at_start=1 --set "
                                            "model.fp8_bf16_layers_at_end=1",
    "num-layers-at-start-in-bf16": lambda value: f"use --set model.fp8_bf16_layers_at_start={value or 'N'}",
    "num-layers-at-end-in-bf16": lambda value: f"use --set model.fp8_bf16_layers_at_end={value or 'N'}",
}


def megatron_hint(name: str, value: str | None) -> str | None:
    """The hint for Megatron-LM's flag ``--name`` (given ``value``), or None when it is not one of them."""
    hint = MEGATRON_HINTS.get(name.replace("_", "-"))
    return None if hint is None else f"Megatron-LM's --{name} has no alias here: {hint(value)}"
