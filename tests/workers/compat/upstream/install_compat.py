"""A pytest plugin for hivemind's own tests: every process-wide replacement of :mod:`workers.compat` applied.

``tests/workers/compat/test_hivemind_upstream.py`` runs hivemind 1.1.12's tests with ``-p install_compat``.
:func:`workers.compat.install` runs once, in pytest's process, before any test: the forked test processes and
the averager and DHT processes they start inherit the replacements, as a worker's do.

It also keeps one stuck test from stalling the rest. hivemind runs each of these tests in a forked process
(``@pytest.mark.forked``); pytest-timeout's alarm (``timeout`` in the runner's pytest.ini) only fires while the
test function runs, in the forked process's main thread, and waits for it to return to Python. A forked process
that is stuck elsewhere (before the test starts, in a C call, in its teardown) would keep pytest waiting
forever (a CI run had not ended after 23 minutes). So pytest's own process watches each test: after
:data:`WATCHDOG_SECONDS` it has the forked process print every thread's stack (faulthandler, on SIGUSR1),
then kills it and everything it started. pytest-forked reports that as a crash, with the stacks in the test's
captured stderr, and the run goes on.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Generator
from typing import IO

import psutil
import pytest
from hivemind.averaging import allreduce

from workers import compat

WATCHDOG_SECONDS = float(os.environ.get("VOLUNTEER_UPSTREAM_WATCHDOG", "180"))
"""Seconds a test (its forked process: setup, call and teardown) may take before it is killed. hivemind's
slowest test here takes 12 s on a 2-core machine; pytest-timeout's alarm (pytest.ini) comes first."""
CRASH_MARK = "killed by install_compat's watchdog"
"""Printed, with the test's id and its threads' stacks, into the run's output when the watchdog kills a test
(the test's report says "CRASHED with signal 9", which the runner counts as a hang)."""


_stacks: IO[str] | None = None
"""Where the forked test processes write their threads' stacks on SIGUSR1 (their own stderr is pytest's
capture, lost with the killed process)."""


def pytest_configure(config: pytest.Config) -> None:
    global _stacks
    compat.install()
    _stacks = open(tempfile.mkstemp(prefix="hung-stacks-", suffix=".txt")[1], "a+")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)  # inherited by the forked tests


def pytest_unconfigure(config: pytest.Config) -> None:
    if _stacks is not None:
        _stacks.close()
        os.unlink(_stacks.name)


def pytest_report_header(config: pytest.Config) -> str:
    """The line the runner looks for: proof that these tests ran on the replacements."""
    reducer = allreduce.TensorPartReducer.__name__
    return f"workers.compat installed: hivemind's all-reduce reduces with {reducer}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    started = time.time()
    done = threading.Event()
    watchdog = threading.Thread(target=_watch, args=(item.nodeid, started, done), daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        done.set()
        watchdog.join()


def _watch(nodeid: str, started: float, done: threading.Event) -> None:
    if done.wait(WATCHDOG_SECONDS):
        return
    # the forked process of this test: a child of pytest's process started since the test began
    forked = [child for child in psutil.Process().children() if _started_since(child, started - 1)]
    print(f"\n{nodeid}: {CRASH_MARK} after {WATCHDOG_SECONDS:.0f} s", file=sys.__stderr__, flush=True)
    for process in forked:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGUSR1)
    time.sleep(2)  # the stacks are written
    for process in forked:
        _kill_tree(process)
    if _stacks is not None:
        _stacks.seek(0)
        print(_stacks.read(), file=sys.__stderr__, flush=True)
        _stacks.truncate(0)


def _started_since(process: psutil.Process, moment: float) -> bool:
    try:
        return process.create_time() >= moment
    except psutil.Error:
        return False


def _kill_tree(process: psutil.Process) -> None:
    try:
        family = [*process.children(recursive=True), process]
    except psutil.Error:
        family = [process]
    for member in family:
        with contextlib.suppress(psutil.Error):
            member.kill()
    psutil.wait_procs(family, timeout=5)
