"""workers.compat refuses a hivemind release it was not written for (:mod:`workers.compat.version`)."""

from __future__ import annotations

import pytest


def test_compat_refuses_a_hivemind_it_was_not_written_for() -> None:
    from workers.compat import HivemindVersionError, check_hivemind_version

    assert check_hivemind_version("1.1.12") == "1.1.12"
    assert check_hivemind_version("1.1.13") == "1.1.13"
    with pytest.raises(HivemindVersionError, match=r"hivemind 1\.2\.0 is installed"):
        check_hivemind_version("1.2.0")
