"""hivemind's expected failures logged as one line, not as a traceback.

hivemind logs some failures that are part of normal swarm life with ``logger.exception``: a peer that
left while another downloaded the model state from it ("Failed to download state from ..."), after which
hivemind simply tries the next peer. In a volunteer swarm peers vanish all the time, so these are
warnings: :func:`quiet_expected_tracebacks` keeps the message (which already names the exception) and
drops the stack trace, so that logs show tracebacks only for real faults.
"""

from __future__ import annotations

import logging

EXPECTED = {
    "hivemind.averaging.averager": ("Failed to download state from",),
}
"""Logger name -> message prefixes of failures hivemind recovers from by itself."""


class _OneLine(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and str(record.msg).startswith(self.prefixes):
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_expected_tracebacks() -> None:
    """Install the filters (idempotent)."""
    for name, prefixes in EXPECTED.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, _OneLine) for f in target.filters):
            target.addFilter(_OneLine(prefixes))
