"""Other frameworks' flags on ``train.py``'s command line (``flags.py``).

- torchtitan's dotted names (``--parallelism.context_parallel_degree 2``, also with dashes) for the keys cp-train
  has are read as ours, each with a one-line note naming our flag (``config.deprecations``, logged at the start of
  the run); one given with our own flag for the same key is an error;
- Megatron-LM's flags that say what cp-train always does (``--swiglu``, ``--normalization RMSNorm``,
  ``--disable-bias-linear``, ``--overlap-grad-reduce``, ...; ``MEGATRON_AS_ALWAYS``) are accepted, each with a note;
  a value that asks for something else (``--normalization LayerNorm``) is an error naming what cp-train does;
- Megatron-LM's flags that have no alias here (``--use-distributed-optimizer``, ``--test-data-path``,
  ``--finetune``, ``--fp16``, ``--rampup-batch-size``, ...; ``MEGATRON_HINTS``) are refused with a one-line hint
  naming ours.

So a Megatron-LM Llama script's command line runs here as it is, or says in one line what to change.
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


MEGATRON_HINTS = {
    "use-distributed-optimizer": lambda value: "use --fsdp (parallel.fsdp=true: FSDP2 shards the optimizer state, "
                                               "the gradients and the parameters over dp x cp)",
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
    "fp16": lambda value: "cp-train computes in bf16 (--bf16, train.dtype=bf16) or fp32, with fp32 weights",
    "rampup-batch-size": lambda value: "there is no batch-size ramp-up: set --global-batch-size, and change it on a "
                                       "resume with --set checkpoint.allow_changes=train.global_batch_size",
    "tensorboard-dir": lambda value: "metrics go to wandb and <run dir>/metrics.jsonl (--wandb-project, --run-dir)",
    "no-save-optim": lambda value: "checkpoints hold the optimizer; --init-from CHECKPOINT starts a run from the "
                                   "weights alone",
    "no-load-rng": lambda value: "a resume restores the RNG; --init-from CHECKPOINT starts from train.seed",
    "use-checkpoint-args": lambda value: "a resume compares the checkpoint's config with the run's and names each "
                                         "change (checkpoint.allow_changes accepts one)",
}


MEGATRON_DEST = "megatron:"  # argparse dest prefix of the flags below

# Megatron-LM's flags that state what cp-train always does: flag -> (the values that say it, in any case; () for
# a switch; None for any value), what cp-train does
MEGATRON_AS_ALWAYS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "swiglu": ((), "the MLP is SwiGLU"),
    "normalization": (("RMSNorm",), "the norms are RMSNorm"),
    "position-embedding-type": (("rope",), "positions are RoPE (model.rope_theta, model.rope_scaling)"),
    "use-rotary-position-embeddings": ((), "positions are RoPE"),
    "disable-bias-linear": ((), "the linears have no bias (--add-qkv-bias adds the q, k and v projections')"),
    "group-query-attention": ((), "the key/value heads are --num-query-groups (model.num_kv_heads)"),
    "attention-dropout": (("0", "0.0"), "there is no dropout"),
    "hidden-dropout": (("0", "0.0"), "there is no dropout"),
    "use-mcore-models": ((), "the model is cp-train's"),
    "transformer-impl": (("local", "transformer_engine"), "the layers are cp-train's own, fused by --compile"),
    "no-masked-softmax-fusion": ((), "attention runs in flash kernels"),
    "no-bias-swiglu-fusion": ((), "SwiGLU is fused by --compile"),
    "no-bias-dropout-fusion": ((), "there is no dropout"),
    "no-rope-fusion": ((), "RoPE is fused by --compile"),
    "overlap-grad-reduce": ((), "DDP's buckets and FSDP2 reduce gradients during the backward"),
    "exit-signal-handler": ((), "SIGTERM, SIGUSR1 and Ctrl-C save a checkpoint after the step and stop"),
    "overlap-param-gather": ((), "FSDP2 gathers the next block's parameters during the current one's compute"),
    "no-gradient-accumulation-fusion": ((), "gradients accumulate in fp32 parameters' .grad"),
    "log-throughput": ((), "every record carries tokens/s and MFU"),
    "timing-log-level": (None, "every record carries the step and data times"),
    "log-timers-to-tensorboard": ((), "every record carries the step and data times"),
    "ckpt-format": (("torch_dist",), "checkpoints are PyTorch DCP, torch_dist's format"),
    "make-vocab-size-divisible-by": (("128",), "the vocabulary is padded to a multiple of 128 (--vocab-size sets it)"),
    "tokenizer-type": (None, "the tokenizer's kind is read from --tokenizer-model's file"),
    "recompute-method": (("uniform",), "--recompute-granularity full recomputes every block"),
    "recompute-num-layers": (("1",), "--recompute-granularity full recomputes every block"),
    "no-position-embedding": ((), "there is no learned position embedding: positions are RoPE"),
    "attention-softmax-in-fp32": ((), "the attention's softmax is fp32 inside the flash kernels"),
    "accumulate-allreduce-grads-in-fp32": ((), "gradients are fp32, accumulated and reduced in fp32"),
    "calculate-per-token-loss": ((), "the loss is the mean over the global batch's loss tokens, exact over dp x cp"),
    "log-validation-ppl-to-tensorboard": ((), "every validation record carries the perplexity"),
    "log-memory-to-tensorboard": ((), "every record carries the peak memory"),
    "log-world-size-to-tensorboard": ((), "the setup record carries the layout"),
}


def read_megatron_as_always(given: dict[str, Any]) -> list[str]:
    """The note (one line, or none) for Megatron-LM's flags ``given`` (name -> value; True for a switch) that say
    what cp-train always does; ConfigError for a value that asks for something else."""
    shown = []
    for name, value in given.items():
        accepted, what = MEGATRON_AS_ALWAYS[name]
        flag = f"--{name}" if value is True else f"--{name} {value}"
        if accepted and str(value).strip().lower() not in {a.lower() for a in accepted}:
            raise ConfigError(f"Megatron-LM's {flag}: here {what}; drop the flag (or pass --{name} {accepted[0]})")
        shown.append(flag)
    return [f"command line: Megatron-LM's {', '.join(shown)}: what cp-train does anyway, nothing to set "
            f"(cp_train/config/foreign_flags.py)"] if shown else []


def megatron_hint(name: str, value: str | None) -> str | None:
    """The hint for Megatron-LM's flag ``--name`` (given ``value``), or None when it is not one of them."""
    hint = MEGATRON_HINTS.get(name.replace("_", "-"))
    return None if hint is None else f"Megatron-LM's --{name} has no alias here: {hint(value)}"
