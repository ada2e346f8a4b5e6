"""torchrun with a one-line failure report: ``cp-train-launch [torchrun options] train.py [args]`` (the console
script; also ``python -m cp_train.cli.launch``).

It takes torchrun's own arguments and runs torchrun's own launcher (``torch.distributed.run``). When a
worker fails, plain torchrun logs the failure, prints a Python traceback of its own launcher and a
failure summary, and exits with 1 whatever the workers' exit codes were. This launcher prints one line
naming the first rank that failed instead, and exits with that rank's exit code: 2 for a config or input
error, 1 for a failed run, 128 + N for a rank killed by signal N (the ranks print none of their own:
``cp_train.errors.LAUNCHER_ENV``). SIGUSR1, SIGTERM and Ctrl-C are passed on to the ranks, which save a checkpoint
after their step and stop with exit code 0 and one line (``cp_train.preemption``), and the launcher waits for them
and exits 0 (``SaveAndStop``); a second Ctrl-C stops at once (one line, exit 130). ``launch/torchrun.sh`` and
``launch/slurm.sbatch`` use it.
"""

from __future__ import annotations

import argparse
import ctypes
import difflib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import determine_local_world_size, get_args_parser, run

from cp_train.errors import LAUNCHER_ENV, InputError, exit_now

PROG = "cp_train.cli.launch"
# log each failure and each signal: the summary line says it all
QUIETED_LOGGERS = ("torch.distributed.elastic.multiprocessing", "torch.distributed.elastic.agent")


PR_SET_PDEATHSIG = 1  # linux/prctl.h
OURS_LEFT_TO_TORCHRUN = "SIGHUP,SIGQUIT"  # the signals torchrun's agent handles; SIGTERM and SIGINT are SaveAndStop's


def stop_with_launcher() -> None:
    """Under torchrun (Linux): have the kernel send this rank SIGTERM when its launcher dies. torchrun starts
    its ranks in sessions of their own, so a launcher killed outright (SIGKILL) would leave them training and
    writing checkpoints and metrics beside the rerun that the README advises. Elsewhere nothing."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0 and (
            os.getppid() != parent):  # the launcher died between the two calls
        os.kill(os.getpid(), signal.SIGTERM)


def exit_code_of(code: int) -> int:
    """A worker's exit code as a shell reports it (a negative code is a signal: 128 + N)."""
    return 128 - code if code < 0 else code


def summarize(failure: ChildFailedError) -> tuple[str, int]:
    """(one line, exit code). The root cause is a rank that exited by itself, else one killed by a signal
    other than SIGTERM (which torchrun sends to the other ranks once one failed), else any; the earliest
    (then the lowest rank) of them."""
    failures = failure.failures

    def cause_first(rank: int) -> tuple[int, int, int]:
        code = failures[rank].exitcode
        kind = 0 if code > 0 else 1 if code != -signal.SIGTERM else 2
        return kind, failures[rank].timestamp, rank

    root = min(failures, key=cause_first)
    groups: dict[str, list[int]] = {}
    for rank in sorted(failures):
        code = failures[rank].exitcode
        how = f"killed by {failures[rank].signal_name()}" if code < 0 else f"exit code {code}"
        groups.setdefault(how, []).append(rank)
    code = exit_code_of(failures[root].exitcode) or 1
    ranks = "; ".join(f"{how} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                      for how, r in groups.items())
    return f"{PROG}: {Path(failure.name).name} failed with exit code {code} ({ranks})", code


def children() -> list[int]:
    """The process ids of this process's children (its ranks; Linux /proc)."""
    found: list[int] = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            found += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def forward_to_ranks(signum: int, frame: object = None) -> None:
    """Pass ``signum`` (SIGUSR1: Slurm's warning before the time limit) on to every rank: they save and stop."""
    for pid in children():
        try:
            os.kill(pid, signum)
        except OSError:
            pass


class SaveAndStop:
    """The launcher's SIGTERM and SIGINT (Ctrl-C): passed on to the ranks once, which save a checkpoint after their
    step and exit 0, while torchrun's agent keeps waiting for them (``TORCHELASTIC_SIGNALS_TO_HANDLE`` leaves these
    two to us: the agent would send its ranks SIGTERM and kill them 30 s later). A second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None

    def __call__(self, signum: int, frame: object = None) -> None:
        if self.received is not None:
            if signum == signal.SIGINT:  # the agent stops its ranks (SIGINT: a second Ctrl-C for them too)
                raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
            return
        self.received = signal.Signals(signum)
        forward_to_ranks(signum)


def _usage_error(message: str) -> NoReturn:
    raise InputError(f"{message} (see cp-train-launch --help)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """torchrun's arguments; InputError (one line, not torchrun's usage) for an unknown option or a
    ``--nproc-per-node`` that is not a positive count or one of torchrun's words (cpu, gpu, xpu, auto)."""
    parser = get_args_parser()
    parser.prog = "cp-train-launch"
    parser.error = _usage_error  # type: ignore[method-assign]  # one line instead of the usage
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        options = [o for o in parser._option_string_actions if o.startswith("--")]
        close = difflib.get_close_matches(unknown[0].split("=")[0], options, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise InputError(f"unrecognized arguments: {' '.join(unknown)}: {hint}torchrun's options go before the "
                         f"script and the script's after it, e.g. cp-train-launch --nproc-per-node 2 train.py "
                         f"--config FILE (see cp-train-launch --help)")
    value, why = args.nproc_per_node, ""
    try:
        count = determine_local_world_size(value)
    except ValueError as error:  # a word torchrun does not take, or a device this node lacks
        count, why = 0, "" if "Unsupported" in str(error) else f" ({error})"
    if count < 1:
        raise InputError(f"--nproc-per-node {value}{why}: pass the number of processes per node (1 or more), or "
                         f"gpu, cpu, xpu or auto (as many as this node has)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(list(sys.argv[1:] if argv is None else argv))
    except InputError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return 2
    signal.signal(signal.SIGUSR1, forward_to_ranks)  # torchrun itself would die of it
    save_and_stop = SaveAndStop()
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = OURS_LEFT_TO_TORCHRUN  # SIGTERM and SIGINT are ours
    if hasattr(args, "signals_to_handle"):  # torchrun >= 2.8 sets the variable from its flag
        args.signals_to_handle = OURS_LEFT_TO_TORCHRUN
    signal.signal(signal.SIGTERM, save_and_stop)
    signal.signal(signal.SIGINT, save_and_stop)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(QUIETED_LOGGERS):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[LAUNCHER_ENV] = PROG  # the ranks leave an interrupt's line to this launcher
    try:
        run(args)
    except ChildFailedError as failure:
        line, code = summarize(failure)
        print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as stop:
        print(f"{PROG}: stopped by {signal.Signals(stop.sigval).name}", file=sys.stderr, flush=True)
        return 128 + int(stop.sigval)
    return 0  # after a SIGTERM or Ctrl-C passed on: the ranks' own line says where they stopped


def console_main() -> NoReturn:
    """The ``cp-train-launch`` console script: ``main`` and the end of the process (``exit_now``: without the
    interpreter's teardown of torchrun's modules)."""
    exit_now(main())


if __name__ == "__main__":
    console_main()
