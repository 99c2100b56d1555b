"""A pytest plugin for hivemind's own tests: every process-wide replacement of :mod:`workers.compat` applied.

``tests/workers/compat/test_hivemind_upstream.py`` runs hivemind 1.1.12's tests with ``-p install_compat``.
:func:`workers.compat.install` runs once, in pytest's process, before any test: the forked test processes and
the averager and DHT processes they start inherit the replacements, as a worker's do.
"""

from __future__ import annotations

import pytest
from hivemind.averaging import allreduce

from workers import compat


def pytest_configure(config: pytest.Config) -> None:
    compat.install()


def pytest_report_header(config: pytest.Config) -> str:
    """The line the runner looks for: proof that these tests ran on the replacements."""
    reducer = allreduce.TensorPartReducer.__name__
    return f"workers.compat installed: hivemind's all-reduce reduces with {reducer}"
