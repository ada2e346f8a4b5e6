"""Failures the user can act on, and how an entry point reports any failure: one line and an exit code.

- ``InputError`` (exit 2): a config key, a flag or an input file (data, tokenizer, checkpoint) that cannot be
  used. The message names the key or the file and says what to change. ``config.ConfigError`` is one.
- ``RunFailure`` (exit 1): the run started and cannot go on (a non-finite loss, a full disk, a collective that
  timed out). The message says what happened and what to do next.

Both are raised alike on every rank (``agree`` turns a check made on some ranks into an error on all), so
rank 0 alone prints them. Any other exception (a bug, or the machine failing) makes each rank that hits it
print one line naming the exception, its first message line and where it was raised (exit 1). No traceback
is printed unless ``--debug`` is given or ``CP_TRAIN_DEBUG=1`` is set. Under torchrun the same line goes to
torchrun's error file (``TORCHELASTIC_ERROR_FILE``), so torchrun's failure summary shows it instead of a link.

No line is lost: the reporting rank flushes its line, then exits. Under torchrun the ranks that leave the report to
rank 0 do not exit by themselves (torchrun would stop every other rank, rank 0 too, at the first exit): they wait
until torchrun stops them, which it does as soon as rank 0 has exited, so torchrun's summary names rank 0 as the
root cause. Should rank 0 not report within ``REPORT_WAIT_S`` (a rank on another node, say), each such rank prints
the line itself. Ctrl-C prints one line (``interrupted``) from rank 0, none under ``cp-train-launch``, whose own
line says it (``LAUNCHER_ENV``).

A command ends with ``exit_now(code)`` after its ``main`` returned: the interpreter's exit without its teardown of
the modules' objects, about a second of CPU per rank after torch, Dynamo and the trainer were imported
(``python -c "import torch._dynamo, cp_train.trainer"``: 4.5 s, 3.5 s when it ends with ``os._exit``), half a
second per launcher. The threads that are not daemons finish, the ``atexit`` handlers run (logging's, wandb's,
torch's) and stdout and stderr are flushed first; a file left open without being closed would lose what it
buffered (cp-train closes every file it writes before its command returns). ``main`` itself returns its code
(the tests call it in the test process).
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

DEBUG_ENV = "CP_TRAIN_DEBUG"
DEBUG_FLAG = "--debug"
REPORT_WAIT_S = 120.0  # under torchrun, the longest a rank that leaves the report to rank 0 waits to be stopped
LAUNCHER_ENV = "CP_TRAIN_LAUNCHER"  # set by cp-train-launch for its ranks: it reports an interrupt itself
T = TypeVar("T")


class CpTrainError(Exception):
    """A failure with a message written for the user; ``exit_code`` is what the process exits with."""

    exit_code = 1
    everywhere = True  # raised alike on every rank: rank 0 reports it, the others exit quietly


class InputError(CpTrainError, ValueError):
    """A config value, flag or input file that cannot be used (exit code 2)."""

    exit_code = 2


class RunFailure(CpTrainError):
    """The run cannot go on (exit code 1)."""


def this_rank() -> int:
    """The global rank from torchrun's environment (0 outside torchrun)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def debug_requested(argv: Sequence[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def one_line(text: str) -> str:
    """``text`` without line breaks (the first non-empty line when it is a multi-line report)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _origin(error: BaseException) -> str:
    """``file:line in function`` of the innermost frame that raised ``error``."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "unknown location"
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"


def launch_world_size() -> int:
    """torchrun's ``WORLD_SIZE`` (1 when unset): an ``InputError`` naming the variable when it is not a whole
    number above 0."""
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.strip().isdigit() or int(value) < 1:
        raise InputError(f"WORLD_SIZE={value!r} is not a number of processes: unset it for one process, or "
                         f"launch with torchrun, which sets it")
    return int(value)


def _rank_prefix() -> str:
    """``rank N: `` in a world of several processes, else nothing."""
    try:
        several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        several = False
    return f"rank {this_rank()}: " if several else ""


def describe(error: BaseException, explain: Callable[[BaseException], str | None] | None = None
             ) -> tuple[str, int, bool]:
    """``(line, exit code, print on this rank)`` for ``error``. ``explain`` may turn other exceptions
    (a failed collective, say) into a message for the user."""
    if isinstance(error, CpTrainError):
        if error.everywhere:
            return one_line(str(error)), error.exit_code, this_rank() == 0
        return f"{_rank_prefix()}{one_line(str(error))}", error.exit_code, True
    explained = explain(error) if explain is not None else None
    if explained:
        return f"{_rank_prefix()}{explained}", 1, True
    message = one_line(str(error))
    return (f"{_rank_prefix()}unexpected {type(error).__name__}{': ' + message if message else ''} "
            f"(at {_origin(error)}; rerun with {DEBUG_FLAG} or {DEBUG_ENV}=1 for the traceback)", 1, True)


def write_torchelastic_error_file(line: str) -> None:
    """Give torchrun's failure summary ``line`` instead of its link to the docs (no-op outside torchrun)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"message": {"message": line,  # torchrun's format, without a traceback
                                                       "extraInfo": {"timestamp": str(int(time.time()))}}}))
    except OSError:
        pass  # the summary then shows torchrun's default text


def wait_to_be_stopped(seconds: float) -> None:
    """Sleep up to ``seconds`` with SIGTERM and SIGINT at their defaults, so that torchrun's SIGTERM (sent once
    another rank exited) ends this process at once, whatever handler the run had installed."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(signum, signal.SIG_DFL)
        except ValueError:  # not the main thread: keep the handlers
            pass
    time.sleep(seconds)


def report(prog: str, line: str, code: int) -> None:
    """Print ``prog: error|failed: line`` on stderr, flushed, and give it to torchrun's error file."""
    sys.stdout.flush()
    print(f"{prog}: {'error' if code == 2 else 'failed'}: {line}", file=sys.stderr, flush=True)
    write_torchelastic_error_file(line)


def run_entry_point(prog: str, main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None,
                    explain: Callable[[BaseException], str | None] | None = None) -> int:
    """Run ``main(argv)`` and turn any exception into one line on stderr and an exit code (see the module
    docstring); returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(args)
    try:
        return main(args) or 0
    except KeyboardInterrupt:
        if this_rank() == 0 and not os.environ.get(LAUNCHER_ENV):
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - every failure becomes one line and an exit code
        line, code, here = describe(error, explain)
        if debug:
            print(f"{prog}: rank {this_rank()} traceback:", file=sys.stderr)
            traceback.print_exception(error)
        if here:
            report(prog, line, code)
        elif os.environ.get("TORCHELASTIC_ERROR_FILE"):  # under torchrun: rank 0 reports; exiting first would kill it
            wait_to_be_stopped(REPORT_WAIT_S)
            report(prog, f"{_rank_prefix()}{line} (rank 0 did not report it within {REPORT_WAIT_S:g} s)", code)
        return code


def agree(check: Callable[[], T], group: Any = None) -> T:
    """Run ``check()`` on this rank, then raise on every rank the first ``CpTrainError`` any rank raised
    (lowest rank first), so that a check made on some ranks stops all of them alike. Collective over
    ``group`` (default: the default process group, when one is initialised); returns ``check()``'s value."""
    import torch.distributed as dist

    value, failure = None, None
    try:
        value = check()
    except CpTrainError as error:
        failure = (type(error), str(error))
    failures = [failure]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        failures = [None] * dist.get_world_size(group)
        dist.all_gather_object(failures, failure, group=group)
    for found in failures:
        if found is not None:
            kind, message = found
            raise kind(message)
    return value  # type: ignore[return-value]


def ensure_writable_dir(path: Path, key: str, create: bool = True) -> None:
    """Write a file in directory ``path``, created first if missing (``create``; else, while it is missing, in the
    nearest folder above it that exists, which writing into it will need); ``InputError`` naming ``key`` if that
    fails."""
    if path.exists() and not path.is_dir():
        raise InputError(f"{key} {path} is a file: pass a directory (created if missing)")
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        probe = path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir():  # a file on the way down: making the directory would fail
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".write-check-"):
            pass
    except OSError as error:
        raise InputError(f"{key} {path} is not a writable directory ({error.strerror or error}): "
                         f"choose another one or fix its permissions") from None


def wait_for_threads() -> None:
    """Join the threads that are not daemons, as the interpreter's exit does (``threading._shutdown``, which also
    runs ``concurrent.futures``' exit hooks), or one by one where that private function is missing."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def exit_now(code: int | None) -> NoReturn:
    """End this process with exit code ``code`` (None: 0) after the threads, the ``atexit`` handlers and a flush
    of stdout and stderr; skips freeing the modules (the module docstring). Call it from the main thread."""
    status = 0 if code is None else int(code)
    try:
        wait_for_threads()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can be written to it
                pass
        os._exit(status)
