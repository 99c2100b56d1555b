"""The network lab's fixture: a fresh :class:`tests.net.lab.Lab` per test, torn down even when the test fails."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.net.lab import Lab, missing


@pytest.fixture
def lab() -> Iterator[Lab]:
    reason = missing()
    if reason:
        if os.environ.get("VOLUNTEER_REQUIRE_NET") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    with Lab() as made:
        yield made
