"""The run configuration: dataclasses per concern, loaded from YAML and overridden by dotted keys
(``sources.py``).

Precedence (lowest first): dataclass defaults < the YAML file < command-line flags (``flags.py``)
< ``--set section.key=value`` overrides. Unknown sections or keys are errors naming the key;
values are coerced to the field's type by ``sources.coerce`` (``"3e-4"`` -> float, ``"true"`` -> bool,
``"null"`` -> None where the field allows it). ``validate`` checks a config against a world size and raises
``ConfigError`` naming the keys and the numbers.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

from cp_train.errors import InputError
from cp_train.model.config import ModelConfig


class ConfigError(InputError):
    """A config that cannot be loaded or cannot run; the message names the key or the numbers (exit code 2)."""


@dataclass
class ParallelConfig:
    tp: int = 1
    cp: int = 1
    dp: int | None = None  # None: world // (tp * cp)
    backend: str | None = None  # None: nccl on CUDA, else gloo
    timeout_minutes: float = 10.0  # bounds every collective; fractions work (0.05 = 3 s)
    check_collectives: bool = False  # compare the ranks' collectives at log steps and name a stall's first
    # differing call (cp_train/runtime/collective_check.py; a Python call's cost per collective)
    cp_layout: str = "zigzag"  # contiguous | zigzag | stripe | balanced (how the sequence is split over CP)
    # ring | allgather | ulysses | hybrid (Megatron's p2p, all_gather, a2a, a2a+p2p), or one registered by train.imports
    cp_algorithm: str = "ring"
    ulysses_size: int = 1  # hybrid: adjacent CP ranks per Ulysses group (cp = ulysses_size x ring size)
    dp_replicate: int = 1  # HSDP (with fsdp): FSDP shards over (dp / dp_replicate) x cp ranks, replicates across
    fsdp: bool = False  # shard parameters, gradients and optimizer state over DP x CP (FSDP2); false: DDP
    fsdp_reshard_after_forward: bool = True  # free the gathered parameters after forward (ZeRO-3); false: ZeRO-2
    # FSDP under gradient accumulation: reduce-scatter once per step (unsharded fp32 gradients of every parameter
    # kept between micro-batches) or after every micro-batch (sharded gradients only, more communication); auto:
    # per_step when the dry run's plan with it fits the device, else per_microbatch (cp_train/memory/dry_run.py)
    fsdp_reduce: str = "auto"  # auto | per_step | per_microbatch
    # Megatron's sequence parallelism: the residual stream and the norms sharded over TP along the sequence
    # (all-gather before the column-parallel layers, reduce-scatter after the row-parallel ones); null: on when tp > 1
    sequence_parallel: bool | None = None

    @property
    def sequence_parallel_on(self) -> bool:
        """Whether the run shards the sequence over TP: ``sequence_parallel``, or by default whenever tp > 1."""
        return self.tp > 1 and (self.sequence_parallel is None or self.sequence_parallel)


@dataclass
class DataConfig:
    prefix: str | None = None  # Megatron .bin/.idx prefix, or a blend "W1 PREFIX1 W2 ..."; None: the default corpus
    # validation data of its own (a prefix or a blend, read whole, also by the long-context eval); set, every
    # document of data.prefix trains (data.valid_fraction is not applied). None: data.valid_fraction of data.prefix
    valid_prefix: str | None = None
    tokenizer: str | None = None  # SentencePiece .model, HF tokenizer.json or its directory; None: the default's
    seq_len: int = 256
    valid_fraction: float = 0.02  # last fraction of the documents, held out for evaluation
    eod_id: int | None = None  # None: the tokenizer's
    mask_eod_loss: bool = True
    reset_position_ids: bool = False
    document_mask: bool = True  # attention stays inside each packed document (the loader's document_ids)
    cache_dir: str | None = None  # sample-index cache; None: next to the data
    num_workers: int | None = None  # loader worker processes; None: 2 on CUDA (prefetching), 0 on CPU
    seed: int = 1234  # document and sample shuffling

    @property
    def held_out_fraction(self) -> float:
        """The last fraction of each of ``prefix``'s datasets held out for validation: none with ``valid_prefix``."""
        return 0.0 if self.valid_prefix else self.valid_fraction


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1  # not applied to 1-D parameters (norms, biases)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # global gradient norm; 0 turns clipping off
    # the AdamW: auto (torch's fused on CUDA and CPU) | fused | foreach (torch's kernels) | apex (apex's FusedAdam)
    implementation: str = "auto"


@dataclass
class ScheduleConfig:
    warmup_steps: int = 0
    decay: str = "cosine"  # cosine | linear | wsd (warmup-stable-decay) | constant
    decay_steps: int | None = None  # None: train.steps - warmup_steps (wsd: decay_fraction of them)
    decay_fraction: float = 0.2  # wsd: the last fraction of the steps after warmup that decay (linearly) to min_lr
    restart: bool = False  # a resume that changed train.steps restarts the schedule (else: LR kept continuous)


@dataclass
class TrainConfig:
    steps: int = 100
    exit_interval: int = 0  # save and stop after each step that is a multiple of it; the rerun resumes (0: off)
    exit_duration_minutes: float = 0.0  # save and stop after the first step that ends this long after the start
    # of the run's setup; the rerun resumes (0: off). Both: cp_train/preemption.py
    micro_batch_size: int = 1
    global_batch_size: int = 8
    gradient_accumulation_steps: int | None = None  # set: global_batch_size = micro_batch_size * dp * this
    valid_interval: int = 0  # steps between validation losses (on data.valid_fraction); 0: off
    valid_iters: int = 1  # global batches of the validation split per validation
    seed: int = 1234  # the run's seed: runtime RNG (torch, numpy, random; offset per rank), and the data's, the
    # model's initialisation's and the eval's unless data.seed, model.seed or eval.seed is set
    dtype: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32
    grad_bucket_mb: float = 25.0  # gradient all-reduce bucket size (DDP, without parallel.fsdp)
    deterministic: bool = False  # torch.use_deterministic_algorithms: bitwise-repeatable CUDA runs (slower)
    cpu_keep_freed_memory: bool = True  # CPU: glibc keeps freed memory for the next step (memory/cpu_memory.py)
    compile: bool = False  # torch.compile each block and the head with its loss (fullgraph; GPT.compile_parts)
    gc_interval: int = 50  # Python's collector off in the run, a young-generation collection every this many
    # steps on every rank at once (cp_train/runtime/collector.py); 0: Python's own automatic collection
    check_cp_every: int = 0  # every N-th step: its first micro-batch's loss again without CP (cp_train/runtime/
    # cp_check.py), cp_check_rel_err in the step's record; 0: off
    check_cp_tolerance: float | None = None  # the largest relative error that passes; None: 1e-5 fp32, 2e-2 bf16
    check_replicas_every: int = 0  # every N-th step: the weights' replicas compared (runtime/replica_check.py)
    # Python modules imported before the config is checked: they register CP algorithms
    # (cp_train.parallel.register_cp_algorithm) or model families (cp_train.model.register_model_family)
    imports: list[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    save: str | None = None  # checkpoint directory (step_XXXXXXXX/ and a `latest` pointer)
    load: str | None = None  # checkpoint directory (its `latest`) or one step_XXXXXXXX/ directory
    interval: int = 0  # steps between saves; 0: off (a final save still happens when save is set)
    auto_resume: bool = True  # with no load, resume from save's `latest` when there is one
    init_from_hf: str | None = None  # HF Llama directory: model shape from its config.json, weights unless resuming
    # a cp-train checkpoint (a save directory or one step_*): its model weights, resharded, start a new run at step 0
    # with a fresh optimizer, schedule and data stream, unless resuming (checkpoint/weights.py; Megatron's --finetune)
    init_from: str | None = None
    keep: int = 2  # complete checkpoints kept in `save` (older ones are deleted); 0: keep all
    async_save: bool = False  # write behind training: the step waits only for the copy to host memory
    # keys whose change since the checkpoint a resume may accept (resume.py; e.g. [train.global_batch_size])
    allow_changes: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    dir: str | None = None  # the run directory; None: runs/<run name>
    interval: int = 10  # steps between records
    run_name: str | None = None  # prefix of the run name; tp/cp/dp and seq_len are appended
    wandb: bool = True
    wandb_project: str = "cp-train"
    wandb_mode: str | None = None  # None: online if WANDB_API_KEY is set, else offline; or disabled
    peak_tflops: float | None = None  # per device; None: the GPU table, or cpu_peak_tflops
    cpu_peak_tflops: float = 0.2  # assumed per-rank peak on CPU (MFU on CPU is indicative only)
    # the planner's hardware profile to predict this run with (a name or a YAML file, e.g. from cp-train-plan
    # --calibrate); None: the CUDA device's own profile, no prediction on CPU
    hardware_profile: str | None = None
    console: bool = True
    params_norm: bool = False  # Megatron-LM's --log-params-norm: the parameters' L2 norm in each record
    # torch.profiler over steps profile_step_start .. profile_step_end - 1 on profile_ranks (Megatron-LM's --profile;
    # cp_train/runtime/profiling.py): Chrome traces in <run dir>/profile, a profile record (idle fraction, kernels)
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    memory_snapshot: bool = False  # with profile, on CUDA: the allocator's history over those steps (a pickle)


@dataclass
class EvalConfig:
    """Long-context evaluation at validation steps (cp_train/eval, docs/eval.md): every ``every`` steps (0: off)."""

    every: int = 0
    tasks: list[str] = field(default_factory=lambda: ["loss_by_position", "passkey"])
    lengths: list[int] = field(default_factory=list)  # empty: data.seq_len
    depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    trials: int = 2  # per (length, depth) cell
    seed: int = 1234
    loss_samples: int = 4  # held-out samples of loss_by_position

def _default_model() -> ModelConfig:
    """ModelConfig defaults with vocab_size (the tokenizer's), num_kv_heads, ffn_hidden_size and head_dim
    (derived from the final num_heads / hidden_size in ``build_config``) left to resolve."""
    model = ModelConfig()
    model.vocab_size, model.num_kv_heads, model.ffn_hidden_size = None, None, None  # type: ignore[assignment]
    model.head_dim = None
    return model


@dataclass
class Config:
    model: ModelConfig = field(default_factory=_default_model)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    explicit_keys: ClassVar[frozenset[str]] = frozenset()  # dotted keys a layer set (per instance, build_config)
    deprecations: ClassVar[tuple[str, ...]] = ()  # notes on deprecated keys read (per instance, build_config)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def run_name(self, dp: int) -> str:
        """``<name>-tp{tp}-cp{cp}-dp{dp}-seq{seq_len}``: dashboards group runs by layout."""
        prefix = self.logging.run_name or "gpt"
        return f"{prefix}-tp{self.parallel.tp}-cp{self.parallel.cp}-dp{dp}-seq{self.data.seq_len}"


NULLABLE = {"model.vocab_size"}  # fields typed int that also accept None (resolved at build time)


def _sections() -> dict[str, type]:
    """The config's sections (its dataclass fields; not the per-instance notes ``explicit_keys``/``deprecations``)."""
    return {name: kind for name, kind in _hints(Config).items() if dataclasses.is_dataclass(kind)}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_type(key: str) -> Any:
    """The type of dotted ``key`` (``section.name``); ConfigError for an unknown key."""
    section, _, name = key.partition(".")
    sections = _sections()
    if section in sections and not name:
        raise ConfigError(f"{section} is a config section, not a key: set one of its keys, {section}.KEY=VALUE "
                          f"(keys of {section}: {', '.join(_hints(sections[section]))})")
    if section not in sections:
        raise ConfigError(f"unknown config key {key!r}: sections are {', '.join(sections)}"
                          f"{_suggest(section, sections)}")
    hints = _hints(sections[section])
    if name not in hints:
        raise ConfigError(f"unknown config key {key!r}{_suggest(name, hints, section + '.')}; "
                          f"keys of {section}: {', '.join(hints)}")
    kind = hints[name]
    return kind | None if key in NULLABLE else kind


def _suggest(name: str, choices: typing.Iterable[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
