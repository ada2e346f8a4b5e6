"""One pre-norm decoder block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cp_train.model.attention import Attention
from cp_train.model.config import NORMS, ModelConfig
from cp_train.model.mlp import MLP
from cp_train.parallel.mesh.model_parallel import ModelParallel
from cp_train.parallel.offload import ActivationOffload
from cp_train.parallel.tp.sequence_parallel import sequence_parallel_norm


def _target_device(device: torch.device | str | None) -> torch.device:
    """Where a module built now with ``device`` lives: that device, else the default (``with torch.device``)."""
    return torch.device(device) if device is not None else torch.get_default_device()


def rms_norm(hidden: int, eps: float, kind: str = "auto", dtype: torch.dtype | None = None,
             device: torch.device | str | None = None) -> nn.Module:
    """An RMSNorm over the last dimension ``hidden`` whose one parameter is ``weight`` (ones), of ``kind``:

    - ``torch``: ``nn.RMSNorm`` (what the CPU runs, bitwise);
    - ``apex``: ``apex.normalization.FusedRMSNorm`` on any device (apex itself falls back to a Python RMSNorm
      off CUDA); ``ImportError`` naming ``model.norm`` when apex or its CUDA extension cannot be loaded;
    - ``auto``: apex's when it loads and the module is built for CUDA (a ``cuda`` device, or ``meta`` on a
      machine with CUDA: a meta build is allocated on the run's device), else torch's, silently.
    """
    if kind not in NORMS:
        raise ValueError(f"unknown norm {kind!r}; choose one of {', '.join(NORMS)}")
    target = _target_device(device)
    use_apex = kind == "apex" or (kind == "auto" and (target.type == "cuda" or (
        target.type == "meta" and torch.cuda.is_available())))
    if use_apex:
        try:
            fused = importlib.import_module("apex.normalization").FusedRMSNorm(hidden, eps=eps)
        except (ImportError, AttributeError) as error:
            if kind == "apex":
                raise ImportError(f"model.norm is apex but apex's FusedRMSNorm cannot be loaded ({error}); "
                                  f"install NVIDIA apex with its CUDA extensions or set model.norm to auto or "
                                  f"torch") from None
        else:
            return fused.to(device=device, dtype=dtype) if device is not None or dtype is not None else fused
    return nn.RMSNorm(hidden, eps=eps, dtype=dtype, device=device)


class BlockInputs:
    """What every block of one forward shares, built once by ``GPTModel.forward``: the RoPE tables
    ``cos``/``sin`` of this rank's global positions (``model.rope.rope_tables``) and the attention ``handle``
    (``cp_train.parallel.cp.op.plan_handle``: a CPU scalar naming the attention spec and the batch's CP plan) of the
    full layers, and ``handles``: the handle of each window the layers use (key None: ``handle``; a window lives in
    its plan). Tensors only, so a compiled block sees a new plan as a new value, not a new graph. ``offload``: the
    forward's ``ActivationOffload`` (``model.activation_offload``; made by its first block, None until then).

    A plain class on purpose: FSDP2 searches each sharded module's arguments for tensors that need gradients,
    through dataclasses too, and searching the plan (index tensors, none needing gradients) took 150-450 us
    per block call at cp 2-8."""

    __slots__ = ("cos", "sin", "handle", "handles", "offload")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, handle: torch.Tensor,
                 handles: dict[int | None, torch.Tensor] | None = None) -> None:
        self.cos, self.sin, self.handle = cos, sin, handle
        self.handles = {None: handle, **(handles or {})}
        self.offload: ActivationOffload | None = None


class Block(nn.Module):
    """Input and output ``[B, n, hidden]`` (this rank's tokens, replicated over the TP group of ``parallel``), or
    with ``parallel.sequence_parallel`` ``[B, n/tp, hidden]``: this TP rank's contiguous shard of them, on which
    the norms run (their weight gradients summed over TP); attention and MLP gather and reduce-scatter.

    The RMSNorm weights are replicated over TP (and CP). ``config.activation_checkpointing``: ``full`` keeps
    only the block's input for the backward and recomputes the block there (the CP attention's communication
    included); ``selective`` recomputes all but the CP attention, which keeps its inputs and outputs;
    ``none`` keeps everything. ``config.activation_offload`` (``checkpointed`` or ``all``): what the block keeps
    goes to host memory during the forward and comes back a layer ahead of its backward (``parallel/offload.py``;
    the RoPE tables and the parameters stay), bitwise the same results.
    """

    def __init__(self, config: ModelConfig, layer: int, parallel: ModelParallel | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.checkpointing = config.activation_checkpointing
        self.offloads, self.layer_index = config.activation_offload != "none", layer
        self.num_layers = config.num_layers
        self.attention_norm = rms_norm(config.hidden_size, config.norm_eps, config.norm, dtype, device)
        self.attention = Attention(config, layer, parallel, dtype=dtype, device=device)
        self.mlp_norm = rms_norm(config.hidden_size, config.norm_eps, config.norm, dtype, device)
        self.mlp = MLP(config, layer, parallel.tp_group if parallel else None, dtype=dtype, device=device,
                       sequence_parallel=parallel is not None and parallel.sequence_parallel)
        # the TP group the norms' weight gradients are summed over (sequence parallelism), else None
        self.norm_group = parallel.tp_group if parallel is not None and parallel.sequence_parallel else None

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm(x) if self.norm_group is None else sequence_parallel_norm(norm, x, self.norm_group)

    def _forward(self, x: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        x = x + self.attention(self._norm(self.attention_norm, x), inputs.cos, inputs.sin, inputs)
        return x + self.mlp(self._norm(self.mlp_norm, x))

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.attention.project(self._norm(self.attention_norm, x), cos, sin)

    def _after_attention(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        x = x + self.attention.output(out)
        return x + self.mlp(self._norm(self.mlp_norm, x))

    def _selective(self, x: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """Checkpoints around the attention: the norms, projections, RoPE and MLP are recomputed in the
        backward, the CP attention (and its communication) is not: it keeps q, k, v, its output and lse."""
        q, k, v = checkpoint(self._project, x, inputs.cos, inputs.sin, use_reentrant=False)
        out = self.attention.attend(q, k, v, inputs)
        return checkpoint(self._after_attention, x, out, use_reentrant=False)

    def _checkpointed(self, x: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        if self.checkpointing == "none" or not torch.is_grad_enabled():
            return self._forward(x, inputs)
        if self.checkpointing == "selective":
            return self._selective(x, inputs)
        return checkpoint(self._forward, x, inputs, use_reentrant=False)

    def compile_forward(self, fullgraph: bool = True) -> None:
        """``torch.compile`` the block's computation with its activation checkpoint (traced: the compiler
        recomputes the block in the backward); its hooks (FSDP2) stay outside."""
        self._checkpointed = torch.compile(self._checkpointed, fullgraph=fullgraph)

    def forward(self, x: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """``inputs``: the RoPE tables and the attention handle of this forward (``BlockInputs``); with activation
        offload, the forward's ``ActivationOffload`` is made on it by the first block (a new one when this block
        ran under it already: ``inputs`` reused for another forward)."""
        if not (self.offloads and torch.is_grad_enabled()):
            return self._checkpointed(x, inputs)
        if inputs.offload is None or inputs.offload.has_run(self.layer_index):
            inputs.offload = ActivationOffload(self.num_layers, x.device)
        with inputs.offload.layer(self.layer_index, self, shared=(inputs.cos, inputs.sin)):
            return self._checkpointed(x, inputs)
