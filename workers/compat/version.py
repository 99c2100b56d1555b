"""The hivemind release this package was written for, and the checks that the installed one still fits it.

A private attribute of hivemind may change meaning without changing name, so :func:`check_hivemind_version`
refuses a hivemind whose major.minor differs from :data:`WRITTEN_FOR` (the pin in ``pyproject.toml`` says the
same). It runs when this module is imported, and every other module of :mod:`workers.compat` imports it before
it subclasses or patches anything. :func:`require` checks that what a module touches still exists, so that a
mismatch fails at start-up, not mid-training.
"""

from __future__ import annotations

import logging
from typing import Any

import hivemind

logger = logging.getLogger(__name__)


WRITTEN_FOR = "1.1.12"
"""The hivemind release whose internals this package was written against (and tested with)."""


class HivemindVersionError(RuntimeError):
    """The installed hivemind is not the release this package's patches were written for."""


def check_hivemind_version(installed: str | None = None) -> str:
    """Refuse a hivemind whose major.minor differs from :data:`WRITTEN_FOR`; returns the installed version.

    Patch releases are accepted (1.1.x), with a log line when they differ from the tested one.
    """
    installed = installed or str(getattr(hivemind, "__version__", "unknown"))
    if installed.split(".")[:2] != WRITTEN_FOR.split(".")[:2]:
        raise HivemindVersionError(
            f"hivemind {installed} is installed, but volunteer-app's worker reaches into internals of hivemind "
            f"{WRITTEN_FOR} (workers/compat/); install 'hivemind>=1.1.12,<1.2'"
        )
    if installed != WRITTEN_FOR:
        logger.info("hivemind %s; workers/compat/ was tested with %s", installed, WRITTEN_FOR)
    return installed


def require(owner: Any, *names: str) -> None:
    """Raise :class:`HivemindVersionError` unless ``owner`` has every attribute in ``names``."""
    missing = [name for name in names if not hasattr(owner, name)]
    if missing:
        raise HivemindVersionError(
            f"hivemind {getattr(hivemind, '__version__', '?')} lacks {', '.join(missing)} on "
            f"{getattr(owner, '__name__', type(owner).__name__)}; workers/compat/ needs updating"
        )


check_hivemind_version()
