"""What a training run is made of, built in one place (``Trainer.__init__`` calls these in this order).

- ``RunEnvironment``: the config checked against the parallel state, the device and autocast dtype, the
  seeded RNG, the data sources, the run's name and directory, and the checkpoint it resumes from;
- ``TrainingState``: the model, the module that runs it, the optimizer, the LR schedule and the sharded
  (checkpointed) state of both; it resumes from a checkpoint;
- ``RunData``: the train and validation datasets, the sample planner and this rank's train loader;
- ``open_writers``: the run's metrics writers (and its ``config.yaml``).

The order is part of the result: the RNG is seeded before the data and the model are built, and the
model, the optimizer, a resumed checkpoint, the datasets and the loader follow in that order (each may
draw random numbers or run collectives). The pieces themselves are made by ``build``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from cp_train import build
from cp_train.checkpoint.dcp import ShardedState
from cp_train.checkpoint.files import check_save_root, resume_hint, resume_source
from cp_train.checkpoint.resume import check_save_directory, restore_run
from cp_train.checkpoint.rng import derived_seed, seed_everything
from cp_train.checkpoint.weights import init_source, load_dcp_weights
from cp_train.config.fp8_shapes import fp8_notes
from cp_train.config.hf_init import check_hf_weights, hf_init_message
from cp_train.config.schema import Config, dump_yaml
from cp_train.config.sources import unused_settings
from cp_train.config.validate import check_parallel_state, validate
from cp_train.data.loader import StepLoader
from cp_train.errors import agree, ensure_writable_dir
from cp_train.memory.cpu_memory import keep_freed_memory
from cp_train.memory.state_bytes import setup_record
from cp_train.metrics.writers import MetricWriters, SinkSettings
from cp_train.model.gpt import GPTModel
from cp_train.optim import LRSchedule, build_optimizer
from cp_train.parallel.cp.plan.batch_plan import SamplePlanner
from cp_train.parallel.kernels import cudnn_ragged
from cp_train.parallel.mesh.state import ParallelState
from cp_train.runtime.profiling import check_profile_device


@dataclass(frozen=True)
class RunEnvironment:
    """Where a run trains and on what: fixed once built."""

    config: Config
    state: ParallelState
    dp: int  # the data-parallel size (validated against the world)
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: no autocast
    sources: build.DataSources
    run_name: str
    run_dir: Path
    resumed_from: Path | None  # the checkpoint this run resumes from
    hf_dir: str | None  # the Hugging Face weights a fresh run starts from
    notes: tuple[str, ...]  # to log at the start (HF initialisation, deprecated keys)
    started: float  # time.monotonic() when the run's setup began (train.exit_duration_minutes)
    init_from: Path | None = None  # the cp-train checkpoint whose weights a fresh run starts from

    def where_to_resume(self) -> str:
        """Where to resume after a failure: the newest complete checkpoint saved, else ``resumed_from``."""
        return resume_hint(self.config.checkpoint.save, self.resumed_from)


def prepare_environment(config: Config, state: ParallelState) -> RunEnvironment:
    """Check ``config`` against ``state``, pick the device and kernels, seed the RNG, resolve the data (filling
    ``model.vocab_size``), check the run's directories and find the checkpoint to resume from (collective)."""
    started = time.monotonic()
    dp = validate(config, state.world_size)
    check_parallel_state(config, state, dp)
    device = build.select_device(state)
    check_profile_device(config, device)  # logging.memory_snapshot: CUDA's allocator
    if config.train.deterministic:
        build.use_deterministic_algorithms()
    if config.model.attention_kernel == "cudnn_ragged":
        cudnn_ragged.enable()  # PyTorch reads it at the process's first cuDNN attention call, whichever makes it
    if device.type == "cpu" and config.train.cpu_keep_freed_memory:
        keep_freed_memory()
    autocast_dtype = build.autocast_dtype(config, device)
    seed_everything(derived_seed(config.train.seed, state.rank))
    sources = build.resolve_data(config, state)
    run_name = config.run_name(dp)
    run_dir = build.run_dir_of(config, run_name)
    agree(lambda: _check_directories(config, state, run_dir))
    ckpt = config.checkpoint
    share = (state.rank, state.world_size)  # every rank verifies its share of the checkpoint's checksums
    resumed_from = agree(lambda: resume_source(ckpt.load, ckpt.save if ckpt.auto_resume else None, share))
    agree(lambda: check_save_directory(ckpt.save, resumed_from) if state.rank == 0 else None)  # nothing overwritten
    hf_dir = None if resumed_from is not None else ckpt.init_from_hf
    init_from, init_notes = None, []  # a cp-train checkpoint's weights (checkpoint/weights.py)
    if resumed_from is None and ckpt.init_from:
        init_from, init_notes = agree(lambda: init_source(ckpt.init_from, config, share))
    if hf_dir is not None:  # its weights load at the end of the model's build: checked before it
        agree(lambda: check_hf_weights(hf_dir, config.model))
    notes = ((hf_init_message(config),) if hf_dir is not None else ()) + tuple(config.deprecations)
    notes += unused_settings(config)  # keys set to values this run cannot use (FSDP's options without FSDP, ...)
    notes += tuple(init_notes) + cp_tokens_warning(config)
    notes += fp8_notes(config, dp, device.type == "cuda")  # eager FP8 on CUDA; layers that gather in bf16 (FSDP)
    return RunEnvironment(config, state, dp, device, autocast_dtype, sources, run_name, run_dir, resumed_from, hf_dir,
                          notes, started, init_from)


CP_MIN_TOKENS = 512  # tokens per CP rank below which CP's exchanges cost more than the attention they split


def cp_tokens_warning(config: Config) -> tuple[str, ...]:
    """A warning when each CP rank holds fewer than ``CP_MIN_TOKENS`` tokens of a sample."""
    cp, seq_len = config.parallel.cp, config.data.seq_len
    if cp <= 1 or seq_len // cp >= CP_MIN_TOKENS:
        return ()
    smaller = max(1, seq_len // CP_MIN_TOKENS)
    return (f"warning: each CP rank holds {seq_len // cp} tokens (data.seq_len {seq_len} / cp {cp}), fewer than CP "
            f"pays for (about {CP_MIN_TOKENS}): use a smaller --cp-size ({smaller} at this length) or a longer "
            f"--seq-len (at least {CP_MIN_TOKENS * cp})",)


def _check_directories(config: Config, state: ParallelState, run_dir: Path) -> None:
    """The run directory and the checkpoint directory must take files before step 1 (rank 0 writes both the
    metrics and the checkpoint metadata)."""
    if state.rank == 0:
        ensure_writable_dir(run_dir, "logging.dir (--run-dir)")
        if config.checkpoint.save:
            check_save_root(config.checkpoint.save)  # not one checkpoint: the run's would nest in it
            ensure_writable_dir(Path(config.checkpoint.save), "checkpoint.save (--save)")


@dataclass(frozen=True)
class TrainingState:
    """What training updates: the model (sharded by FSDP2 in place), the module that runs it (the DDP wrapper
    or the model), its trainable parameters, the optimizer, the LR schedule, and their checkpointed state."""

    model: GPTModel
    module: nn.Module
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    sharded: ShardedState

    def resume(self, env: RunEnvironment) -> tuple[int, int, list[str]]:
        """Load the checkpoint ``env.resumed_from`` (resharded to this layout) into the model and optimizer (and
        restore the RNG); returns (step, consumed samples, notes to log)."""
        assert env.resumed_from is not None
        return restore_run(env.resumed_from, env.config, self.sharded, self.optimizer, env.state, self.schedule)

    def sizes(self, state: ParallelState) -> dict[str, int]:
        """Parameter counts: the whole model's and this rank's (``build.describe``)."""
        return build.describe(self.model, state)

    def setup_record(self, sizes: dict[str, int], extra: dict) -> dict:
        """The ``{"kind": "setup"}`` record of parameter and state bytes (collective; ``state_bytes``)."""
        return setup_record(self.model, self.optimizer, sizes, extra)


def build_training_state(env: RunEnvironment) -> TrainingState:
    """The model (fresh, or from ``env.hf_dir`` or ``env.init_from``), the optimizer and schedule, and their sharded
    state."""
    config = env.config
    model, module = build.build_model(config, env.state, env.device, env.hf_dir, env.autocast_dtype)
    if env.init_from is not None:
        load_dcp_weights(model, env.init_from, env.state)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, config.optimizer, env.device)
    schedule = LRSchedule(config.optimizer, config.schedule, config.train.steps)
    return TrainingState(model, module, params, optimizer, schedule, ShardedState(model, optimizer, env.state))


@dataclass(frozen=True)
class RunData:
    """The datasets, the planner of per-document attention (None without ``data.document_mask``) and this
    rank's train loader."""

    train_data: Dataset  # a GPTDataset, or a BlendedDataset of them
    valid_data: Dataset | None
    planner: SamplePlanner | None
    loader: StepLoader

    def valid_loader(self, env: RunEnvironment) -> StepLoader:
        """A fresh loader over the validation split (which must exist), from its first sample."""
        assert self.valid_data is not None
        return build.build_loader(env.config, self.valid_data, env.state, 0, env.device, self.planner)


def build_run_data(env: RunEnvironment, model: GPTModel, consumed_samples: int) -> RunData:
    """Datasets over ``env.sources`` and the train loader from ``consumed_samples`` on (a resumed run's)."""
    config, state = env.config, env.state
    train_data, valid_data = build.build_datasets(config, env.sources, state)
    planner = model.sample_planner() if config.data.document_mask else None
    loader = build.build_loader(config, train_data, state, consumed_samples, env.device, planner)
    return RunData(train_data, valid_data, planner, loader)


def open_writers(env: RunEnvironment, first_step: int, wandb: dict[str, str] | None = None) -> MetricWriters:
    """The metrics writers of a run starting (or resumed) at ``first_step`` (rank 0 writes; it also writes the
    run's ``config.yaml``); ``wandb``: the id and group of the wandb run to continue (a checkpoint's). Collective:
    an error opening them (wandb's, say) stops every rank alike and rank 0 alone reports it."""
    config, state = env.config, env.state
    logging = config.logging
    settings = SinkSettings(
        run_dir=env.run_dir, run_name=env.run_name, total_steps=config.train.steps, first_step=first_step,
        append=first_step > 0, console=logging.console, config=config.to_dict(),
        layout={**state.dims, "world_size": state.world_size, "seq_len": config.data.seq_len},
        use_wandb=logging.wandb, wandb_project=logging.wandb_project, wandb_mode=logging.wandb_mode,
        wandb_id=(wandb or {}).get("id"), wandb_group=(wandb or {}).get("group"))
    writers = agree(lambda: MetricWriters(settings, enabled=state.rank == 0))
    if state.rank == 0:
        (env.run_dir / "config.yaml").write_text(dump_yaml(config))
    return writers


def due_events(config: Config, step: int, last: int) -> tuple[bool, bool, bool]:
    """Whether step ``step`` (1-based) of a run ending at ``last`` logs, evaluates, saves a checkpoint."""
    every = config.logging.interval, config.train.valid_interval, config.checkpoint.interval
    return (step % every[0] == 0 or step == last, bool(every[1]) and (step % every[1] == 0 or step == last),
            bool(every[2]) and step % every[2] == 0)


def start_line(env: RunEnvironment, state: ParallelState, sizes: dict[str, int], peak: str) -> str:
    """The run's first console line: its name, parameters, layout, device, run dir and the assumed ``peak``."""
    sharding = "FSDP over dp x cp" if env.config.parallel.fsdp else "DDP"
    return (f"run {env.run_name}: {sizes['parameters']:,} parameters ({sizes['parameters_per_rank']:,} per "
            f"rank, {sharding}), world {state.world_size} = tp {state.tp.size} x cp {state.cp.size} x dp "
            f"{state.dp.size}, device {env.device}, run dir {env.run_dir}; peak {peak}")


def part_attributes(group: str, *names: str) -> tuple[property, ...]:
    """Read-only ``Trainer`` attributes ``names``: those of its part ``group`` (``env``, ``training``, ``data``)."""
    return tuple(property(lambda self, name=name: getattr(getattr(self, group), name), doc=f"``{group}.{name}``")
                 for name in names)
