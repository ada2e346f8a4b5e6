"""Checkpoint integrity: every file's checksum in ``manifest.json`` at save, verified before a load (each rank its
share), ``cp-train-verify`` offline, and the advice after a NaN naming only a checkpoint that verifies.

One tiny run (``python train.py``, a world of one) saves checkpoints at steps 2 and 4; each case damages a copy.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from cp_train.checkpoint.dcp import LATEST, step_dir_name
from cp_train.checkpoint.files import resume_hint, resume_source
from cp_train.checkpoint.integrity import MANIFEST, ChecksumMismatch, read_manifest, shares, verify_files
from cp_train.checkpoint.resume import check_save_directory
from cp_train.cli import verify
from cp_train.errors import InputError
from tests import trainer_cases
from tests.entry_points import assert_one_line, run, write_config

NEWEST, PREVIOUS = step_dir_name(4), step_dir_name(2)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("integrity")
    corpus = trainer_cases.write_corpus(root / "docs")
    config = write_config(root / "run.yaml", corpus, root / "run", **{"train.steps": 4, "schedule.warmup_steps": 1})
    done = run(["--config", str(config), "--save", str(root / "ckpt"), "--save-interval", "2"])
    assert done.returncode == 0, done.output[-3000:]
    return {"root": root, "config": str(config), "ckpt": root / "ckpt"}


def copy_of(base: dict, name: str) -> Path:
    copy = base["root"] / name
    shutil.copytree(base["ckpt"], copy)
    return copy


def flip(path: Path, at: float = 0.5) -> None:
    """Change one byte of ``path`` (at the fraction ``at`` of its length), keeping its length."""
    data = bytearray(path.read_bytes())
    index = min(len(data) - 1, int(len(data) * at))
    data[index] ^= 0x5A
    path.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_its_checksum(base) -> None:
    newest = base["ckpt"] / NEWEST
    files = read_manifest(newest)["files"]
    written = {str(p.relative_to(newest)) for p in newest.rglob("*") if p.is_file() and p.name != MANIFEST}
    assert set(files) == written and {".metadata", "meta.json", "rng/rank_00000.pt"} <= written
    assert verify_files(newest) == sum(entry["bytes"] for entry in files.values())
    parts = shares(files, 3)  # the ranks of a load each read a share: disjoint, all of them
    assert sorted(name for part in parts for name in part) == sorted(files)


@pytest.mark.parametrize("target", ["__0_0.distcp", ".metadata", "meta.json", MANIFEST, "rng/rank_00000.pt"])
def test_one_changed_byte_refuses_the_load_naming_the_file_and_the_checkpoint_that_verifies(base, target) -> None:
    copy = copy_of(base, "flip-" + target.replace("/", "-"))
    flip(copy / NEWEST / target)
    with pytest.raises(InputError) as caught:
        resume_source(None, str(copy), share=(0, 1))
    message = str(caught.value)
    assert "\n" not in message
    assert re.fullmatch(rf"{re.escape(str(copy / LATEST))} names {NEWEST}, an? (damaged|incomplete) checkpoint: "
                        rf".*{re.escape(target)}.*; resume from the newest complete checkpoint with --load "
                        rf"{re.escape(str(copy / PREVIOUS))}", message), message
    if target.endswith((".distcp", ".pt", MANIFEST)):
        assert "a damaged checkpoint" in message, message
    # cp-train-verify says the same line, exit code 2; the older checkpoint verifies
    assert verify.main([str(copy)]) == 2
    assert verify.main([str(copy / PREVIOUS)]) == 0


def test_any_changed_byte_of_the_manifest_is_caught(base, tmp_path) -> None:
    source = base["ckpt"] / NEWEST
    shutil.copytree(source, tmp_path / "c")
    manifest = tmp_path / "c" / MANIFEST
    original = manifest.read_bytes()
    for index in range(len(original)):
        changed = bytearray(original)
        changed[index] ^= 1 << (index % 8)
        manifest.write_bytes(bytes(changed))
        with pytest.raises(ChecksumMismatch, match="manifest.json is damaged"):
            read_manifest(tmp_path / "c")
    manifest.write_bytes(original)
    read_manifest(tmp_path / "c")


def test_a_share_reads_only_its_files_and_a_truncated_shard_is_still_caught(base) -> None:
    copy = copy_of(base, "share")
    flip(copy / NEWEST / "__0_0.distcp")
    files = read_manifest(copy / NEWEST)["files"]
    owner = next(rank for rank, part in enumerate(shares(files, 2)) if "__0_0.distcp" in part)
    verify_files(copy / NEWEST, rank=1 - owner, world=2)  # the other rank's share is intact
    with pytest.raises(ChecksumMismatch, match=r"shard \S+__0_0\.distcp does not match its checksum"):
        verify_files(copy / NEWEST, rank=owner, world=2)
    (copy / NEWEST / "__0_0.distcp").write_bytes(b"\0" * 100)
    with pytest.raises(InputError, match=r"__0_0\.distcp is truncated \(100 bytes"):
        resume_source(None, str(copy))


def test_verify_command_and_nan_advice_name_only_verified_checkpoints(base, capsys) -> None:
    assert verify.main([str(base["ckpt"]), "--all"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == [str(base["ckpt"] / NEWEST), str(base["ckpt"] / PREVIOUS)]
    assert all("verified (4 files" in line for line in out), out
    copy = copy_of(base, "nan-advice")
    flip(copy / NEWEST / "__0_0.distcp")
    assert verify.main([str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a damaged checkpoint" in err and f"--load {copy / PREVIOUS}" in err, err
    assert resume_hint(str(copy), None) == f"the last checkpoint is {copy / PREVIOUS}: resume from it with --load " \
                                           f"{copy / PREVIOUS}"
    meta = json.loads((copy / NEWEST / "meta.json").read_text())
    assert meta["checksums"] == MANIFEST


def test_train_refuses_a_damaged_shard_before_step_1(base) -> None:
    copy = copy_of(base, "train-damaged")
    flip(copy / NEWEST / "__0_0.distcp")
    outcome = run(["--config", base["config"], "--save", str(copy), "--train-steps", "6",
                   "--run-dir", str(base["root"] / "run-damaged")])
    assert_one_line(outcome, 2, rf"names {NEWEST}, a damaged checkpoint: shard \S+__0_0\.distcp does not match its "
                                rf"checksum in manifest\.json .*; resume from the newest complete checkpoint with "
                                rf"--load {re.escape(str(copy / PREVIOUS))}$")
    assert "step 5/" not in outcome.output


def test_large_writes_hashed_beside_the_copy_match_the_file(tmp_path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from cp_train.checkpoint.integrity import HashingFileSystem, file_digest

    writer = dcp.FileSystemWriter(tmp_path)
    writer.fs = hashing = HashingFileSystem()
    tensors = {"big": torch.randn(3 << 18), "small": torch.randn(7)}  # 3 MiB: hashed on the helper thread
    dcp.save({"model": tensors}, storage_writer=writer, no_dist=True)
    assert set(hashing.digests) == {".metadata", "__0_0.distcp"}
    for name, digest in hashing.digests.items():
        assert file_digest(tmp_path / name) == digest, name


def test_a_run_never_writes_over_or_among_checkpoints_it_does_not_continue(base) -> None:
    """``run_parts.prepare_environment``'s check of checkpoint.save (``resume.check_save_directory``)."""
    ckpt = copy_of(base, "guarded")
    check_save_directory(str(ckpt), ckpt / NEWEST)  # a resume from its newest: goes on
    with pytest.raises(InputError, match=rf"holds {NEWEST}, past step 2 this run resumes from, and it would "
                                         rf"overwrite them: .*--load {re.escape(str(ckpt / NEWEST))}, or set another"):
        check_save_directory(str(ckpt), ckpt / PREVIOUS)  # a rollback
    with pytest.raises(InputError, match=rf"another run's checkpoints \(up to {NEWEST}\) and this run starts afresh "
                                         rf"\(checkpoint.auto_resume false\)"):
        check_save_directory(str(ckpt), None)
    elsewhere = copy_of(base, "elsewhere")
    with pytest.raises(InputError, match=rf"this run resumes from {re.escape(str(elsewhere / PREVIOUS))}: continue "
                                         rf"{re.escape(str(ckpt))} with --load {re.escape(str(ckpt))}"):
        check_save_directory(str(ckpt), elsewhere / PREVIOUS)
    for step in (PREVIOUS, NEWEST):  # saves cut short are no checkpoints: written over
        (ckpt / step / "meta.json").unlink()
    check_save_directory(str(ckpt), None)


def test_a_fresh_run_into_a_directory_of_checkpoints_stops_before_writing(base) -> None:
    ckpt = copy_of(base, "afresh")
    before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
    outcome = run(["--config", base["config"], "--save", str(ckpt), "--save-interval", "2",
                   "--set", "checkpoint.auto_resume=false"])
    assert_one_line(outcome, 2, r"checkpoint\.save \(--save\) .* holds another run's checkpoints")
    assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before


@pytest.mark.parametrize("workers", ["0", "-1", "two"])
def test_verify_workers_must_be_a_positive_count(tmp_path, capsys, workers: str) -> None:
    assert verify.main([str(tmp_path), "--workers", workers]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cp-train-verify: error: argument --workers: ") and len(err.splitlines()) == 1, err
