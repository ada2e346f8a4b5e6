"""Python's collector on the run's schedule (``cp_train/runtime/collector.py``)."""

from __future__ import annotations

import gc

import pytest

from cp_train.config.sources import ConfigError, load_config
from cp_train.config.validate import validate
from cp_train.runtime.collector import ScheduledCollection


def test_collection_runs_on_the_schedule_and_is_restored(monkeypatch) -> None:
    collected = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or real_collect(0))
    assert gc.isenabled()
    with ScheduledCollection(3) as collection:
        assert not gc.isenabled() and collected == [2]  # the build's garbage, then automatic collection off
        for step in range(1, 8):
            collection.after_step(step, first=step == 1)
        assert gc.get_freeze_count() > 0  # what the first step left alive is never scanned again
        assert collected == [2, 1, 1]  # steps 3 and 6, the young generations
    assert gc.isenabled() and gc.get_freeze_count() == 0


def _frozen(obj: object) -> bool:
    """Frozen objects sit in the permanent generation, which ``gc.get_objects()`` does not list."""
    return gc.is_tracked(obj) and not any(tracked is obj for tracked in gc.get_objects())


def test_a_process_that_froze_objects_keeps_its_freeze() -> None:
    """A spawned rank freezes its imports: the run neither freezes more nor thaws them at its end.

    The freeze count is compared as a bound, not for equality: a frozen object freed by its reference count
    (another test's thread finishing, say) leaves the permanent generation during the test."""
    imported = []
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with ScheduledCollection(2) as collection:
            kept = [[] for _ in range(100)]  # new objects the first step leaves alive
            collection.after_step(1, first=True)
            assert not _frozen(kept[0]) and gc.get_freeze_count() <= frozen and not gc.isenabled()
            collection.after_step(2, first=False)
        assert _frozen(imported) and not _frozen(kept[0]) and gc.isenabled()
    finally:
        gc.unfreeze()


def test_interval_zero_leaves_the_collector_alone(monkeypatch) -> None:
    collected = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation))
    with ScheduledCollection(0) as collection:
        assert gc.isenabled()
        for step in range(1, 5):
            collection.after_step(step, first=step == 1)
    assert collected == [] and gc.isenabled() and gc.get_freeze_count() == 0


def test_a_negative_interval_is_one_line() -> None:
    config = load_config(None, overrides=["train.gc_interval=-1"])
    with pytest.raises(ConfigError, match="train.gc_interval"):
        validate(config, 1)
