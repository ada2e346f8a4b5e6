"""A dispatch mode that counts the ops a piece of code issues, the project's custom ops' bodies included."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while active (``ops``): aten and c10d ops, and those inside the project's custom
    ops (the CP attention op's body runs under the mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        self.ops += 1
        if func.namespace == "cp_train":
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
