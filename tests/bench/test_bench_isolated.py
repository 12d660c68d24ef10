"""bench.harness.isolated: each measurement in a fresh process forked from a preloaded server."""

from __future__ import annotations

import math
import os
import sys
import time

import pytest

from bench.harness import isolated
from bench.harness.rss import MMAP_THRESHOLD
from tests.support import isolated_targets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forkserver and /proc: Linux")


def test_call_returns_the_value_from_another_process():
    assert isolated.call(os.getpid, timeout=120) != os.getpid()
    assert isolated.call(math.hypot, 3.0, 4.0, timeout=60) == 5.0


def test_children_are_fresh_processes_with_torch_already_imported():
    pids = {isolated.call(os.getpid, timeout=120) for _ in range(3)}
    assert len(pids) == 3 and os.getpid() not in pids  # a new process each time
    # what makes a child start in milliseconds: the server imported these before forking it
    for name in ("torch", "transformers", "functional_ce", "model_patches", "ac_policies"):
        assert isolated.call(isolated_targets.imported, name, timeout=60), name
    assert not isolated.call(isolated_targets.imported, "bench.harness.measure", timeout=60)  # nothing the caller ran


def test_the_server_started_with_the_measuring_environment():
    # glibc reads its mmap threshold when a process starts: the server's own environment holds it
    want = os.environ.get("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    assert isolated.call(isolated_targets.mmap_threshold_env, timeout=120) == want
    assert isolated.call(os.getenv, "TORCHINDUCTOR_CACHE_DIR", timeout=60)


def test_env_reaches_the_child_only():
    assert isolated.call(os.getenv, "BENCH_ISOLATED_TEST", timeout=120, env={"BENCH_ISOLATED_TEST": "7"}) == "7"
    assert "BENCH_ISOLATED_TEST" not in os.environ
    assert isolated.call(os.getenv, "BENCH_ISOLATED_TEST", timeout=60) is None


def test_an_exception_is_raised_in_the_caller_with_its_type_and_message():
    with pytest.raises(isolated.WorkerFailed, match="ValueError: math domain error"):
        isolated.call(math.sqrt, -1.0, timeout=120)


def test_a_crash_and_an_exit_are_reported():
    with pytest.raises(isolated.WorkerFailed, match="killed by SIGABRT"):
        isolated.call(os.abort, timeout=120)
    with pytest.raises(isolated.WorkerFailed, match="exit code 3"):
        isolated.call(os._exit, 3, timeout=60)


def test_a_timeout_kills_the_child():
    worker = isolated.Worker(time.sleep, 60)
    with pytest.raises(isolated.WorkerFailed, match="timed out after 1 s"):
        worker.result(1)
    assert not worker.process.is_alive()
    assert not os.path.exists(worker.log)


def test_the_child_output_stays_out_of_the_caller(capfd):
    isolated.call(print, "from the child", timeout=120)
    assert "from the child" not in capfd.readouterr().out



def test_a_target_is_a_function_passed_as_itself():
    # a name in a string would break silently when its file moves; a function breaks its caller's import
    for target in ("os:getpid", lambda: 1, isolated_targets):
        with pytest.raises(TypeError, match="top level of an importable module"):
            isolated.call(target, timeout=60)
    assert isolated.resolve(isolated.reference(isolated_targets.imported)) is isolated_targets.imported
