"""Checks that a ``Config`` can run on a world of a given size (and on a given parallel state); errors name
the keys and the numbers."""

from __future__ import annotations

import dataclasses

import torch

from cp_train.config.fp8_shapes import check_fp8_shapes
from cp_train.config.schema import Config, ConfigError, field_type
from cp_train.model.config import NORMS
from cp_train.model.family import get_model_family
from cp_train.parallel.cp.algorithms.registry import get_cp_algorithm
from cp_train.parallel.cp.layout import LAYOUTS, check_layout
from cp_train.parallel.mesh.rank_groups import check_replicate, check_ulysses
from cp_train.parallel.mesh.rank_groups import resolve_dp as resolve_layout_dp
from cp_train.parallel.mesh.state import ParallelDims, ParallelState
from cp_train.parallel.tp.fp8 import FAST_ACCUM as FP8_FAST_ACCUM
from cp_train.parallel.tp.fp8 import RECIPES as FP8_RECIPES

DTYPES = ("auto", "bf16", "fp32")
FSDP_REDUCE = ("auto", "per_step", "per_microbatch")
DECAYS = ("cosine", "linear", "wsd", "constant")
OPTIMIZERS = ("auto", "fused", "foreach", "apex")  # optimizer.implementation: torch's AdamW kernels, or apex's
WANDB_MODES = (None, "online", "offline", "disabled")
CUDA_ATTENTION = ("fa3", "cudnn", "cudnn_ragged", "flash_attn", "torch_efficient")  # backends on CUDA only
FP32_MAX = 3.4028234663852886e38


def resolve_dp(config: Config, world_size: int) -> int:
    """DP size: ``parallel.dp``, or ``world_size // (tp * cp)``; ConfigError when the layout cannot fill the world."""
    tp, cp, dp = config.parallel.tp, config.parallel.cp, config.parallel.dp
    for key, value in (("parallel.tp", tp), ("parallel.cp", cp), ("parallel.dp", dp)):
        if value is not None and value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    try:
        return resolve_layout_dp(world_size, tp, cp, dp)
    except ValueError as error:
        raise ConfigError(f"{error} (parallel.tp/cp/dp)") from None


def _positive(config: Config, keys: tuple[str, ...], minimum: float) -> None:
    for key in keys:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value is not None and value < minimum:
            raise ConfigError(f"{key} must be >= {minimum}, got {value}")


def _check_optimizer_range(config: Config) -> None:
    """The optimizer updates fp32 weights with these numbers: each (and lr * weight_decay) must fit fp32."""
    optimizer = config.optimizer
    values = {f"optimizer.{f.name}": getattr(optimizer, f.name) for f in dataclasses.fields(optimizer)
              if isinstance(getattr(optimizer, f.name), float)}
    values["optimizer.lr * optimizer.weight_decay"] = optimizer.lr * optimizer.weight_decay
    for key, value in values.items():
        if abs(value) > FP32_MAX:
            raise ConfigError(f"{key} = {value:g} overflows the fp32 optimizer (largest fp32 number "
                              f"{FP32_MAX:.3g}); use a value like 3e-4")


def _choice(key: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}")


def _check_replicas(config: Config, dp: int) -> None:
    """parallel.dp_replicate (HSDP) divides the DP size and comes with FSDP."""
    replicas = config.parallel.dp_replicate
    try:
        check_replicate(dp, replicas)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if replicas > 1 and not config.parallel.fsdp:
        raise ConfigError(f"parallel.dp_replicate {replicas} is HSDP, FSDP's sharding inside a replica: set "
                          f"parallel.fsdp=true (--fsdp), or parallel.dp_replicate=1")


def _check_cp_algorithm(config: Config) -> None:
    """parallel.cp_algorithm and parallel.ulysses_size against cp and the heads per TP rank."""
    parallel, model = config.parallel, config.model
    try:
        algorithm = get_cp_algorithm(parallel.cp_algorithm)
        check_ulysses(parallel.cp, parallel.ulysses_size)
        algorithm.check(parallel.cp, parallel.ulysses_size)
        if parallel.cp > 1 and model.num_heads % parallel.tp == 0 and model.num_kv_heads % parallel.tp == 0:
            algorithm.check_heads(model.num_heads // parallel.tp, model.num_kv_heads // parallel.tp, parallel.cp,
                                  parallel.ulysses_size)
    except ValueError as error:
        raise ConfigError(f"parallel.cp_algorithm={parallel.cp_algorithm}: {error}") from None


def _check_device_settings(config: Config) -> None:
    """The backends that need CUDA, on a machine or a run without it (the run is on CUDA when the process
    group is nccl: ``build.select_device``)."""
    backend, attention = config.parallel.backend, config.model.attention_kernel
    cuda = torch.cuda.is_available()
    if backend == "nccl" and not cuda:
        raise ConfigError("parallel.backend nccl needs CUDA GPUs and this machine has none: use gloo, or leave it "
                          "unset")
    if attention in CUDA_ATTENTION and not (cuda and backend in (None, "nccl")):
        raise ConfigError(f"model.attention_kernel {attention} needs CUDA and this run is on the CPU "
                          f"(parallel.backend {backend or 'gloo'}): use torch or math, or leave it unset")


def _check_impls(config: Config) -> None:
    """optimizer.implementation, model.norm and model.fp8 name known choices that go together."""
    optimizer = config.optimizer
    _choice("optimizer.implementation", optimizer.implementation, OPTIMIZERS)
    _choice("model.norm", config.model.norm, NORMS)
    _choice("model.fp8", config.model.fp8, FP8_RECIPES)  # torchao and the GPU: build.build_model (parallel/tp/fp8.py)
    _choice("model.fp8_fast_accum", config.model.fp8_fast_accum, FP8_FAST_ACCUM)
    if optimizer.implementation == "apex" and config.parallel.fsdp:
        raise ConfigError("optimizer.implementation apex: apex's FusedAdam cannot update FSDP2's sharded (DTensor) "
                          "parameters; set optimizer.implementation=auto (torch's fused AdamW) or parallel.fsdp=false")


def with_accumulation(config: Config, world_size: int) -> Config:
    """``config`` with the global batch that ``train.gradient_accumulation_steps`` makes on ``world_size`` ranks
    (Megatron's way of saying it), a new config; ``config`` itself when the steps are unset. An explicit global batch
    is kept (``validate`` says when the two disagree)."""
    train, steps = config.train, config.train.gradient_accumulation_steps
    if steps is None or steps < 1 or "train.global_batch_size" in config.explicit_keys:
        return config
    batch = train.micro_batch_size * resolve_dp(config, world_size) * steps
    resolved = dataclasses.replace(config, train=dataclasses.replace(train, global_batch_size=batch))
    resolved.explicit_keys, resolved.deprecations = config.explicit_keys, config.deprecations
    return resolved


def _check_replica_comparison(config: Config, dp: int) -> None:
    """``train.check_replicas_every`` needs replicas: DDP's DP x CP ranks, or HSDP's replicas under FSDP."""
    every, parallel = config.train.check_replicas_every, config.parallel
    replicas = parallel.dp_replicate if parallel.fsdp else dp * parallel.cp
    if every and replicas < 2:
        raise ConfigError(f"train.check_replicas_every {every} compares the replicas of the weights and this layout "
                          f"has none ({'FSDP shards them' if parallel.fsdp else 'dp x cp is 1'}): use DDP over dp x "
                          f"cp > 1, or HSDP (parallel.dp_replicate > 1), or set train.check_replicas_every=0")


def validate(config: Config, world_size: int) -> int:
    """Raise ConfigError unless ``config`` runs on ``world_size`` ranks; return the DP size. Changes nothing."""
    dp = resolve_dp(config, world_size)
    tp, cp = config.parallel.tp, config.parallel.cp
    train, data, model = config.train, config.data, config.model
    _positive(config, ("train.steps", "train.micro_batch_size", "train.global_batch_size", "train.valid_iters",
                       "logging.interval", "data.seq_len"), 1)
    _positive(config, ("train.valid_interval", "checkpoint.interval", "checkpoint.keep", "schedule.warmup_steps",
                       "data.num_workers", "optimizer.weight_decay", "optimizer.clip_grad",
                       "optimizer.min_lr", "train.grad_bucket_mb", "logging.cpu_peak_tflops", "train.gc_interval",
                       "train.check_cp_every", "train.exit_interval", "train.exit_duration_minutes",
                       "train.check_replicas_every"), 0)
    _check_replicas(config, dp)
    if train.check_cp_tolerance is not None and not train.check_cp_tolerance > 0:
        raise ConfigError(f"train.check_cp_tolerance must be > 0 (or null: by dtype), got {train.check_cp_tolerance}")
    if not config.parallel.timeout_minutes > 0:
        raise ConfigError(f"parallel.timeout_minutes must be > 0 (fractions work: 0.5 = 30 s), got "
                          f"{config.parallel.timeout_minutes}")
    if not config.optimizer.lr > 0:
        raise ConfigError(f"optimizer.lr must be > 0, got {config.optimizer.lr}")
    _check_replica_comparison(config, dp)
    _check_optimizer_range(config)
    for key in config.checkpoint.allow_changes:
        try:
            field_type(key)
        except ConfigError as error:
            raise ConfigError(f"checkpoint.allow_changes: {error}") from None
    if config.optimizer.min_lr > config.optimizer.lr:
        raise ConfigError(f"optimizer.min_lr {config.optimizer.min_lr} is larger than optimizer.lr "
                          f"{config.optimizer.lr}")
    for key, beta in (("optimizer.beta1", config.optimizer.beta1), ("optimizer.beta2", config.optimizer.beta2)):
        if not 0 <= beta < 1:
            raise ConfigError(f"{key} must be in [0, 1), got {beta}")
    _choice("train.dtype", train.dtype, DTYPES)
    _check_device_settings(config)
    _choice("schedule.decay", config.schedule.decay, DECAYS)
    if not 0 < config.schedule.decay_fraction <= 1:
        raise ConfigError(f"schedule.decay_fraction must be in (0, 1], got {config.schedule.decay_fraction}")
    _check_impls(config)
    _choice("logging.wandb_mode", config.logging.wandb_mode, WANDB_MODES)
    _check_profile(config, world_size)
    if train.gradient_accumulation_steps is not None:
        _positive(config, ("train.gradient_accumulation_steps",), 1)
        if train.global_batch_size != train.micro_batch_size * dp * train.gradient_accumulation_steps:
            raise ConfigError(f"train.gradient_accumulation_steps {train.gradient_accumulation_steps} makes the global "
                              f"batch micro_batch_size*dp*steps = {train.micro_batch_size}*{dp}*"
                              f"{train.gradient_accumulation_steps}, not train.global_batch_size "
                              f"{train.global_batch_size}: set one of the two")
    per_micro_step = train.micro_batch_size * dp
    if train.global_batch_size % per_micro_step:
        raise ConfigError(f"train.global_batch_size {train.global_batch_size} is not divisible by "
                          f"micro_batch_size*dp = {train.micro_batch_size}*{dp} = {per_micro_step}; "
                          f"the global batch is micro batch * dp * gradient-accumulation steps")
    if config.parallel.fsdp and tp > 1 and model.hidden_size % (dp * cp):
        raise ConfigError(f"parallel.fsdp at tp={tp} shards the column-parallel weights (and the embedding) along "
                          f"model.hidden_size {model.hidden_size}, which must be divisible by dp*cp = {dp}*{cp} = "
                          f"{dp * cp}; change the layout or set parallel.fsdp=false")
    _choice("parallel.cp_layout", config.parallel.cp_layout, LAYOUTS)
    _choice("parallel.fsdp_reduce", config.parallel.fsdp_reduce, FSDP_REDUCE)
    _check_cp_algorithm(config)
    if cp > 1:
        try:
            check_layout(data.seq_len, cp, config.parallel.cp_layout, what="data.seq_len")
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if config.parallel.cp_layout == "balanced" and not data.document_mask:
            raise ConfigError("the balanced CP layout balances the per-document mask: set data.document_mask=true "
                              "or choose another layout (zigzag, stripe, contiguous)")
    if config.parallel.sequence_parallel_on and (data.seq_len // cp) % tp:
        raise ConfigError(f"parallel.sequence_parallel (on by default at tp > 1) splits each rank's data.seq_len/cp = "
                          f"{data.seq_len // cp} tokens over tp = {tp}, which must divide it; make data.seq_len a "
                          f"multiple of {cp * tp} or set parallel.sequence_parallel=false")
    if data.seq_len > model.max_position_embeddings:
        raise ConfigError(f"data.seq_len {data.seq_len} exceeds model.max_position_embeddings "
                          f"{model.max_position_embeddings}: for a model trained from scratch raise it "
                          f"(--max-position-embeddings {data.seq_len}); for a pretrained model extend its context "
                          f"with RoPE scaling (--set model.rope_scaling='{{rope_type: yarn, factor: "
                          f"{-(-data.seq_len // model.max_position_embeddings)}.0}}' and "
                          f"--max-position-embeddings {data.seq_len}; docs/huggingface.md)")
    if not 0 <= data.valid_fraction < 1:
        raise ConfigError(f"data.valid_fraction must be in [0, 1), got {data.valid_fraction}")
    if train.valid_interval > 0 and data.valid_fraction == 0 and not data.valid_prefix:
        raise ConfigError(f"train.valid_interval {train.valid_interval} needs validation data: set "
                          f"data.valid_fraction > 0, or data.valid_prefix (--valid-data-path), or "
                          f"train.valid_interval=0")
    if config.checkpoint.interval > 0 and not config.checkpoint.save:
        raise ConfigError(f"checkpoint.interval {config.checkpoint.interval} needs checkpoint.save (a directory)")
    for key, value in (("train.exit_interval", train.exit_interval), ("train.exit_duration_minutes",
                                                                      train.exit_duration_minutes)):
        if value and not config.checkpoint.save:
            raise ConfigError(f"{key} {value:g} needs checkpoint.save (--save DIR): the run saves there before it "
                              f"stops, and the same command resumes from it")
    if data.prefix is not None and data.tokenizer is None and data.eod_id is None:
        raise ConfigError("data.prefix without data.tokenizer needs data.eod_id (the end-of-document id)")
    if data.prefix is not None and data.tokenizer is None and model.vocab_size is None:
        raise ConfigError("data.prefix without data.tokenizer needs model.vocab_size")
    try:
        get_model_family(model.family)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    try:  # an unset vocab_size comes from the tokenizer and is checked again then
        dataclasses.replace(model, vocab_size=model.vocab_size or tp).validate(tp, cp, data.seq_len,
                                                                               config.parallel.cp_layout)
    except ValueError as error:
        raise ConfigError(f"model: {error}") from None
    check_fp8_shapes(config)  # the GPU's FP8 GEMMs: weight dims and tokens, multiples of 16
    return dp


def _check_profile(config: Config, world_size: int) -> None:
    """``logging.profile``: steps start .. end - 1 of the run, on ranks of the world (runtime/profiling.py)."""
    logging, steps = config.logging, config.train.steps
    start, end = logging.profile_step_start, logging.profile_step_end
    if logging.memory_snapshot and not logging.profile:
        raise ConfigError("logging.memory_snapshot records over the profiled steps: set logging.profile=true "
                          "(--profile) too")
    if not logging.profile:
        return
    if not 1 <= start < end or end - 1 > steps:
        raise ConfigError(f"logging.profile records steps profile_step_start .. profile_step_end - 1, here {start} .. "
                          f"{end - 1}: they must be steps of the run (1 .. train.steps {steps}), e.g. "
                          f"--profile-step-start {min(10, max(1, steps - 1))} --profile-step-end {min(12, steps + 1)}")
    outside = [rank for rank in logging.profile_ranks if not 0 <= rank < world_size]
    if outside or not logging.profile_ranks:
        raise ConfigError(f"logging.profile_ranks {logging.profile_ranks}: name ranks of this run's world of "
                          f"{world_size} (0 .. {world_size - 1}), e.g. --profile-ranks 0")


def check_parallel_state(config: Config, state: ParallelState, dp: int) -> None:
    """ValueError unless ``state`` (already initialised) has ``config``'s layout and Ulysses groups."""
    dims = ParallelDims(tp=config.parallel.tp, cp=config.parallel.cp, dp=dp)
    if dims != state.dims:
        raise ValueError(f"config layout {dims} differs from the parallel state's {state.dims}")
    replicas = config.parallel.dp_replicate
    if state.dp_replicate != replicas:
        raise ValueError(f"parallel.dp_replicate {replicas} differs from the parallel state's {state.dp_replicate} "
                         f"replicas: initialise it with dp_replicate={replicas}")
    ulysses = state.cp_ulysses.size if state.cp_ulysses else 1
    if config.parallel.cp > 1 and get_cp_algorithm(config.parallel.cp_algorithm).subgroups \
            and ulysses != config.parallel.ulysses_size:
        raise ValueError(f"parallel.ulysses_size {config.parallel.ulysses_size} differs from the parallel state's "
                         f"Ulysses groups of {ulysses}: initialise it with ulysses_size="
                         f"{config.parallel.ulysses_size}")
