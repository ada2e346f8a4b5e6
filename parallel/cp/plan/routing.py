"""Which ring steps take their kernel shapes from the documents (``route_by_documents``), and the shapes a static
layout's steps have whatever the documents (``layout_shapes``): the dense shapes a run issues stay a handful, so a
kernel that builds a plan per shape (cuDNN's SDPA graphs) builds them in the first steps and never again."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, TypeVar

from cp_train.parallel.cp.plan.segments import Window


class _Step(Protocol):
    """What routing reads of a step (``rank_plan.StepPlan``, a frozen dataclass with ``by_documents``)."""

    @property
    def calls(self) -> list[Any]: ...

    @property
    def segments(self) -> tuple[Any, ...]: ...


Step = TypeVar("Step", bound=_Step)


def layout_shapes(rows: int) -> set[tuple[int, int]]:
    """The (query rows, keys) of the one call each ring step of one document makes in a static layout of
    ``rows`` local rows, whatever the world: a whole block, a zigzag half against a whole block (either way),
    stripe's diagonal one row short."""
    shapes = {(rows, rows), (rows - 1, rows - 1)}
    return shapes | {(rows // 2, rows), (rows, rows // 2)} if rows % 2 == 0 else shapes


def route_by_documents(steps: list[Step], rows: int, documents: bool, window: Window | None = None
                       ) -> tuple[Step, ...]:
    """``steps`` with ``by_documents`` set where the documents shape the calls: with more than one document
    (``documents``), a step is anything but one dense call of a layout shape (``layout_shapes``). Such a step
    runs as one varlen call per mask kind on a kernel that has them (``ring/forward.py``), so the dense shapes a
    run issues stay a handful whatever its documents (a cuDNN graph is built per dense shape). With a sliding
    ``window``, steps with inverted triangles stay dense calls (they run on reversed rows); without one, a
    sliding run is a stretch of one-key rows (one-token documents), which a varlen call takes row by row."""
    if not documents:
        return tuple(steps)
    shapes = layout_shapes(rows)

    def routed(step: Step) -> bool:
        calls = step.calls
        if not calls or (window is not None and any(segment.slide for segment in step.segments)):
            return False
        return len(calls) > 1 or (calls[0].segment.rows, calls[0].segment.keys) not in shapes

    return tuple(dataclasses.replace(step, by_documents=routed(step)) for step in steps)
