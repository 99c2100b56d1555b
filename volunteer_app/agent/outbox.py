"""Lease reports waiting to reach the coordinator, kept in a file so that none is lost.

A report is written here before it is sent, and removed only once the coordinator has answered it
(credited, or refused for good). A crash, a reboot or an unreachable coordinator therefore loses no
report. A file that cannot be read (a crash mid-write on a filesystem without atomic rename, a disk
error, a hand edit) is set aside next to it with a timestamped name, never deleted, and the agent
says where it is.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from volunteer_app.tokens import write_private_file

logger = logging.getLogger(__name__)


class Outbox:
    """A list of JSON reports in one private file.

    :param path: the file (created 0600 on first save; removed when empty).
    :param on_damaged: called with the path a damaged file was moved to.
    """

    def __init__(self, path: Path, *, on_damaged: Any = None):
        self.path = path
        self.on_damaged = on_damaged

    def load(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
                raise ValueError("not a list of reports")
        except (OSError, ValueError) as exc:
            kept = self.path.with_name(f"{self.path.stem}.damaged-{int(time.time())}{self.path.suffix}")
            self.path.replace(kept)
            logger.warning("the report outbox could not be read (%s); it was kept as %s", exc, kept)
            if self.on_damaged is not None:
                self.on_damaged(kept)
            return []
        return data

    def save(self, items: list[dict[str, Any]]) -> None:
        if not items:
            self.path.unlink(missing_ok=True)
            return
        write_private_file(self.path, json.dumps(items).encode())

    def add(self, item: dict[str, Any]) -> None:
        self.save([*self.load(), item])
