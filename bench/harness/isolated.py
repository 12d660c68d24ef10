"""Run one measurement in a fresh process, without paying Python's and torch's start-up each time.

Every figure of the report is measured in a process that has run nothing else, so that no
tensor, allocator cache, compiled graph or resident page of an earlier measurement is in it.
Starting such a process with ``python -m ...`` costs 4-8 s on a 2-core CPU (importing torch,
Transformers and its ``Trainer``), more than most measurements take. Here each measurement is a
child forked from a server process (:mod:`multiprocessing`'s ``forkserver`` start method) that
imported those modules once (:mod:`bench.harness.preload`) and has run nothing: the child starts in a few
milliseconds with the modules in place and nothing else, the state a measurement needs.

The server is started with the measuring environment (:func:`measuring_env`): glibc's mmap
threshold fixed (:mod:`bench.harness.rss`), so the resident set follows live memory, and one inductor
cache shared by every run. A child runs ``target`` (a module-level function, passed as itself, so
that moving it breaks the import of its caller, not a run an hour later) on its arguments,
with its output in a log file, and sends the return value back; an exception, a crash or a
timeout is raised in the caller as :class:`WorkerFailed`, with the reason.

    result = isolated.call(worker.run, spec, timeout=600)   # a function, not its name

:class:`Worker` starts a child without waiting for it (the ranks of a distributed measurement).
As with every start method but ``fork``, a child imports the calling program's main module (as
``__mp_main__``): a script that measures needs the ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
from multiprocessing import forkserver
from typing import Any, Callable, Optional

from bench.harness.rss import MMAP_THRESHOLD

logger = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Imported once by the server: what every measurement would otherwise import or probe itself.
PRELOAD = ["bench.harness.preload"]

_context: Optional[multiprocessing.context.ForkServerContext] = None


class WorkerFailed(RuntimeError):
    """A measurement's process raised, crashed or ran out of time; the message says which."""


def measuring_env() -> dict[str, str]:
    """The variables every measuring process starts with, on top of this process's environment:
    glibc's mmap threshold (``MALLOC_MMAP_THRESHOLD_``, see :mod:`bench.harness.rss`) and a shared inductor
    cache. A value already set in the environment is kept."""
    return {
        "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD)),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get(
            "TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "lean-llm-train-inductor")),
    }


def context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context; the server starts (with :func:`measuring_env`) at the first child."""
    global _context
    if _context is None:
        os.environ.update(measuring_env())  # read by glibc when the server's interpreter starts
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def start() -> None:
    """Start the server now, without waiting for its imports: they then overlap the caller's own
    start-up instead of delaying the first measurement."""
    context()
    forkserver.ensure_running()


def reference(function: Callable[..., Any]) -> str:
    """``"module:function"`` for a module-level function, the form a child imports it by.

    Raises:
        TypeError: not a function defined at the top level of an importable module (a lambda, a
            nested function, a name as a string).
    """
    module, name = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if not callable(function) or not module or not name or "<" in name or "." in name or module == "__main__":
        raise TypeError(f"a worker target must be a function defined at the top level of an importable module, "
                        f"passed as itself; got {function!r}")
    return f"{module}:{name}"


def resolve(name: str) -> Callable[..., Any]:
    """The function that :func:`reference` named (imports its module)."""
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def _child(target: str, args: tuple, env: dict[str, str], log: str,
           conn: multiprocessing.connection.Connection) -> None:
    os.environ.update(env)
    if ROOT not in sys.path:  # workers import bench itself from the checkout
        sys.path.insert(0, ROOT)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        result = resolve(target)(*args)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
        import traceback

        traceback.print_exc()
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    else:
        conn.send(("ok", result))
    finally:
        conn.close()


class Worker:
    """``target(*args)`` running in a fresh child; :meth:`result` waits for its return value.

    ``env`` is set in the child's ``os.environ`` before ``target`` is imported (variables read at
    run time, such as a rank; not glibc's, which the server fixed)."""

    def __init__(self, target: Callable[..., Any], *args: Any, env: Optional[dict[str, str]] = None) -> None:
        self.target = target = reference(target)
        fd, self.log = tempfile.mkstemp(prefix="bench-worker-", suffix=".log")
        os.close(fd)
        receive, send = context().Pipe(duplex=False)
        self._conn = receive
        self.process = context().Process(target=_child, args=(target, args, dict(env or {}), self.log, send),
                                         daemon=True)
        self.process.start()
        send.close()  # the child holds the other copy: its exit is our end of file

    def result(self, timeout: float) -> Any:
        """The child's return value; :class:`WorkerFailed` if it raised, died or took longer
        than ``timeout`` seconds (it is killed then). The log file is removed either way."""
        try:
            if not self._conn.poll(timeout):
                raise WorkerFailed(f"timed out after {timeout:.0f} s")
            try:
                status, value = self._conn.recv()
            except EOFError:  # died before sending
                self.process.join(5)
                code = self.process.exitcode
                if code is not None and code < 0:
                    name = signal.Signals(-code).name
                    raise WorkerFailed(f"killed by {name}" + (" (out of memory?)" if -code == 9 else "")) from None
                raise WorkerFailed(self._last_line() or f"exit code {code}") from None
            self.process.join(30)
            if status == "error":
                logger.debug("%s failed; its output:\n%s", self.target, self._read())
                raise WorkerFailed(value[:400])
            return value
        finally:
            self.close()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def close(self) -> None:
        """Kill the child if it still runs; remove its log."""
        self.kill()
        self._conn.close()
        if os.path.exists(self.log):
            os.unlink(self.log)

    def _read(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _last_line(self) -> str:
        lines = self._read().strip().splitlines()
        return lines[-1][:300] if lines else ""


def call(target: Callable[..., Any], *args: Any, timeout: float, env: Optional[dict[str, str]] = None) -> Any:
    """``target(*args)`` in a fresh child process; its return value, or :class:`WorkerFailed`."""
    return Worker(target, *args, env=env).result(timeout)

