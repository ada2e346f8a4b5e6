"""FP8 linears (``model.fp8``: none | tensorwise | rowwise) with torchao's float8 training, on the TP layers.

Which linears: the caller passes the blocks (``cp_train.build``: ``model.layers``), whose column- and row-parallel
layers (attention qkv and proj, MLP gate/up and down) convert; the LM head and the embedding stay in the compute
dtype, as torchao and Megatron keep them, and so do the blocks ``model.fp8_bf16_layers_at_start`` /
``model.fp8_bf16_layers_at_end`` keep out (``ModelConfig.fp8_blocks``: the blocks that convert).

How: torchao's ``convert_to_float8_training`` swaps ``nn.Linear`` modules for ``Float8Linear``; the TP layers are
not ``nn.Linear`` (their forward runs the TP collectives around a local ``F.linear``), so a swap would lose the
collectives. Instead each converted layer keeps its class, its parameter names and its collectives, and only its
local matmul changes: its ``linear_fn`` (``F.linear`` by default, ``layers.py``; the MLP calls it too) becomes a
``Float8Matmul``, which runs torchao's float8 matmul (the autograd function ``Float8Linear`` runs: the input, the
weight and the output's gradient cast with dynamic scaling, e4m3 forward and e5m2 gradients for tensorwise, e4m3
with power-of-2 row scales for rowwise; tensorwise casts the input and the weight once, before that matmul,
since one scale serves both GEMMs each enters: torchao's results bitwise, one cast of the input fewer). So:

- TP and sequence parallelism: the collectives are the layer's, in the compute dtype, unchanged. Scales are per
  TP rank: each rank scales its own shard of the weight and its own input (the column-parallel input is the
  gathered one, the same on every rank; the row-parallel input is the rank's shard), with no extra collective.
- FSDP2 (``parallel.fsdp``) with tensorwise: the weights are all-gathered in FP8 (torchao's
  ``WeightWithDynamicFloat8CastTensor``, ``enable_fsdp_float8_all_gather``), the scale of each TP-local weight
  all-reduced over DP x CP; ``precompute_fp8_scales`` after every optimizer step computes all of them in one
  all-reduce. Only weights whose sharded dim splits evenly over the FSDP ranks (``fsdp_gathers_fp8``): torchao
  0.18's wrapper hands FSDP its shard unpadded (pytorch/ao#3982), so an uneven or empty shard breaks the gather; the
  others gather in the compute dtype and still multiply in FP8. Rowwise gathers in the compute dtype (torchao
  gathers tensorwise weights only).
- Activation checkpointing and ``torch.compile``: the float8 matmul is one autograd function, allowed in graphs;
  converting applies torchao's workaround for a Triton FP8 miscompile (as its ``convert_to_float8_training`` does).
- Checkpoints: the weights stay plain fp32 parameters with the same names (the FSDP wrapper's inner tensor is
  what ``cp_train.model.shards.local_tensor`` returns), so a checkpoint loads into bf16 and FP8 runs alike.
- On CPU torchao emulates the FP8 matmul (``emulate``: the operands rounded to FP8 and multiplied in fp32); on CUDA
  it needs FP8 tensor cores (compute capability 8.9: Ada, Hopper, Blackwell), weight dims and token counts that
  are multiples of 16 (``cp_train/config/fp8_shapes.py`` checks a run's config). ``fp8_unavailable`` says why a run
  cannot use it (torchao missing, an older GPU).

torchao is optional (``pip install -e ".[fp8]"``) and imported only when a run asks for FP8. The float8 matmul and
its config are torchao 0.18's (``torchao.float8.float8_linear``): the extra pins that release line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from cp_train.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear

RECIPES = ("none", "tensorwise", "rowwise")  # model.fp8
# model.fp8_fast_accum: which of a linear's three FP8 GEMMs (output, grad input, grad weight) accumulate fast
FAST_ACCUM = {"output": (True, False, False), "all": (True, True, True), "none": (False, False, False)}
FP8_CAPABILITY = (8, 9)  # the first CUDA compute capability with FP8 tensor cores (Ada; Hopper is 9.0)
INSTALL = 'pip install -e ".[fp8]"'
_WRAPPER_MODULE = "torchao.float8.fsdp_utils"  # where torchao's FSDP float8 weight wrapper lives


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao's import logs a warning per CUDA extension it cannot load on this machine, and torch one about an
    Enum it registers: harmless, and printed by every rank. Silenced while importing."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def import_float8() -> Any:
    """``torchao.float8``, imported quietly (``ImportError`` when torchao is missing)."""
    with _quiet_import():
        return importlib.import_module("torchao.float8")


def fp8_unavailable(recipe: str, device: torch.device) -> str | None:
    """One line saying why ``model.fp8`` ``recipe`` cannot run on ``device`` and what to change, or None."""
    if recipe == "none":
        return None
    if recipe not in RECIPES:
        return f"model.fp8 must be one of {', '.join(RECIPES)}; got {recipe!r}"
    try:
        import_float8()
    except ImportError as error:
        return (f"model.fp8 {recipe} needs torchao's float8 training ({error}): install it with {INSTALL}, or set "
                f"model.fp8=none")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            return (f"model.fp8 {recipe} needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
                    f"Blackwell) and {name} is sm_{capability[0]}{capability[1]}: set model.fp8=none")
    return None


def float8_config(recipe: str, emulate: bool, fsdp_all_gather: bool = False, fast_accum: str = "output") -> Any:
    """torchao's ``Float8LinearConfig`` of ``recipe`` (its ``from_recipe_name``), emulated (CPU) or not, with FP8
    all-gathers of the weights under FSDP2 where the recipe allows it (tensorwise), and fast accumulation in the
    GEMMs ``fast_accum`` names (``FAST_ACCUM``; "output" is both recipes' own; the emulation ignores it)."""
    float8 = import_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    fields = ("gemm_config_output", "gemm_config_grad_input", "gemm_config_grad_weight")
    changes: dict[str, Any] = {"emulate": emulate}
    changes.update({field: dataclasses.replace(getattr(config, field), use_fast_accum=fast)
                    for field, fast in zip(fields, FAST_ACCUM[fast_accum], strict=True)})
    if fsdp_all_gather and recipe == "tensorwise":
        changes["enable_fsdp_float8_all_gather"] = True
    return dataclasses.replace(config, **changes)


class Float8Matmul:
    """A TP layer's local matmul in FP8: ``linear_fn(x, weight, bias=None)`` with ``F.linear``'s contract (``x``
    ``[..., in]``, ``weight`` ``[out, in]``, output ``[..., out]`` in the compute dtype). Under autocast ``x`` is
    cast to autocast's dtype first (what ``F.linear`` would compute in); the weight goes to FP8 from the dtype it
    has (fp32 master weights, bf16 gathered by FSDP, or FP8 gathered already). Holds torchao's config and the
    matmul's per-GEMM settings, built as torchao 0.18's ``Float8Linear`` builds them."""

    def __init__(self, config: Any, cast_weight_once: bool = True) -> None:
        tensor_module = importlib.import_module("torchao.float8.float8_training_tensor")
        self._matmul = importlib.import_module("torchao.float8.float8_linear").matmul_with_hp_or_float8_args
        self._scaling = importlib.import_module("torchao.float8.float8_scaling_utils")
        self._roles = tensor_module.GemmInputRole
        gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
        self.config = config
        self.mm_config = tensor_module.LinearMMConfig(*(
            tensor_module.ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
            for gemm in gemms))
        # an operand whose backward cast is its forward's (tensorwise: one scale serves both GEMMs it enters) is
        # cast once, before the matmul, which then keeps the FP8 tensor for the backward (``_cast_once``); the
        # weight only when ``cast_weight_once``: under FSDP2 the weight is a gathered one, which FSDP frees after
        # the forward and gathers again for the backward, and an FP8 copy kept would hold every block's
        # unsharded weight from the forward to its backward (weights gathered in FP8 arrive cast either way)
        tensorwise = importlib.import_module("torchao.float8.config").ScalingGranularity.TENSORWISE
        self.cast_once = tuple(
            forward == backward and forward.scaling_granularity is tensorwise and once
            for forward, backward, once in (
                (config.cast_config_input, config.cast_config_input_for_grad_weight, True),
                (config.cast_config_weight, config.cast_config_weight_for_grad_input, cast_weight_once)))

    def _cast_once(self, x: torch.Tensor, input_role: bool) -> torch.Tensor:
        """``x`` (the input, or the weight transposed) as torchao's dynamic tensorwise cast makes it, when its two
        GEMMs take the same cast (``cast_once``); else ``x``, for torchao's matmul to cast per GEMM. The results are
        torchao's bitwise (the same scale, the same FP8 values); what changes is that the input's cast runs once
        where the matmul would cast it again for the weight's gradient (a second absolute maximum and a second cast
        of the bf16 input, as the joint graph keeps them apart), and eager keeps the FP8 input, not the bf16 one,
        for the backward."""
        if not self.cast_once[0 if input_role else 1] or self._scaling.tensor_already_casted_to_fp8(x):
            return x
        cast = self.config.cast_config_input if input_role else self.config.cast_config_weight
        role = self._roles.INPUT if input_role else self._roles.WEIGHT
        return self._scaling.hp_tensor_to_float8_dynamic(x, cast.target_dtype, self.mm_config, gemm_input_role=role,
                                                         round_scales_to_power_of_2=self.config.round_scales_to_power_of_2)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))
        with torch.autocast(kind, enabled=False):  # the casts and matmuls are torchao's, in the dtypes it chose
            y = self._matmul.apply(self._cast_once(x, True), self._cast_once(weight.t(), False), self.mm_config,
                                   self.config)
        return y if bias is None else y + bias.to(y.dtype)

    def __repr__(self) -> str:
        return f"Float8Matmul({self.config.cast_config_weight.short_str()}, emulate={self.config.emulate})"


def _tp_linears(blocks: nn.Module, prefix: str) -> list[tuple[str, ColumnParallelLinear | RowParallelLinear]]:
    return [(prefix + name, module) for name, module in blocks.named_modules()
            if isinstance(module, ColumnParallelLinear | RowParallelLinear)]


def convert_to_fp8(blocks: nn.ModuleList, recipe: str, device: torch.device, fsdp_shards: int = 0, prefix: str = "",
                   indices: Sequence[int] | None = None, fast_accum: str = "output") -> list[str]:
    """Make every column- and row-parallel layer inside ``blocks`` (the model's blocks, ``model.layers``; those at
    ``indices`` only when given: ``ModelConfig.fp8_blocks``) compute its local matmul in FP8 by ``recipe``, before
    ``torch.compile`` and FSDP2 wrap them (on the meta device or a real one); emulated unless ``device`` is CUDA.
    ``fsdp_shards``: the size of the group FSDP2 shards over (0: no FSDP); tensorwise then gathers in FP8 the
    weights whose split is even there (``fsdp_gathers_fp8``). Returns the converted layers' names (in ``blocks``,
    after ``prefix``: ``"layers."``). ``fast_accum``: ``model.fp8_fast_accum`` (``float8_config``). Call
    ``fp8_unavailable`` first: this assumes the recipe runs here; the shapes the GPU's GEMMs take are the config's
    check (``validate``)."""
    chosen = range(len(blocks)) if indices is None else indices
    if recipe == "none" or not chosen:
        return []
    _patch_inductor()
    config = float8_config(recipe, emulate=device.type != "cuda", fsdp_all_gather=fsdp_shards > 0,
                           fast_accum=fast_accum)
    matmul = Float8Matmul(config, cast_weight_once=fsdp_shards == 0)
    layers = [pair for index in chosen for pair in _tp_linears(blocks[index], f"{prefix}{index}.")]
    for _, layer in layers:
        layer.linear_fn = matmul
        column = isinstance(layer, ColumnParallelLinear)
        if config.enable_fsdp_float8_all_gather and fsdp_gathers_fp8(layer.weight.shape, column, layer.tp_size,
                                                                     fsdp_shards):
            _wrap_weight(layer, matmul)
    return [name for name, _ in layers]


def fsdp_gathers_fp8(shape: Sequence[int], column: bool, tp: int, shards: int) -> bool:
    """Whether FSDP2 over ``shards`` ranks can gather a TP-local weight of ``shape`` ``[out, in]`` in FP8: the dim it
    splits (``model/parallelize.py``: dim 1 of a column-parallel weight at tp > 1, else dim 0) must split evenly
    (torchao 0.18 hands FSDP the unpadded shard: an uneven split, or an empty shard, breaks the gather)."""
    return shape[1 if column and tp > 1 else 0] % shards == 0


def _patch_inductor() -> None:
    """torchao's workaround for a Triton miscompile of FP8 stores in compiled kernels (triton-lang/triton#11111),
    which its ``convert_to_float8_training`` applies before converting; idempotent, nothing where torchao lacks it."""
    try:
        module = importlib.import_module("torchao.float8._inductor_patch")
    except ImportError:
        return
    patch = getattr(module, "_patch_inductor_min_max_codegen", None)
    if patch is not None:
        patch()


def fp8_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s layers whose local matmul is FP8 (``convert_to_fp8``)."""
    return [name for name, module in model.named_modules() if isinstance(getattr(module, "linear_fn", None),
                                                                         Float8Matmul)]


def _wrap_weight(layer: nn.Module, matmul: Float8Matmul) -> None:
    """Give ``layer`` torchao's FSDP float8 weight (its all-gather sends FP8), keeping the TP attributes."""
    wrapper = importlib.import_module(_WRAPPER_MODULE).WeightWithDynamicFloat8CastTensor
    old = layer.weight
    param = nn.Parameter(wrapper(old.data, matmul.mm_config, matmul.config.cast_config_weight.target_dtype),
                         requires_grad=old.requires_grad)
    for attribute in ("tensor_model_parallel", "partition_dim"):
        if hasattr(old, attribute):
            setattr(param, attribute, getattr(old, attribute))
    layer.weight = param


def storage_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``tensor``'s values: ``tensor`` itself, or the inner tensor of torchao's FSDP float8
    weight wrapper (writes to it reach the parameter). Imports nothing: without torchao loaded, no wrapper exists."""
    module = sys.modules.get(_WRAPPER_MODULE)
    if module is not None and isinstance(tensor, module.WeightWithDynamicFloat8CastTensor):
        return tensor._tensor
    return tensor


def fp8_all_gather_weights(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``params`` (the sharded parameters: the optimizer's) that FSDP2 gathers in FP8: DTensors whose
    local tensor is torchao's wrapper."""
    module = sys.modules.get(_WRAPPER_MODULE)
    if module is None:
        return []
    from torch.distributed.tensor import DTensor

    return [p for p in params if isinstance(p, DTensor)
            and isinstance(p._local_tensor, module.WeightWithDynamicFloat8CastTensor)]


@torch.no_grad()
def precompute_fp8_scales(params: Iterable[torch.Tensor]) -> None:
    """After the optimizer step: the FP8 scale of every weight of ``params`` (the sharded parameters) that FSDP2
    gathers in FP8, in one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, for the TP
    layers), so the next gathers need none. The numbers the gathers compute without it: scale = fp8 max / the
    max |w| over the DP x CP group. Nothing to do (and no collective) without such weights."""
    weights = fp8_all_gather_weights(params)
    if not weights:
        return
    utils = importlib.import_module("torchao.float8.float8_utils")
    amax = torch.stack(torch._foreach_norm(weights, ord=math.inf))  # a Partial(max) DTensor
    amax = torch.clamp(amax, utils.EPS).full_tensor()  # one all-reduce for every weight
    (dtype,) = {w._local_tensor._dtype for w in weights}
    scales = (torch.finfo(dtype).max / amax.to(torch.float64)).to(torch.float32)
    for weight, scale in zip(weights, scales, strict=True):
        weight._local_tensor._precomputed_scale = scale
