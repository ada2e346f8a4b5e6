"""CP attention as one PyTorch operator, so that ``torch.compile`` traces a block without a graph break.

    handle = plan_handle(groups, spec, plan)       # once per forward, outside compiled code (a CPU tensor)
    out = cp_attention(q, k, v, handle)            # in every layer: ``torch.ops.cp_train.attention``

``torch.ops.cp_train.attention(q, k, v, handle, sinks=None) -> (out, lse, ticket)`` runs the autograd Function of
``spec.algorithm`` (``attention.attention_call``) as plain code: its collectives, index tensors and Python
control flow stay inside the operator, which the compiler sees as one node with a fake implementation
(shapes only). The compiled graph holds tensors alone: a new plan (other document boundaries) is a new
value of the same ``handle`` tensor, never a recompile.

* ``handle``: an int64 scalar on the CPU naming the ``(groups, spec, plan)`` registered by ``plan_handle``;
  the registration lives as long as the handle tensor does (autograd keeps it while a backward or a
  checkpoint recompute may need it). Reading a CPU scalar is no device sync.
* ``ticket``: an int64 scalar on the CPU naming what the Function saved for its backward (its ``ctx``) but
  q, k, v, out and lse, which autograd saves (a compiled graph may reuse the memory of tensors it sees as
  dead); ``torch.ops.cp_train.attention_backward(dout, q, k, v, out, lse, ticket)`` runs the backward; it returns
  ``(dq, dk, dv, dsinks)``, dsinks empty without sinks.
  The saved state lives as long as the ticket tensor: until the backward ran and autograd freed it, or at
  once when nothing will run a backward (evaluation, a checkpointed forward that is recomputed later).

out ``[B, n, H, D]`` in q's dtype and lse ``[B, H, n]`` (fp32; fp64 for fp64 inputs; not differentiable) are
contiguous, as the fake implementation says.

``torch.utils.flop_counter`` (and the profilers built on it) counts both operators by the model FLOPs convention
(``model/family.py``): ``4 * pairs * heads * head_dim`` forward over the visible query-key pairs of this rank's
queries (the plan's; every pair of one causal document without a plan), twice that backward.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from cp_train.parallel.cp.attention import attention_call
from cp_train.parallel.cp.plan.batch_plan import CPPlan
from cp_train.parallel.cp.ring.forward import accumulator_dtype
from cp_train.parallel.cp.spec import AttentionSpec
from cp_train.parallel.mesh.model_parallel import CPGroups

_PLANS: dict[int, tuple[CPGroups, AttentionSpec, CPPlan | None]] = {}
_SAVED: dict[int, _SavedCall] = {}
_KEYS = itertools.count(1)


class _SavedCall:
    """What an autograd Function's ``forward`` records on its ``ctx``, kept for its ``backward`` (run by hand),
    and the forward's FLOPs (``flops``)."""

    saved_tensors: tuple[torch.Tensor, ...] = ()
    flops: int = 0

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass


def _register(table: dict[int, Any], value: Any) -> torch.Tensor:
    """A CPU int64 scalar naming ``value`` in ``table`` for as long as the scalar lives."""
    key = next(_KEYS)
    table[key] = value
    name = torch.tensor(key, dtype=torch.int64)
    weakref.finalize(name, table.pop, key, None)
    return name


def _lookup(table: dict[int, Any], name: torch.Tensor) -> Any:
    return table[int(name.numpy())]  # a CPU scalar by contract: no device sync


def plan_handle(groups: CPGroups, spec: AttentionSpec, plan: CPPlan | None) -> torch.Tensor:
    """The handle of one forward's attention (every layer's): an int64 CPU scalar naming these three."""
    return _register(_PLANS, (groups, spec, plan))


def handle_contents(handle: torch.Tensor) -> tuple[CPGroups, AttentionSpec, CPPlan | None]:
    """What ``handle`` names (``plan_handle``'s arguments)."""
    return _lookup(_PLANS, handle)


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _refer_to_visible(call: _SavedCall, visible: tuple[torch.Tensor, ...]) -> None:
    """Keep no reference to the operator's inputs or outputs in ``call``: a compiled graph may reuse their
    memory once it is done with them (it does not know the stash holds them). Each saved tensor that is one of
    ``visible`` (or a contiguous reshape of one) is replaced by its index there; autograd saves ``visible``
    (``_setup_context``) and the backward puts them back. Any other alias of them is copied."""
    slots: list[torch.Tensor | tuple[int, torch.Size]] = []
    for saved in call.saved_tensors:
        slot: torch.Tensor | tuple[int, torch.Size] = saved
        for index, tensor in enumerate(visible):
            if saved is tensor:
                slot = (index, saved.shape)
            elif _share_memory(saved, tensor):
                same = (saved.is_contiguous() and tensor.is_contiguous() and saved.numel() == tensor.numel()
                        and saved.storage_offset() == tensor.storage_offset())
                slot = (index, saved.shape) if same else saved.clone()
            else:
                continue
            break
        slots.append(slot)
    call.saved_tensors, call.slots = (), slots


def _restore(call: _SavedCall, visible: tuple[torch.Tensor, ...]) -> None:
    call.saved_tensors = tuple(slot if isinstance(slot, torch.Tensor) else visible[slot[0]].view(slot[1])
                               for slot in call.slots)


@torch.library.custom_op("cp_train::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor,
               sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, spec, plan = handle_contents(handle)
    function, args = attention_call(q, k, v, groups, spec, plan, sinks)
    call = _SavedCall()
    out, lse = function.forward(call, *args)
    out, lse = out.contiguous(), lse.to(accumulator_dtype(q.dtype)).contiguous()
    _refer_to_visible(call, (q, k, v, out, lse))
    call.function, call.flops = function, forward_flops(q.shape, groups.rank, spec, plan)
    return out, lse, _register(_SAVED, call)


@_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor,
      sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, n, heads, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty(batch, heads, n, dtype=accumulator_dtype(q.dtype)),
            torch.empty((), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("cp_train::attention_backward", mutates_args=())
def _attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, ticket: torch.Tensor, sinks: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    call: _SavedCall = _lookup(_SAVED, ticket)
    visible = (q, k, v, out, lse)
    _restore(call, visible)
    grads = call.function.backward(call, dout, None)
    dq, dk, dv = grads[:3]
    call.saved_tensors = ()
    if dk.shape[2] != k.shape[2]:  # Ulysses repeated each kv head (``ulysses_call``): sum the copies' gradients
        dk, dv = (x.unflatten(2, (k.shape[2], -1)).sum(3) for x in (dk, dv))
    dsinks = grads[-1].to(sinks.dtype) if sinks is not None else q.new_empty(0)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), dsinks


@_attention_backward.register_fake
def _(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
      ticket: torch.Tensor, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                        torch.Tensor]:
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def forward_flops(shape: torch.Size, rank: int, spec: AttentionSpec, plan: CPPlan | None) -> int:
    """The forward's FLOPs of this rank's queries ``[B, n, H, D]``: ``4 * pairs * H * D`` over the plan's
    visible pairs (per head, per sample unless the plan is packed; Ulysses' count its share of the heads)."""
    batch, n, heads, dim = shape
    if plan is None:
        pairs = batch * (n * (n + 1) // 2 if spec.causal else n * n)
    else:
        pairs = plan.areas[rank] * (1 if plan.packed else batch)
    return 4 * pairs * heads * dim


@register_flop_formula(torch.ops.cp_train.attention, get_raw=True)
def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor, sinks: Any = None,
                     *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    groups, spec, plan = handle_contents(handle)
    return forward_flops(q.shape, groups.rank, spec, plan)


@register_flop_formula(torch.ops.cp_train.attention_backward, get_raw=True)
def _attention_backward_flops(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, ticket: torch.Tensor, *args: Any,
                              out_val: Any = None, **kwargs: Any) -> int:
    return 2 * _lookup(_SAVED, ticket).flops


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, _handle, sinks = inputs
    out, lse, ticket = output
    ctx.save_for_backward(q, k, v, out, lse, ticket, *(() if sinks is None else (sinks,)))
    ctx.has_sinks = sinks is not None


def _backward(ctx: Any, dout: torch.Tensor, _dlse: Any, _dticket: Any) -> tuple:
    saved = ctx.saved_tensors
    sinks = saved[6] if ctx.has_sinks else None
    dq, dk, dv, dsinks = torch.ops.cp_train.attention_backward(dout, *saved[:6], sinks)
    return dq, dk, dv, None, dsinks if ctx.has_sinks else None


_attention.register_autograd(_backward, setup_context=_setup_context)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """out ``[B, n, H, D]`` of q ``[B, n, H, D]``, k, v ``[B, n, Hk, D]`` with the attention named by ``handle``
    (``plan_handle``; the window is its plan's) and learned ``sinks`` ``[H]`` (None: none); differentiable in
    q, k, v and sinks."""
    return torch.ops.cp_train.attention(q, k, v, handle, sinks)[0]
