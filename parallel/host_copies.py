"""The CUDA side of activation offload (``parallel/offload.py``): copies between the compute device and pinned host
memory on one side stream per device, and the events that order them against the compute stream.

Ordering rules (the only ones the offload relies on):
- a copy out waits for the compute stream's queued work (which produces its source); its source must stay alive
  until the compute stream has waited on an event recorded after the copy (``mark`` then ``wait``), so the memory
  returns to the compute stream's pool only once the copy read it. No ``record_stream``: with it the allocator
  reuses the block only when a host-side query finds the copy done, so a host running ahead of the GPU keeps
  growing the pool instead of reusing offloaded memory.
- a copy in is written into memory allocated on the compute stream, after the compute stream's queued work; the
  compute stream waits on its event before any use, and before the memory is freed unread (``_Copy.__del__``).
- copies out and in run on one stream, in order: a copy in of a host buffer never overtakes its copy out.

``Copier`` is the interface; a CPU stand-in implements it in the tests to check these rules without a GPU.
"""

from __future__ import annotations

from typing import Protocol

import torch

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device`` (CUDA) that every offload and fetch copy runs on, made once."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device=device)
    return _STREAMS[device]


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory span without gaps or overlaps (in any order of dimensions)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda pair: pair[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


class Copier(Protocol):
    """Asynchronous copies between one device and the host, ordered by events (see the module docstring)."""

    def copy_out(self, source: torch.Tensor) -> torch.Tensor:
        """A host copy of ``source`` (dense; started after the compute stream's queued work, not finished)."""

    def copy_in(self, host: torch.Tensor) -> tuple[torch.Tensor, object]:
        """A device copy of ``host`` (allocated on the compute stream) and the event that says it is written."""

    def mark(self) -> object:
        """An event after every copy started so far."""

    def wait(self, event: object) -> None:
        """The compute stream waits for ``event`` (the host does not)."""

    def done(self, event: object) -> bool:
        """Whether ``event`` has completed (a query; never blocks)."""


class CudaCopier:
    """``Copier`` on a CUDA device: pinned host memory, ``non_blocking`` copies on ``copy_stream(device)``."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.side = device, copy_stream(device)

    def _after_compute(self) -> None:
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    def copy_out(self, source: torch.Tensor) -> torch.Tensor:
        host = torch.empty_like(source, device="cpu", pin_memory=True)
        self._after_compute()  # the source is produced by the queued work
        with torch.cuda.stream(self.side):
            host.copy_(source, non_blocking=True)
        return host

    def copy_in(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        device = torch.empty_like(host, device=self.device)
        self._after_compute()  # the memory may still be in the queued work's use
        with torch.cuda.stream(self.side):
            device.copy_(host, non_blocking=True)
        return device, self.mark()

    def mark(self) -> torch.cuda.Event:
        return self.side.record_event()

    def wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def done(self, event: torch.cuda.Event) -> bool:
        return event.query()
