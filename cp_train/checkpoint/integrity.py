"""Checksums of a checkpoint's files: computed over the bytes as they are written, kept in ``manifest.json``,
verified before a load (each rank its share of the files) and offline by ``cp-train-verify``.

``manifest.json`` lists every file of the checkpoint (DCP's shards and ``.metadata``, the RNG files,
``meta.json``) with its length and digest (xxHash's XXH3-64 where ``xxhash`` is installed, as it is with
wandb, else zlib's CRC-32; the manifest names the algorithm), and a digest of the list itself. It is written
in one canonical form, so a changed byte anywhere in it is caught too: it stops parsing, no longer reads back
in that form, or no longer matches its own digest.

The save hashes the shards while DCP writes them (``HashingFileSystem``): no second pass over the bytes, and
a large write is hashed while the file system copies it.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
import zlib
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from cp_train.errors import InputError

MANIFEST = "manifest.json"
CHUNK = 8 << 20  # bytes hashed at a time when reading a file back


class ChecksumMismatch(InputError):
    """A file of a checkpoint whose bytes are not the ones saved (a damaged checkpoint)."""


class _Crc32:
    """zlib's CRC-32 with hashlib's ``update`` / ``hexdigest``."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _hashers() -> dict[str, Callable[[], Any]]:
    found: dict[str, Callable[[], Any]] = {"crc32": _Crc32}
    try:
        import xxhash

        found["xxh3_64"] = xxhash.xxh3_64
    except ImportError:
        pass
    return found


HASHERS = _hashers()
ALGORITHM = "xxh3_64" if "xxh3_64" in HASHERS else "crc32"  # what a save uses


def new_hasher(algorithm: str | None = None) -> Any:
    """A fresh hash object of ``algorithm`` (default ``ALGORITHM``); InputError naming the package when it is not
    installed."""
    algorithm = algorithm or ALGORITHM
    if algorithm not in HASHERS:
        package = {"xxh3_64": "xxhash"}.get(algorithm, algorithm)
        raise InputError(f"the checkpoint's checksums are {algorithm}, which needs the Python package {package}: "
                         f"pip install {package}")
    return HASHERS[algorithm]()


def file_digest(path: Path, algorithm: str | None = None) -> tuple[int, str]:
    """(length, digest) of the file ``path``."""
    hasher, size = new_hasher(algorithm), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return size, hasher.hexdigest()


class _HashingStream(io.RawIOBase):
    """A file opened for writing that hashes every byte written to it (DCP writes its shards sequentially). A
    large write is hashed on a helper thread while the file system copies it (the write releases the GIL), and
    waited for before ``write`` returns: nothing outlives the caller's buffer. ``seconds``: the time the writes
    spent hashing beyond the copying (what the checksums cost)."""

    OVERLAP_BYTES = 4 << 20  # smaller writes are hashed in place (a hand-over costs about as much)

    def __init__(self, stream: Any, hasher: Any) -> None:
        super().__init__()
        self.stream, self.hasher, self.size, self.seconds = stream, hasher, 0, 0.0
        self._helper: ThreadPoolExecutor | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if len(memoryview(data)) < self.OVERLAP_BYTES:
            started = time.perf_counter()
            self.hasher.update(data)
            self.seconds += time.perf_counter() - started
            written = self.stream.write(data)
        else:
            self._helper = self._helper or ThreadPoolExecutor(1, thread_name_prefix="checksum")
            hashed = self._helper.submit(self.hasher.update, data)
            written = self.stream.write(data)
            started = time.perf_counter()
            hashed.result()
            self.seconds += time.perf_counter() - started
        self.size += written
        return written

    def tell(self) -> int:
        return self.stream.tell()

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def close(self) -> None:  # DCP closes its transform stream (this one) before it reads ``tell``
        pass

    def finish(self) -> None:
        if self._helper is not None:
            self._helper.shutdown()


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording the (length, digest) of every file written under its final name."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, tuple[int, str]] = {}
        self.hash_seconds = 0.0  # spent in the hash function (the bench reports it)
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            hashing = _HashingStream(stream, new_hasher())
            try:
                yield hashing  # type: ignore[misc]
            finally:
                hashing.finish()
        with self._lock:
            self.digests[Path(path).name] = (hashing.size, hashing.hasher.hexdigest())
            self.hash_seconds += hashing.seconds

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.digests:
                self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


def _body_digest(body: dict[str, Any]) -> str:
    hasher = new_hasher(body["algorithm"])
    hasher.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return hasher.hexdigest()


def _render(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def write_manifest(directory: Path, files: dict[str, tuple[int, str]]) -> None:
    """Write ``directory/manifest.json`` listing ``files`` ({relative path: (length, digest) by ``ALGORITHM``}),
    atomically."""
    body = {"algorithm": ALGORITHM, "files": {name: {"bytes": size, "digest": digest}
                                              for name, (size, digest) in sorted(files.items())}}
    partial = directory / f".{MANIFEST}.tmp{os.getpid()}"
    partial.write_text(_render({**body, "checksum": _body_digest(body)}))
    os.replace(partial, directory / MANIFEST)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest's ``{"algorithm", "files"}``; ChecksumMismatch naming the file when any byte of it changed."""
    path = directory / MANIFEST
    try:
        text = path.read_text()
        manifest = json.loads(text)
        body = {"algorithm": manifest["algorithm"], "files": manifest["files"]}
        intact = text == _render(manifest) and manifest["checksum"] == _body_digest(body)
    except FileNotFoundError:
        raise ChecksumMismatch(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        intact = False
    if not intact:
        raise ChecksumMismatch(f"{path} is damaged (it does not match its own checksum)")
    return body


def shares(files: dict[str, Any], world: int) -> list[list[str]]:
    """``files`` ({name: {"bytes": n, ...}}) split into ``world`` lists of about equal bytes (largest first)."""
    loads: list[list[str]] = [[] for _ in range(world)]
    totals = [0] * world
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        lightest = totals.index(min(totals))
        loads[lightest].append(name)
        totals[lightest] += files[name]["bytes"]
    return loads


def verify_files(directory: Path, names: Iterable[str] | None = None, rank: int = 0, world: int = 1) -> int:
    """Check the files of checkpoint ``directory`` against its manifest: ``names``, else this ``rank``'s share
    of all of them (of ``world``). ChecksumMismatch naming the first file whose bytes differ; returns the bytes
    read. A checkpoint saved before checksums (no manifest, and ``meta.json`` does not list one) passes."""
    if not (directory / MANIFEST).exists() and not _lists_manifest(directory):
        return 0
    manifest = read_manifest(directory)
    files = manifest["files"]
    todo = list(names) if names is not None else shares(files, world)[rank]
    checked = 0
    for name in sorted(todo):
        path = directory / name
        what = f"shard {path}" if name.endswith(".distcp") else str(path)
        expected = files[name]
        if not path.is_file():
            if name.startswith("rng/"):
                continue  # optional: the RNG is re-derived where a rank's file is missing (checkpoint.load_checkpoint)
            raise ChecksumMismatch(f"{what} is missing")
        size, digest = file_digest(path, manifest["algorithm"])
        checked += size
        if size != expected["bytes"] or digest != expected["digest"]:
            raise ChecksumMismatch(f"{what} does not match its checksum in {MANIFEST} ({manifest['algorithm']} "
                                   f"{digest}, saved {expected['digest']}): its bytes changed since the save")
    return checked


def _lists_manifest(directory: Path) -> bool:
    """Whether ``meta.json`` says the checkpoint was saved with a manifest (so a missing one is damage)."""
    try:
        return json.loads((directory / "meta.json").read_text()).get("checksums") == MANIFEST
    except (OSError, ValueError, AttributeError):
        return False
