"""hivemind 1.1.12's own tests for the parts :mod:`workers.compat` replaces, laid out to run with our plugin.

The test files come from hivemind's source distribution on PyPI, downloaded once into a cache and checked
against :data:`SDIST_SHA256`; the two helpers the sdist lacks are copied in from this folder (README.md).
"""

from __future__ import annotations

import os
import shutil
import tarfile
import urllib.request
from pathlib import Path

from volunteer_app.digests import file_sha256

SDIST_URL = (
    "https://files.pythonhosted.org/packages/60/41/1aac9b64f9aa174dd8ff03a997df52c9652e9326b376f1f4eaa066e6a358/"
    "hivemind-1.1.12.tar.gz"
)
SDIST_SHA256 = "11750accdc82421f3b37a920b8fb745d3e5add0187a774f7f217b46fa74fa984"
TEST_FILES = (
    "test_allreduce_fault_tolerance.py",  # allreduce.py's AllReduceRunner with failing peers
    "test_averaging.py",  # averager.py, key_manager.py, matchmaking: all-reduce rounds, state downloads
    "test_optimizer.py",  # optim/: the gradient and state averagers and Optimizer, averaging as workers do
)
"""The files that run what :func:`workers.compat.install` replaces. Not ``test_allreduce.py``: it tests
``partition.py``'s classes under their own names (``install`` replaces the names ``AllReduceRunner`` builds
from), and its one all-reduce test is skipped upstream ("freezes in CI")."""
DESELECTED = ("test_optimizer.py::test_progress_tracker",)
"""Tests of those files that run nothing :func:`workers.compat.install` replaces (the progress tracker is
changed per object, by :class:`workers.compat.GuardedOptimizer`, never process-wide)."""
HERE = Path(__file__).resolve().parent
PYTEST_INI = """[pytest]
asyncio_default_fixture_loop_scope = function
timeout = 120
timeout_func_only = true
"""
"""pytest-timeout's alarm (in the forked test process, while the test function runs) comes before
``install_compat``'s watchdog (:data:`install_compat.WATCHDOG_SECONDS`, the whole forked process)."""


class UpstreamUnavailable(Exception):
    """The sdist could not be downloaded (offline) or did not match its pin."""


def cache_dir() -> Path:
    return Path(os.environ.get("VOLUNTEER_TEST_CACHE", Path.home() / ".cache" / "volunteer-app-tests"))


def sdist() -> Path:
    """The pinned sdist, downloaded into :func:`cache_dir` the first time."""
    path = cache_dir() / "hivemind-1.1.12.tar.gz"
    if path.exists() and file_sha256(path) == SDIST_SHA256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    try:
        with urllib.request.urlopen(SDIST_URL, timeout=60) as answer, open(partial, "wb") as out:
            shutil.copyfileobj(answer, out)
    except OSError as exc:
        raise UpstreamUnavailable(f"could not download {SDIST_URL}: {exc}") from exc
    if (digest := file_sha256(partial)) != SDIST_SHA256:
        partial.unlink()
        raise UpstreamUnavailable(f"{SDIST_URL} has SHA-256 {digest}, not the pinned {SDIST_SHA256}")
    partial.replace(path)
    return path


def lay_out(dest: Path) -> list[str]:
    """Write hivemind's test files, its conftest and helpers, our plugin and a pytest.ini into ``dest``;
    returns the test files' names."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist()) as archive:
        for name in TEST_FILES:
            member = archive.extractfile(f"hivemind-1.1.12/tests/{name}")
            assert member is not None, name
            (dest / name).write_bytes(member.read())
    shutil.copy(HERE / "conftest_upstream.py", dest / "conftest.py")
    shutil.copytree(HERE / "test_utils", dest / "test_utils", dirs_exist_ok=True)
    shutil.copy(HERE / "install_compat.py", dest / "install_compat.py")
    (dest / "pytest.ini").write_text(PYTEST_INI)
    return list(TEST_FILES)
