"""Activation offload to host memory (``model.activation_offload``): what a block saves for its backward is copied
to host memory as soon as autograd saves it and comes back one layer ahead of the backward.

    offload = ActivationOffload(num_layers, device)     # one per forward (``model/block.py`` makes it)
    with offload.layer(index, block, shared=(cos, sin)):
        y = block_forward(x)                             # its saved tensors go to the host

The mechanism is ``torch.autograd.graph.saved_tensors_hooks`` around each block's forward, so it sees exactly what
autograd keeps outside the activation checkpoints: under ``full`` checkpointing the block input (the checkpoint
saves its inputs through the ambient hooks), under ``selective`` the block input and the CP attention's q, k, v,
output and lse (the operator's autograd saves them), without checkpointing every saved activation; a compiled
block's saved tensors alike. Tensors saved twice in one layer (the block input under ``selective``) are copied once.

Left where they are (packed as themselves): parameters (any tensor sharing a parameter's storage: FSDP2's
gathered weights, their views; autocast's casts of them), the ``shared`` tensors of every layer (the RoPE
tables), tensor subclasses (DTensor, float8), scalars (the attention's ticket: its identity names its saved
state), empty tensors (torch 2.11's checkpoint saves one per call), tensors under ``MIN_OFFLOAD_BYTES``, tensors
off the compute device, and everything the last ``keep_last`` blocks save: the backward needs them at once. What
the CP attention keeps inside its operator beyond q, k, v, out and lse (Ulysses' sequence-ordered copies) is not
a saved tensor and stays on the device.

Copies. CUDA: pinned host memory and one side stream per device, ordered by events (``parallel/host_copies.py``
states the rules); a layer's device tensors are released once the compute stream waited for their copies, at most
``MAX_LAYERS_IN_FLIGHT`` layers pending beyond the running one and none after the last offloaded one. A saved
view that is not dense goes out (and comes back) dense. CPU: a plain copy into a separate host tensor, so the
mechanism runs (and is tested) without a GPU; it moves nothing between memories there.

Prefetch. The first unpack of layer i's tensors (its backward starting: the checkpoint's recompute, or the first
node that reads a saved tensor) fetches layer i if it is not on the device yet and starts fetching layers i-1 ...
i-``prefetch``; on CUDA on the side stream after the compute stream's queued work, the unpack waiting for its
copy's event, so layer i-1 travels while layer i's backward computes. Each fetched copy is dropped by the offload
once every pack of it was unpacked (its host copy too), and freed when autograd releases it: at most
``1 + prefetch`` layers' copies are on the device at once (``OffloadStats.peak_layers`` counts them as their
storages live and die).

Exact: the copies are bit copies, so losses and gradients are bitwise those without offload. One backward per
forward: reading a saved tensor again after its backward (``retain_graph``) is a ``RuntimeError``. The hooks
turn off autograd's check that a saved tensor was not changed in place; a block that changes an offloaded tensor
in place before it ends is a ``RuntimeError`` here instead.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from cp_train.parallel.host_copies import Copier, CudaCopier, dense

MIN_OFFLOAD_BYTES = 1024  # smaller saved tensors stay on the device (scalars, tickets): not worth a copy
PREFETCH_LAYERS = 1  # layers fetched ahead of the backward
KEEP_LAST_LAYERS = 1  # the last blocks' saved tensors stay: the backward starts with them
MAX_LAYERS_IN_FLIGHT = 1  # layers whose copies out may be pending beyond the one running (CUDA)

_OBSERVERS: list[list[OffloadStats]] = []


@dataclass
class OffloadStats:
    """What one forward's offload did (read by tests and ``bench/offload.py``)."""

    packed: int = 0  # tensors the blocks saved for the backward (pack hook calls)
    offloaded: int = 0  # host copies made (a tensor saved twice in a layer: one copy)
    kept: int = 0  # packs left on the device (parameters, shared tables, small, other devices, the last blocks)
    host_bytes: int = 0  # bytes of the host copies
    fetched: int = 0  # host copies brought back to the device
    fetched_late: int = 0  # of them, fetched at their unpack instead of ahead of it
    peak_layers: int = 0  # most layers with fetched copies alive on the device at once
    peak_device_bytes: int = 0  # most bytes of fetched copies alive on the device at once


@contextlib.contextmanager
def observe() -> Iterator[list[OffloadStats]]:
    """Collect the ``OffloadStats`` of every ``ActivationOffload`` made inside the block (one per forward)."""
    seen: list[OffloadStats] = []
    _OBSERVERS.append(seen)
    try:
        yield seen
    finally:
        _OBSERVERS.remove(seen)


class _Kept:
    """A saved tensor left in place: detached when it has a ``grad_fn`` (a pack must not hold its input, or the
    node that saved it and the tensor keep each other alive), else itself (a CPU handle's identity names what it
    registered: ``parallel/cp/op.py``'s ticket)."""

    __slots__ = ("layer", "tensor")

    def __init__(self, layer: int, tensor: torch.Tensor) -> None:
        self.layer, self.tensor = layer, tensor if tensor.grad_fn is None else tensor.detach()


class _Copy:
    """An offloaded tensor: until every pack of it is unpacked its host copy and, from its fetch, its device copy
    (``ready``: the fetch's event, from ``copier``)."""

    __slots__ = ("layer", "host", "device", "ready", "pending", "nbytes", "copier")

    def __init__(self, layer: int, host: torch.Tensor, nbytes: int, copier: Copier | None) -> None:
        self.layer, self.nbytes, self.copier = layer, nbytes, copier
        self.host: torch.Tensor | None = host
        self.device: torch.Tensor | None = None
        self.ready: object | None = None
        self.pending = 1  # packs of it not unpacked yet

    def __del__(self) -> None:
        if self.ready is not None and self.device is not None:  # fetched, never read (a failed backward): its
            self.copier.wait(self.ready)  # memory returns to the compute stream's pool only after the copy wrote it


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _uncount(owner: weakref.ref, layer: int, nbytes: int) -> None:
    """A fetched copy's storage died: ``nbytes`` fewer on ``layer`` (a weak reference, so that a copy fetched and
    never read does not keep its ``ActivationOffload`` alive through the finalizer)."""
    run = owner()
    if run is not None:
        run._count(layer, -nbytes)


def _cast_of_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is autocast's copy of a parameter (kept in autocast's cache for the forward anyway)."""
    fn = t.grad_fn
    return fn is not None and fn.name() == "ToCopyBackward0" and any(
        type(node).__name__ == "AccumulateGrad" for node, _ in fn.next_functions if node is not None)


def _storages(tensors: Sequence[torch.Tensor]) -> set[int]:
    """The storage addresses of ``tensors`` that have one of their own (a DTensor shard's wrapper has none)."""
    found = set()
    for t in tensors:
        try:
            found.add(_storage(t))
        except (RuntimeError, NotImplementedError):
            continue
    return found


class ActivationOffload:
    """One forward's offloaded activations on ``device`` (the blocks' compute device) for ``num_layers`` blocks;
    see the module docstring. ``keep_last``: the last blocks whose tensors stay; ``prefetch``: layers fetched
    ahead; ``min_bytes``: smaller tensors stay (default ``MIN_OFFLOAD_BYTES``); ``copier``: the asynchronous
    copies (default: ``CudaCopier`` on CUDA, plain copies on the CPU)."""

    def __init__(self, num_layers: int, device: torch.device | str, keep_last: int = KEEP_LAST_LAYERS,
                 prefetch: int = PREFETCH_LAYERS, min_bytes: int | None = None, copier: Copier | None = None) -> None:
        self.device = torch.device(device)
        self.copier = copier if copier is not None or self.device.type != "cuda" else CudaCopier(self.device)
        self.in_flight: deque[tuple[object, list[torch.Tensor]]] = deque()  # (event, sources) per layer, in order
        self.offloaded_below = num_layers - keep_last  # layers [0, this) offload
        self.prefetch = prefetch
        self.min_bytes = MIN_OFFLOAD_BYTES if min_bytes is None else min_bytes
        self.copies: dict[int, list[_Copy]] = {}
        self.forwarded: set[int] = set()
        self.reached: set[int] = set()
        self.resident: dict[int, int] = {}  # layer -> bytes of its fetched copies alive on the device
        self.stats = OffloadStats()
        for seen in _OBSERVERS:
            seen.append(self.stats)

    def has_run(self, layer: int) -> bool:
        """Whether layer ``layer`` ran its forward under this offload already (a new forward needs a new one)."""
        return layer in self.forwarded

    @contextlib.contextmanager
    def layer(self, index: int, module: nn.Module, shared: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        """Offload what block ``index`` (``module``, whose parameters stay) saves inside the block; ``shared``:
        tensors every layer saves (they stay)."""
        self.forwarded.add(index)
        keep = _storages((*module.parameters(), *shared))
        seen: dict[tuple, _Copy] = {}  # this layer's copies by view; their tensors held until the layer ends
        held: list[tuple[torch.Tensor, int]] = []  # (tensor, version): no storage reused while ``seen`` names it
        sources: list[torch.Tensor] = []  # what the pending copies read (CUDA): alive until they are done
        offloads = index < self.offloaded_below

        def pack(t: torch.Tensor) -> _Kept | _Copy:
            self.stats.packed += 1
            if not offloads or not self._movable(t, keep):
                self.stats.kept += 1
                return _Kept(index, t)
            key = (_storage(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            copy = seen.get(key)
            if copy is not None:
                copy.pending += 1
                return copy
            copy = seen[key] = self._copy_out(index, t, sources)
            held.append((t.detach(), t._version))
            self.copies.setdefault(index, []).append(copy)
            return copy

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
            if any(t._version != version for t, version in held):
                raise RuntimeError(f"activation offload: block {index} changed a tensor saved for its backward in "
                                   f"place after saving it (autograd would refuse it too): clone it first")
        finally:
            seen.clear()
            held.clear()
            if sources:
                self.in_flight.append((self.copier.mark(), sources))
            if self.in_flight:  # after the last offloaded block none stays pending (the head's forward is next)
                self._retire(MAX_LAYERS_IN_FLIGHT if offloads else 0)

    def _retire(self, keep: int) -> None:
        """Release the sources of the layers whose copies out are done, and of the oldest ones beyond ``keep``
        (the compute stream waiting for their copies first, so their memory is reused only after them)."""
        while self.in_flight and (len(self.in_flight) > keep or self.copier.done(self.in_flight[0][0])):
            event, sources = self.in_flight.popleft()
            self.copier.wait(event)
            sources.clear()

    def _movable(self, t: torch.Tensor, keep: set[int]) -> bool:
        return (type(t) is torch.Tensor and t.layout == torch.strided and t.device == self.device and t.dim() > 0
                and t.numel() > 0 and t.numel() * t.element_size() >= self.min_bytes and _storage(t) not in keep
                and not _cast_of_parameter(t))

    def _copy_out(self, layer: int, t: torch.Tensor, sources: list[torch.Tensor]) -> _Copy:
        """A host copy of ``t``; with a copier, what it reads is appended to ``sources`` (alive until it is done)."""
        nbytes = t.numel() * t.element_size()
        if self.copier is not None:
            source = t.detach() if dense(t) else t.contiguous()  # on the compute stream
            host = self.copier.copy_out(source)
            sources.append(source)
        else:
            host = torch.empty_like(t)
            host.copy_(t)
        self.stats.offloaded += 1
        self.stats.host_bytes += nbytes
        return _Copy(layer, host, nbytes, self.copier)

    def _fetch(self, copy: _Copy) -> None:
        """Start bringing ``copy`` back to the device (CUDA: on the side stream; CPU: a plain copy)."""
        if copy.device is not None or copy.host is None:  # fetched already, or released
            return
        if self.copier is not None:
            device, copy.ready = self.copier.copy_in(copy.host)
        else:
            device = torch.empty_like(copy.host)
            device.copy_(copy.host)
        copy.device = device
        self.stats.fetched += 1
        self._count(copy.layer, copy.nbytes)
        weakref.finalize(device.untyped_storage(), _uncount, weakref.ref(self), copy.layer, copy.nbytes)

    def _count(self, layer: int, nbytes: int) -> None:
        """Fetched copies of ``layer`` alive on the device: ``nbytes`` more (or fewer, when negative)."""
        left = self.resident.get(layer, 0) + nbytes
        if left > 0:
            self.resident[layer] = left
        else:
            self.resident.pop(layer, None)
        self.stats.peak_layers = max(self.stats.peak_layers, len(self.resident))
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, sum(self.resident.values()))

    def _reach(self, layer: int) -> None:
        """The backward reached ``layer``: bring it back if it is not yet, and start on the layers before it."""
        if layer in self.reached:
            return
        if not self.reached:  # the backward starts: every copy out is waited for, its source released
            self._retire(0)
        self.reached.add(layer)
        for copy in self.copies.get(layer, ()):
            if copy.device is None:
                self.stats.fetched_late += 1
                self._fetch(copy)
        for ahead in range(layer - 1, max(-1, layer - 1 - self.prefetch), -1):
            for copy in self.copies.get(ahead, ()):
                self._fetch(copy)

    def _unpack(self, packed: _Kept | _Copy) -> torch.Tensor:
        self._reach(packed.layer)
        if isinstance(packed, _Kept):
            return packed.tensor
        if packed.host is None:
            raise RuntimeError("activation offload: a saved tensor was read again after its backward released it "
                               "(a second backward through one forward): set model.activation_offload=none")
        if packed.device is None:
            self.stats.fetched_late += 1
            self._fetch(packed)
        device = packed.device
        if packed.ready is not None:
            self.copier.wait(packed.ready)
        packed.pending -= 1
        if packed.pending <= 0:  # every pack of it unpacked: autograd holds the device copy as long as it needs it
            packed.host, packed.device, packed.ready = None, None, None
        return device
