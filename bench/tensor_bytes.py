"""The peak bytes of live tensor storage in one process, counted op by op (what ``bench/dry_run_check.py`` measures).

RSS cannot see a few MB of tensors under the ~400 MB of the Python and torch runtime, so ``LiveTensorBytes``
counts storages instead: a ``TorchDispatchMode`` that records every op output's untyped storage (once per
storage, at its byte size) and subtracts it when the storage is freed (a ``weakref.finalize``: torch keeps one
Python object per live storage). Storages resized in place (FSDP2 frees and re-allocates its gathered
parameters with ``UntypedStorage.resize_``) are re-counted at their new size. ``track`` adds tensors that
exist before the mode starts (parameters, gradients, optimizer state); DTensors count their local shard.

Counted: every tensor an aten, c10d or FSDP op returns or fills (a collective's output is allocated by the
caller), and those made inside the project's custom operators (the CP attention op runs its body under the
mode). Not counted: buffers a process-group backend allocates in C++ for itself (gloo's staging copies, NCCL's
channels: the dry run's reserve), allocator rounding and fragmentation.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

TRACED_NAMESPACES = ("cp_train",)  # custom ops whose bodies allocate: run under the mode (see __torch_dispatch__)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding the storage: a DTensor's local shard, else ``tensor``."""
    return getattr(tensor, "_local_tensor", tensor)


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live CPU tensor storages while active: ``current``, and ``peak`` since the last
    ``new_phase`` (``peaks`` keeps each finished phase's peak by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage key (its C++ address) -> bytes counted
        self.current = self.peak = 0
        self.peaks: dict[str, int] = {}
        self._phase = "start"
        self._resize: Callable[..., Any] | None = None
        self._depth = 0  # nested entries: the CP attention op's body re-enters the mode
        self._lock = threading.RLock()  # storages may be freed on a process group's threads (or in a GC pass)

    # ------------------------------------------------------------------ counting
    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count the storages of ``tensors`` (None skipped; each storage once, while it lives)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._add(_local(tensor))

    def _add(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu" or tensor.is_sparse or type(tensor).__name__ == "FakeTensor":
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without its own storage
            return
        self._count(storage)

    def _count(self, storage: torch.UntypedStorage, size: int | None = None) -> None:
        key = storage._cdata
        if key in self.sizes:
            return
        self.sizes[key] = storage.nbytes() if size is None else size
        weakref.finalize(storage, self._free, key)
        self._grow(self.sizes[key])

    def _free(self, key: int) -> None:
        with self._lock:
            self.current -= self.sizes.pop(key, 0)

    def _grow(self, nbytes: int) -> None:
        with self._lock:
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def new_phase(self, name: str) -> None:
        """Close the current phase (its peak into ``peaks``) and start ``name`` from the current bytes."""
        self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), self.peak)
        self._phase, self.peak = name, self.current

    @property
    def overall_peak(self) -> int:
        """The largest count of any phase so far, the current one included."""
        return max([self.peak, *self.peaks.values()])

    # ------------------------------------------------------------------ the mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func.namespace in TRACED_NAMESPACES:  # run the body under this mode (inside it the mode is popped)
            with self:
                out = func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
        else:
            out = func(*args, **kwargs)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._add(_local(leaf))
        if func._schema.is_mutable:  # in-place ops and collectives write into storages the caller made
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    self._add(_local(leaf))
        return out

    def __enter__(self) -> LiveTensorBytes:
        self._depth += 1
        if self._resize is None:  # FSDP2 frees and re-allocates its unsharded parameters in place
            self._resize = original = torch.UntypedStorage.resize_
            tracker = self

            def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                key = storage._cdata
                if key not in tracker.sizes:
                    tracker._count(storage)
                out = original(storage, size)
                tracker._grow(storage.nbytes() - tracker.sizes[key])
                tracker.sizes[key] = storage.nbytes()
                return out

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._depth -= 1
        if self._resize is not None and self._depth == 0:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
            self._resize = None
