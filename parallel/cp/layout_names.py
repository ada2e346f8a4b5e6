"""The CP layouts' names and the check that a sequence length splits over the CP ranks in one (``layout.py``
describes each layout): what the config reads, without torch."""

from __future__ import annotations

from typing import Literal

Layout = Literal["contiguous", "zigzag", "stripe", "balanced"]
STATIC_LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag", "stripe")  # positions fixed by (rank, world, length)
LAYOUTS: tuple[str, ...] = (*STATIC_LAYOUTS, "balanced")


def check_layout_name(layout: str) -> None:
    """Raise ``ValueError`` listing the layouts unless ``layout`` is one of them."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CP layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def check_layout(seqlen: int, world: int, layout: str, what: str = "sequence length") -> None:
    """Raise ``ValueError`` (saying what to change) unless ``layout`` is known and ``seqlen`` splits evenly over
    ``world`` ranks.

    ``what`` names the length in the message (a config key, say).
    """
    check_layout_name(layout)
    if world < 1:
        raise ValueError(f"CP size must be >= 1, got {world}")
    parts = 2 * world if layout == "zigzag" else world
    need = "2*cp" if layout == "zigzag" else "cp"
    if seqlen < parts:
        raise ValueError(f"{what} {seqlen} is shorter than {need} = {parts} for the {layout} layout at "
                         f"cp={world}; use a longer sequence or a smaller cp")
    if seqlen % parts != 0:
        raise ValueError(f"{what} {seqlen} is not divisible by {need} = {parts} for the {layout} layout at "
                         f"cp={world}; use a sequence length that is a multiple of {parts}")
