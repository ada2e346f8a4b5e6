"""``cp-train-verify CHECKPOINT``: check a checkpoint offline, as a resume would, checksums included.

    cp-train-verify ckpt                    # the checkpoint ckpt/latest names
    cp-train-verify ckpt/step_00000300      # one checkpoint
    cp-train-verify ckpt --all              # every checkpoint in ckpt, newest first

Prints one line per checkpoint that verifies and exits 0; a damaged or incomplete one is one line naming
the file and the newest checkpoint that verifies, exit code 2 (as ``train.py`` says it before a resume).
Files are hashed on ``--workers`` threads.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

from cp_train.checkpoint.files import find_checkpoint, step_dirs
from cp_train.checkpoint.integrity import MANIFEST, read_manifest, shares, verify_files
from cp_train.config.arg_types import OneLineParser, positive_int
from cp_train.errors import InputError, exit_now, run_entry_point

PROG = "cp-train-verify"


def verify_checkpoint(given: Path, workers: int = 4) -> str:
    """Verify the checkpoint ``given`` names (``find_checkpoint``), its files hashed on ``workers`` threads;
    the line to print. InputError worded as a resume words it."""
    found = find_checkpoint(given, verify=False)  # the files and their lengths
    if found is None:
        raise InputError(f"{given} holds no checkpoint (no `latest`, no meta.json)")
    if not (found / MANIFEST).exists():
        verify_files(found)  # a missing manifest that meta.json lists is damage
        return f"{found}: complete, saved without checksums (before cp-train wrote {MANIFEST}): not verified"
    try:
        manifest = read_manifest(found)
    except InputError as error:
        manifest, failed = None, [error]
    else:
        with ThreadPoolExecutor(max(1, workers)) as pool:
            failed = [e for e in pool.map(lambda names: _try(found, names), shares(manifest["files"], workers)) if e]
    if failed or manifest is None:
        find_checkpoint(given)  # raises the one line a resume prints, naming the newest checkpoint that verifies
        raise failed[0]
    total = sum(entry["bytes"] for entry in manifest["files"].values())
    return (f"{found}: verified ({len(manifest['files'])} files, {total / 2**20:.1f} MiB, "
            f"{manifest['algorithm']} checksums)")


def _try(path: Path, names: list[str]) -> InputError | None:
    try:
        verify_files(path, names)
    except InputError as error:
        return error
    return None


def run(argv: list[str]) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory (step_XXXXXXXX) or a --save directory (its latest)")
    parser.add_argument("--all", action="store_true", help="verify every checkpoint of a --save directory")
    parser.add_argument("--workers", type=positive_int, default=4, help="threads hashing files (default 4)")
    args = parser.parse_args(argv)
    given = Path(args.checkpoint)
    if not given.exists():
        raise InputError(f"{given} does not exist: pass a checkpoint directory or a --save directory")
    targets = list(reversed(step_dirs(given))) if args.all else [given]
    if args.all and not targets:
        raise InputError(f"{given} holds no step_XXXXXXXX checkpoint")
    for target in targets:
        print(verify_checkpoint(target, args.workers), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point(PROG, run, argv)


def console_main() -> NoReturn:
    """The ``cp-train-verify`` console script: ``main``, then the end of the process (``exit_now``: without the
    interpreter's teardown of the modules)."""
    exit_now(main())


if __name__ == "__main__":
    console_main()
