"""Config validation: every error names the numbers and what to change; the checks change nothing they check."""

from __future__ import annotations

import pytest
import torch

from cp_train.config.schema import ConfigError
from cp_train.config.validate import validate
from tests.config.config_cases import small

VALIDATION_ERRORS = [
    ({"parallel.dp": 2}, 8, r"world size 8 != tp\*cp\*dp = 1\*2\*2 = 4"),
    ({"parallel.tp": 2, "parallel.cp": 2}, 6, r"world size 6 is not divisible by tp\*cp = 2\*2 = 4"),
    ({"parallel.cp": 0}, 2, "parallel.cp must be >= 1, got 0"),
    ({"parallel.dp_replicate": 2}, 8, r"^parallel.dp_replicate 2 is HSDP, FSDP's sharding inside a replica: set "
                                      r"parallel.fsdp=true \(--fsdp\), or parallel.dp_replicate=1$"),
    ({"parallel.dp_replicate": 3, "parallel.fsdp": True}, 4, r"^parallel.dp_replicate 3 does not divide the DP size 2"),
    ({"parallel.dp_replicate": 0, "parallel.fsdp": True}, 2, r"^parallel.dp_replicate must be an integer >= 1, got 0"),
    ({"data.seq_len": 66}, 2, r"data.seq_len 66 is not divisible by 2\*cp = 4 for the zigzag layout"),
    ({"data.seq_len": 65, "parallel.cp_layout": "contiguous"}, 2, "data.seq_len 65 is not divisible by cp = 2"),
    ({"train.global_batch_size": 6}, 4, r"global_batch_size 6 is not divisible by micro_batch_size\*dp = 2\*2 = 4"),
    ({"parallel.tp": 4, "parallel.cp": 1, "model.num_heads": 6, "model.hidden_size": 48}, 4,
     "num_heads 6 is not divisible by tp = 4"),
    ({"parallel.tp": 4, "parallel.cp": 1}, 4, "num_kv_heads 2 is not divisible by tp = 4"),
    ({"parallel.tp": 2, "parallel.cp": 1, "model.vocab_size": 255}, 2, "vocab_size 255 is not divisible by tp = 2"),
    ({"parallel.tp": 2, "parallel.cp": 1, "model.ffn_hidden_size": 129}, 2,
     "ffn_hidden_size 129 is not divisible by tp = 2"),
    ({"model.hidden_size": 66}, 2, "hidden_size 66 is not divisible by num_heads 4"),
    ({"model.num_kv_heads": 3}, 2, "num_heads 4 is not divisible by num_kv_heads 3"),
    ({"data.seq_len": 512}, 2, "data.seq_len 512 exceeds model.max_position_embeddings 256"),
    ({"parallel.cp_layout": "spiral"}, 2, "spiral"),
    ({"train.steps": 0}, 2, "train.steps must be >= 1, got 0"),
    ({"train.micro_batch_size": 0}, 2, "train.micro_batch_size must be >= 1"),
    ({"logging.interval": 0}, 2, "logging.interval must be >= 1"),
    ({"train.valid_interval": -1}, 2, "train.valid_interval must be >= 0"),
    ({"checkpoint.interval": -5}, 2, "checkpoint.interval must be >= 0"),
    ({"train.exit_duration_minutes": -1.0}, 2, "train.exit_duration_minutes must be >= 0"),
    ({"train.exit_interval": 100}, 2, r"train.exit_interval 100 needs checkpoint.save \(--save DIR\): the run saves"),
    ({"checkpoint.interval": 10}, 2, "checkpoint.interval 10 needs checkpoint.save"),
    ({"train.valid_interval": 5, "data.valid_fraction": 0.0}, 2,
     "train.valid_interval 5 needs validation data: set data.valid_fraction > 0, or data.valid_prefix"),
    ({"data.valid_fraction": 1.5}, 2, r"data.valid_fraction must be in \[0, 1\), got 1.5"),
    ({"logging.profile": True, "logging.profile_step_start": 5, "logging.profile_step_end": 5}, 2,
     r"logging.profile records steps profile_step_start .. profile_step_end - 1, here 5 .. 4: they must be steps"),
    ({"logging.profile": True, "logging.profile_step_end": 102}, 2, r"here 10 .. 101: .* \(1 .. train.steps 100\)"),
    ({"logging.profile": True, "logging.profile_ranks": [0, 2]}, 2,
     r"logging.profile_ranks \[0, 2\]: name ranks of this run's world of 2 \(0 .. 1\)"),
    ({"logging.memory_snapshot": True}, 2, "logging.memory_snapshot records over the profiled steps: set "
                                           "logging.profile=true"),
    ({"optimizer.lr": 0.0}, 2, "optimizer.lr must be > 0"),
    ({"optimizer.min_lr": 1.0}, 2, "optimizer.min_lr 1.0 is larger than optimizer.lr"),
    ({"optimizer.beta2": 1.0}, 2, r"optimizer.beta2 must be in \[0, 1\)"),
    ({"optimizer.clip_grad": -1.0}, 2, "optimizer.clip_grad must be >= 0"),
    ({"train.dtype": "fp8"}, 2, "train.dtype must be one of auto, bf16, fp32; got 'fp8'"),
    ({"schedule.decay": "step"}, 2, "schedule.decay must be one of cosine, linear, wsd, constant"),
    ({"optimizer.implementation": "deepspeed"}, 2,
     "optimizer.implementation must be one of auto, fused, foreach, apex; got 'deepspeed'"),
    ({"optimizer.impl": "deepspeed"}, 2, "optimizer.implementation must be one of auto, fused, foreach, apex"),
    ({"optimizer.implementation": "apex", "parallel.fsdp": True}, 2,
     r"optimizer.implementation apex: apex's FusedAdam cannot update FSDP2's sharded \(DTensor\) parameters"),
    ({"model.norm": "fused"}, 2, "model.norm must be one of auto, torch, apex; got 'fused'"),
    ({"logging.wandb_mode": "cloud"}, 2, "logging.wandb_mode must be one of"),
    ({"data.prefix": "/x", "data.eod_id": None}, 2, "data.prefix without data.tokenizer needs data.eod_id"),
    ({"data.prefix": "/x", "data.eod_id": 2, "model.vocab_size": None}, 2,
     "data.prefix without data.tokenizer needs model.vocab_size"),
    ({"parallel.cp_algorithm": "tree"}, 2, r"unknown CP algorithm 'tree'; choose one of ring, allgather, ulysses, "
     r"hybrid.* \(or Megatron's p2p, all_gather, a2a, a2a\+p2p\), or register yours .* in a module listed in "
     r"train.imports"),
    ({"parallel.cp": 4, "parallel.cp_algorithm": "hybrid", "parallel.ulysses_size": 3}, 4,
     "parallel.ulysses_size 3 does not divide parallel.cp 4"),
    ({"parallel.cp": 4, "parallel.cp_algorithm": "hybrid", "parallel.ulysses_size": 1}, 4,
     r"hybrid needs 1 < parallel.ulysses_size < parallel.cp, got ulysses_size 1 at cp 4"),
    ({"parallel.cp": 4, "parallel.cp_algorithm": "a2a+p2p", "parallel.ulysses_size": 4}, 4,
     r"hybrid needs 1 < parallel.ulysses_size < parallel.cp.*use cp_algorithm=ulysses"),
    ({"parallel.cp": 2, "parallel.ulysses_size": 2}, 2, "ulysses_size 2 is only used by parallel.cp_algorithm=hybrid"),
    ({"parallel.cp": 8, "parallel.cp_algorithm": "ulysses", "data.seq_len": 64}, 8,
     r"parallel.cp_algorithm=ulysses: ulysses CP splits attention heads over 8 ranks: the 4 query heads per TP "
     r"rank are not divisible by 8"),
    ({"parallel.cp": 2, "parallel.tp": 2, "parallel.cp_algorithm": "a2a", "model.num_heads": 6,
      "model.hidden_size": 48, "model.num_kv_heads": 6}, 4, r"the 3 query heads per TP rank are not divisible by 2"),
    ({"parallel.cp": 4, "parallel.cp_algorithm": "ulysses", "model.num_heads": 12, "model.hidden_size": 96,
      "model.num_kv_heads": 3}, 4, r"the 3 kv heads per TP rank neither divide nor are divisible by 4"),
]


@pytest.mark.parametrize("overrides,world,message", VALIDATION_ERRORS,
                         ids=[next(iter(o)) + f"-w{w}" for o, w, _ in VALIDATION_ERRORS])
def test_validation_errors_name_the_numbers(overrides, world, message) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(small(**overrides), world)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA-only settings are valid with a GPU")
def test_cuda_only_settings_on_a_machine_without_cuda() -> None:
    with pytest.raises(ConfigError, match=r"parallel.backend nccl needs CUDA GPUs and this machine has none: use gloo"):
        validate(small(**{"parallel.backend": "nccl"}), 2)
    for backend in ("flash_attn", "fa3", "cudnn", "cudnn_ragged", "torch_efficient"):
        with pytest.raises(ConfigError, match=rf"model.attention_kernel {backend} needs CUDA and this run is on the "
                                              rf"CPU \(parallel.backend gloo\): use torch or math"):
            validate(small(**{"model.attention_kernel": backend}), 2)
    validate(small(**{"model.attention_kernel": "math"}), 2)


def test_valid_layouts_resolve_dp() -> None:
    assert validate(small(), 2) == 1 and validate(small(), 4) == 2
    assert validate(small(**{"parallel.tp": 2}), 8) == 2
    assert validate(small(**{"parallel.cp": 1, "data.seq_len": 63, "train.global_batch_size": 2}), 1) == 1


def test_apex_choices_validate_without_apex() -> None:
    """The validator checks the names only: apex is loaded (or its absence reported) when the run builds them."""
    config = small(**{"model.norm": "apex", "optimizer.implementation": "apex"})
    assert validate(config, 2) == 1 and (config.model.norm, config.optimizer.implementation) == ("apex", "apex")
    assert (small().model.norm, small().optimizer.implementation) == ("auto", "auto")


def test_old_spellings_are_read_with_a_one_line_note_and_one_seed_seeds_every_part() -> None:
    """Renamed keys (``optimizer.impl``, ``train.eval_interval``/``eval_iters``, ``model.attention_backend``) are
    read as the new ones for one release, each with a note; ``train.seed`` seeds the data, the model's initialisation
    and the eval unless their own seed is set."""
    config = small(**{"optimizer.impl": "apex", "train.eval_interval": 5, "train.eval_iters": 3,
                      "model.attention_backend": "math", "train.seed": 7, "data.seed": 9})
    assert (config.optimizer.implementation, config.train.valid_interval, config.train.valid_iters,
            config.model.attention_kernel) == ("apex", 5, 3, "math")
    assert len(config.deprecations) == 4 and all("\n" not in note and "deprecated, use" in note
                                                   for note in config.deprecations)
    assert small(**{"optimizer.impl": "torch"}).optimizer.implementation == "auto"
    assert (config.model.seed, config.eval.seed, config.data.seed) == (7, 7, 9)
    assert (small().model.seed, small().data.seed, small().eval.seed) == (1234, 1234, 1234)


def test_no_check_changes_the_config_it_checks() -> None:
    """``validate``, the dry run's ``memory_plan`` and the planner's ``predict`` leave their config as it was;
    the global batch of ``train.gradient_accumulation_steps`` is made by ``with_accumulation`` (a new config), and an
    explicit global batch that disagrees with it is an error naming both."""
    import copy

    from cp_train.config.sources import load_config
    from cp_train.config.validate import with_accumulation
    from cp_train.memory.dry_run import memory_plan
    from cp_train.perf.inputs.hardware import load_hardware
    from cp_train.perf.predict import predict
    from cp_train.perf.rates import DeviceRates

    config = load_config(overrides=["parallel.cp=2", "model.num_layers=2", "train.gradient_accumulation_steps=3",
                                    "train.micro_batch_size=1"])
    before = copy.deepcopy(config.to_dict())
    resolved = with_accumulation(config, 4)  # dp 2 at cp 2
    assert resolved.train.global_batch_size == 1 * 2 * 3 and config.to_dict() == before
    assert validate(resolved, 4) == 2 and memory_plan(resolved, 4)[0].dp == 2
    hardware = load_hardware("h100-sxm")
    resolved_before = copy.deepcopy(resolved.to_dict())
    predict(resolved, 4, DeviceRates(hardware), 989.0, 80.0, 3.0)
    assert resolved.to_dict() == resolved_before and resolved.model.vocab_size is None
    both = load_config(overrides=["train.gradient_accumulation_steps=3", "train.global_batch_size=16"])
    assert with_accumulation(both, 1) is both  # the explicit global batch is kept ...
    with pytest.raises(ConfigError, match="gradient_accumulation_steps 3 makes the global batch micro_batch_size\\*dp"
                                          "\\*steps = 1\\*1\\*3, not train.global_batch_size 16: set one of the two"):
        validate(both, 1)  # ... and said to disagree
