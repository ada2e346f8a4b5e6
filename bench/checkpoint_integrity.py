"""What the checkpoint checksums cost: a DCP save with every shard hashed as it is written against the same
save without, and the offline verification's read-back.

    python -m bench.checkpoint_integrity [--cases 64:1 256:4 256:16] [--rounds 8]

One process saves a state dict of MiB:TENSOR_MIB (fp32 tensors of TENSOR_MIB each: a 2048 x 2048 weight is 16) with
``torch.distributed.checkpoint`` into a temporary directory (fsync on, as the trainer saves), alternating
``plain`` (DCP's FileSystemWriter) and ``checksummed`` (``cp_train.checkpoint.integrity.HashingFileSystem``:
the bytes hashed as written, plus the manifest) round by round, so drift on a shared machine hits both alike.
Prints JSON lines, then a table: the median save time of each, the overhead (``paired``: the median of
the per-round ratios minus 1) and ``hash share``: the time the checksummed save spent in the hash function
(timed around every hashed write; the median over the rounds) over that save's time, which a noisy machine
moves less than the difference of two saves (``hash_in_memory_share`` in the JSON: the same bytes hashed in
memory over the plain save's time). ``verify`` is
``cp-train-verify``'s read-back of the checkpoint (page cache warm). ``--algorithm crc32`` measures zlib's
CRC-32, the fallback without ``xxhash``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/checkpoint_integrity.py`

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from bench.common import emit  # noqa: E402
from cp_train.checkpoint import integrity  # noqa: E402


def state(mib: int, tensor_mib: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(tensor_mib * 2**18, generator=generator) for i in range(mib // tensor_mib)}


def save(tensors: dict[str, torch.Tensor], target: Path, checksummed: bool) -> tuple[float, float]:
    """(seconds of the save, of them in the hash function)."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    started = time.perf_counter()
    writer = dcp.FileSystemWriter(target)
    hashing = integrity.HashingFileSystem()
    if checksummed:
        writer.fs = hashing
    dcp.save({"model": tensors}, storage_writer=writer, no_dist=True)
    if checksummed:
        integrity.write_manifest(target, hashing.digests)
    return time.perf_counter() - started, hashing.hash_seconds


def hash_seconds(target: Path, algorithm: str) -> float:
    """Seconds the hash function takes over the checkpoint's bytes, read into memory first."""
    blobs = [path.read_bytes() for path in sorted(target.iterdir()) if path.is_file()]
    hasher = integrity.new_hasher(algorithm)
    started = time.perf_counter()
    for blob in blobs:
        hasher.update(blob)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["64:1", "256:4", "256:16"], help="MiB:TENSOR_MIB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--algorithm", default=integrity.ALGORITHM, choices=sorted(integrity.HASHERS))
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    args = parser.parse_args()
    integrity.ALGORITHM = args.algorithm  # what HashingFileSystem hashes with
    records = []
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        for case in args.cases:
            mib, tensor_mib = map(int, case.split(":"))
            tensors = state(mib, tensor_mib)
            plain, checked, ratios, shares = [], [], [], []
            for index in range(args.rounds + 1):  # the first round warms up; the order alternates (ABBA)
                order = (False, True) if index % 2 else (True, False)
                times = {kind: save(tensors, Path(scratch) / f"save-{kind}", kind) for kind in order}
                plain.append(times[False][0])
                checked.append(times[True][0])
                ratios.append(checked[-1] / plain[-1])
                shares.append(times[True][1] / times[True][0])
            plain, checked, ratios, shares = plain[1:], checked[1:], ratios[1:], shares[1:]
            started = time.perf_counter()
            integrity.verify_files(Path(scratch) / "save-True")
            verify = time.perf_counter() - started
            hashing = statistics.median(hash_seconds(Path(scratch) / "save-True", args.algorithm) for _ in range(3))
            records.append({"mib": mib, "tensor_mib": tensor_mib, "algorithm": args.algorithm,
                            "plain_s": statistics.median(plain),
                            "checksummed_s": statistics.median(checked),
                            "overhead": statistics.median(checked) / statistics.median(plain) - 1,
                            "paired": statistics.median(ratios) - 1, "hash_s": hashing,
                            "hash_in_memory_share": hashing / statistics.median(plain),
                            "hash_share": statistics.median(shares), "verify_s": verify})
    seconds = lambda v: f"{v:.3f} s"  # noqa: E731
    percent = lambda v: f"{100 * v:+.1f}%"  # noqa: E731
    emit(records, [("mib", "MiB", str), ("tensor_mib", "tensor MiB", str), ("algorithm", "hash", str),
                   ("plain_s", "plain save", seconds),
                   ("checksummed_s", "checksummed", seconds), ("overhead", "overhead", percent),
                   ("paired", "paired", percent), ("hash_share", "hash share", lambda v: f"{100 * v:.1f}%"),
                   ("verify_s", "verify", seconds)])

if __name__ == "__main__":
    main()
