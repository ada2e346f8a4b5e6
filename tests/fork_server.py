"""A fork server for the failure tests' one-process runs of ``train.py`` (``tests/entry_points.run``, world 1).

``python train.py ARGS`` spends 3-4 of its 4-5 CPU seconds here importing torch and the project; the failure tests
start about forty such runs. This process imports them once, then forks a child per request that runs
``train.py`` as ``python train.py ARGS`` would: ``__main__`` is the script, ``sys.argv`` and the working directory
are the request's, the environment is replaced by the request's, stdout and stderr go to one file, and the exit
code is the interpreter's (``sys.exit``'s code; 1 and a traceback for an uncaught exception; minus the signal for
a child killed by one). What differs from a fresh interpreter: modules are imported before the environment is
applied, so a variable read at import time (none in the project; ``OMP_NUM_THREADS`` in torch) keeps this
process's value, ``/proc/self/environ`` is this process's start-up environment, and the modules are never torn
down (the project's commands skip that anyway: ``cp_train.errors``).

Protocol (one JSON object per line): a request ``{"script", "args", "cwd", "env", "output"}`` on stdin; the
reply ``{"pid": P}`` on stdout, P leading the process group of the run; when the run ends its exit code is
written to ``output + ".rc"`` (renamed into place, so a reader never sees half of it). EOF on stdin ends the server.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import threading
from typing import Any

import torch._dynamo  # noqa: F401 - what a run's first optimizer construction imports (about 1 s, in every run)

import cp_train.cli.launch  # noqa: F401 - what train.py imports once its flags have parsed
import cp_train.cli.train  # noqa: F401 - what train.py imports
import cp_train.config.validate  # noqa: F401
import cp_train.parallel.mesh.collectives  # noqa: F401
import cp_train.trainer  # noqa: F401 - and what a run imports next
from cp_train.errors import wait_for_threads


def _exit_code(error: SystemExit) -> int:
    """The status the interpreter exits with for ``error`` (``sys.exit(code)``)."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _run_script(request: dict[str, Any]) -> int:
    """Run the request's script as ``__main__`` in this (forked) process; its exit code."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(request["script"])
    code = 0
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as error:
        code = _exit_code(error)
    except BaseException as error:  # noqa: BLE001 - the interpreter prints any uncaught exception and exits 1
        frames = error.__traceback__
        while frames is not None and frames.tb_frame.f_code.co_filename != request["script"]:
            frames = frames.tb_next  # from the script's first frame on, as the interpreter shows it
        sys.excepthook(type(error), error.with_traceback(frames), frames)
        code = 1
    try:
        wait_for_threads()  # as the interpreter's exit: the threads that are not daemons finish first
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _supervise(request: dict[str, Any]) -> None:
    """In the first child: lead a process group, run the script in a grandchild, write its exit code, exit."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        os._exit(_run_script(request))
    _, status = os.waitpid(pid, 0)
    partial = request["output"] + ".rc.partial"
    with open(partial, "w") as file:
        file.write(str(os.waitstatus_to_exitcode(status)))
    os.replace(partial, request["output"] + ".rc")
    os._exit(0)


def serve() -> None:
    assert threading.active_count() == 1, "a fork server must fork from a process of one thread"
    replies = os.dup(1)
    os.dup2(2, 1)  # nothing of this process's own goes to the replies
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the supervising children are reaped by the kernel
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.close(replies)
            _supervise(request)
        os.write(replies, (json.dumps({"pid": pid}) + "\n").encode())


if __name__ == "__main__":
    serve()
