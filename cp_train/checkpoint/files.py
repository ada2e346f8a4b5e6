"""The files of a checkpoint directory: which checkpoint to resume from, whether it is complete, pruning.

A checkpoint ``ROOT/step_XXXXXXXX/`` is complete when its ``meta.json`` parses, its DCP ``.metadata``
loads, and every shard file ``.metadata`` refers to exists and is long enough. ``ROOT/latest`` names the
newest complete checkpoint (it moves only after a save finished). A checkpoint that verifies is complete
and every file matches its checksum in ``manifest.json`` (``integrity.py``; the ranks of a run share the
reading). Every problem is an ``InputError`` naming the file and the ``--load`` of the newest checkpoint that
verifies; RNG files are optional (a missing one means the RNG is re-derived, see
``checkpoint.load_checkpoint``).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from cp_train.checkpoint.integrity import ChecksumMismatch, verify_files
from cp_train.errors import InputError

LATEST = "latest"
META = "meta.json"
DCP_METADATA = ".metadata"
META_KEYS = ("step", "consumed_samples", "layout", "config")
STEP_DIR = re.compile(r"step_(\d{8})")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_dirs(root: Path) -> list[Path]:
    """``root``'s ``step_XXXXXXXX`` directories, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name))


def read_meta(path: Path) -> dict[str, Any]:
    """``path/meta.json``; InputError naming the file when it is missing, truncated or lacks a key."""
    meta_file = path / META
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError:
        raise InputError(f"{meta_file} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise InputError(f"{meta_file} is truncated or damaged (not valid JSON)") from None
    missing = [key for key in META_KEYS if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise InputError(f"{meta_file} lacks {', '.join(missing)}")
    return meta


def check_shards(path: Path) -> None:
    """InputError naming the file unless ``.metadata`` loads and every shard it refers to is all there."""
    metadata_file = path / DCP_METADATA
    if not metadata_file.is_file():
        raise InputError(f"{metadata_file} is missing")
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as error:
        raise InputError(f"{metadata_file} is truncated or damaged ({type(error).__name__})") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise InputError(f"shard {shard} is missing")
        actual = shard.stat().st_size
        if actual < size:
            raise InputError(f"shard {shard} is truncated ({actual} bytes, {DCP_METADATA} needs {size})")


Share = tuple[int, int] | None  # (rank, world): verify this rank's share of the checksums; None: all of them


def check_complete(path: Path, share: Share = None, verify: bool = True) -> dict[str, Any]:
    """``path``'s meta when ``path`` is a complete checkpoint whose files match their checksums (``verify``;
    ``share``: only this rank's part of them); InputError naming the first problem."""
    meta = read_meta(path)
    check_shards(path)
    if verify:
        verify_files(path, rank=share[0] if share else 0, world=share[1] if share else 1)
    return meta


def is_complete(path: Path, verify: bool = True) -> bool:
    try:
        check_complete(path, verify=verify)
    except InputError:
        return False
    return True


def newest_complete(root: Path, before: Path | None = None, verify: bool = True) -> Path | None:
    """The newest complete checkpoint in ``root`` that verifies (``verify``; older than ``before`` when
    given), or None."""
    for path in reversed(step_dirs(root)):
        if (before is None or path.name < before.name) and is_complete(path, verify):
            return path
    return None


def _kind(error: InputError) -> str:
    return "a damaged checkpoint" if isinstance(error, ChecksumMismatch) else "an incomplete checkpoint"


RESUME_FROM = "resume from the newest complete checkpoint with --load {}"


def _instead(root: Path, broken: Path | None = None, use: str = RESUME_FROM) -> str:
    """What to do when a checkpoint of ``root`` cannot be used: ``use`` filled with the newest complete one."""
    good = newest_complete(root, before=broken) or newest_complete(root)
    if good is not None and good != broken:
        return use.format(good)
    return f"no complete checkpoint is left in {root}: start afresh (delete {root / LATEST} or use another --save)"


def _is_checkpoint_dir(path: Path) -> bool:
    return STEP_DIR.fullmatch(path.name) is not None or (path / META).exists() or (path / DCP_METADATA).exists()


def check_save_root(save: str) -> None:
    """InputError when ``save`` (checkpoint.save) is one checkpoint (a ``step_XXXXXXXX`` directory, or one holding
    its files) rather than the directory of a run's checkpoints: the run would nest its checkpoints in it."""
    path = Path(save)
    if _is_checkpoint_dir(path):
        raise InputError(f"checkpoint.save (--save) {save} is a checkpoint ({path.name}), not a directory of "
                         f"checkpoints: pass its parent, --save {path.parent}, to continue that run, or another "
                         f"directory (with --load {save} to start from this checkpoint)")


def find_checkpoint(path: str | os.PathLike, use: str = RESUME_FROM, share: Share = None,
                    verify: bool = True) -> Path | None:
    """The complete checkpoint ``path`` names: ``path`` itself when it is one checkpoint directory, else
    ``path/latest``'s target; None when ``path`` holds none yet. InputError naming the file when the
    checkpoint named is incomplete or damaged, and what to do (``use`` filled with the newest complete one).
    ``share``: (rank, world), this rank verifies its share of the checksums (see ``check_complete``); none
    when not ``verify``."""
    given = Path(path)
    if _is_checkpoint_dir(given):
        try:
            check_complete(given, share, verify)
        except InputError as error:
            instead = _instead(given.parent, given, use)
            state = "damaged" if isinstance(error, ChecksumMismatch) else "incomplete"
            raise InputError(f"checkpoint {given} is {state}: {error}; {instead}") from None
        return given
    pointer = given / LATEST
    if not pointer.is_file():
        return None
    name = latest_name(given)
    if not name:  # blank, or not text: it names no checkpoint (``given / ""`` would be ``given`` itself)
        raise InputError(f"{pointer} is empty or damaged: it names no checkpoint; {_instead(given, None, use)}")
    target = given / name
    try:
        if not target.is_dir():
            raise InputError(f"{target} does not exist")
        check_complete(target, share, verify)
    except InputError as error:
        raise InputError(f"{pointer} names {name}, {_kind(error)}: {error}; "
                         f"{_instead(given, target, use)}") from None
    return target


def resume_source(load: str | None, save: str | None, share: Share = None) -> Path | None:
    """The checkpoint a run resumes from: ``load`` (checkpoint.load: a directory with ``latest``, or one
    checkpoint), else ``save``'s ``latest`` (auto-resume; None: off), else None. InputError naming the path.
    ``share``: (rank, world) of this rank, which verifies its share of the checksums."""
    if load:
        if not Path(load).exists():
            raise InputError(f"checkpoint.load (--load) {load} does not exist")
        found = find_checkpoint(load, share=share)
        if found is None:
            newest = newest_complete(Path(load))
            hint = f"; its newest complete checkpoint is {newest}: --load {newest}" if newest else ""
            raise InputError(f"checkpoint.load (--load) {load} holds no checkpoint (no `latest`, no {META}){hint}")
        return found
    if not save:
        return None
    found = find_checkpoint(save, share=share)
    newest = newest_complete(Path(save)) if found is None and Path(save).is_dir() else None
    if newest is not None:  # starting afresh would mix two runs in one directory and prune the good checkpoint
        raise InputError(f"checkpoint.save (--save) {save} holds checkpoints but no `latest`: resume from the newest "
                         f"complete one with --load {newest}, or start a new run with another --save")
    return found


def resume_hint(save: str | None, resumed_from: Path | None) -> str:
    """Where to resume from after a failure: the newest complete checkpoint in ``save``, else the one the run
    started from."""
    last = (newest_complete(Path(save)) if save else None) or resumed_from
    if last is None:
        return "no checkpoint was saved (set --save and --save-interval to keep some)"
    return f"the last checkpoint is {last}: resume from it with --load {last}"


def latest_name(root: Path) -> str | None:
    """The checkpoint ``root/latest`` names; None when it is missing, blank or not text."""
    try:
        return (root / LATEST).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def prune(root: Path, keep: int) -> list[Path]:
    """Delete the step directories of ``root`` older than its newest ``keep`` complete checkpoints (complete
    or not; ``keep`` 0: none). Directories newer than the newest complete one are left alone. Returns the
    deleted ones."""
    if keep <= 0:
        return []
    complete = [p for p in step_dirs(root) if is_complete(p, verify=False)]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    doomed = [p for p in step_dirs(root) if p.name < oldest_kept.name]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
