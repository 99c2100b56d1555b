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

from pydantic import BaseModel, ValidationError, model_validator

from volunteer_app.protocol import LeaseCompleteRequest
from volunteer_app.tokens import write_private_file

logger = logging.getLogger(__name__)


class LeaseReport(BaseModel):
    """One finished lease's report, waiting for its coordinator to answer it."""

    coordinator: str
    session_id: str
    lease_id: str
    report: LeaseCompleteRequest

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, data: Any) -> Any:
        # outbox files written before the report was typed hold its fields beside the lease's
        if isinstance(data, dict) and "report" not in data and "samples" in data:
            report = {k: data[k] for k in ("samples", "compute_seconds", "loss") if k in data}
            return {**{k: v for k, v in data.items() if k not in report}, "report": report}
        return data


class Outbox:
    """The waiting :class:`LeaseReport` list, in one private JSON file.

    :param path: the file (created 0600 on first save; removed when empty).
    :param on_damaged: called with the path a damaged file was moved to.
    :param on_unreadable: called with each report that is dropped because it does not parse.
    """

    def __init__(self, path: Path, *, on_damaged: Any = None, on_unreadable: Any = None):
        self.path = path
        self.on_damaged = on_damaged
        self.on_unreadable = on_unreadable

    def load(self) -> list[LeaseReport]:
        """The waiting reports; a report that does not parse is logged and left out (the rest stay)."""
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
        reports = []
        for item in data:
            try:
                reports.append(LeaseReport.model_validate(item))
            except ValidationError:
                logger.warning("dropped an unreadable report from the outbox: %s", str(item)[:120])
                if self.on_unreadable is not None:
                    self.on_unreadable(item)
        return reports

    def save(self, items: list[LeaseReport]) -> None:
        if not items:
            self.path.unlink(missing_ok=True)
            return
        write_private_file(self.path, json.dumps([item.model_dump(mode="json") for item in items]).encode())

    def add(self, item: LeaseReport) -> None:
        self.save([*self.load(), item])
