"""Terminal output for ``join`` and ``demo``: a live rich panel for people, JSON lines for machines.

The panel shows the agents' state; the lines above it are the agents' messages. Most of those are worth a
line (a peer joined, an evaluation, an error, a failed step or restart), but a contribution also reports
every lease it finishes: a line every few seconds per peer, hundreds in a demo, which push everything else
off the screen. :func:`is_routine` picks those out, and a :class:`LiveDisplay` made with ``verbose=False``
(the demo's default) leaves them out; JSON lines keep every message, since scripts read them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from volunteer_app.control import WAITING_MESSAGES
from volunteer_app.protocol import UNVERIFIED_REASON_PREFIX
from volunteer_app.safetext import clean

# What a row shows: a ContributionState (pydantic) or anything with the same attributes.
AgentStatus = Any


def status_dict(status: Any) -> dict[str, Any]:
    """One contribution's status as JSON-ready data (``status`` and ``summary`` lines), without the profile."""
    data = dict(status.model_dump(mode="json"))
    data.pop("profile", None)
    return data


def human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


STATE_STYLES = {
    "training": "bold green",
    "paused": "yellow",
    "waiting": "yellow",
    "syncing": "cyan",
    "stopping": "magenta",
    "stopped": "dim",
    "failed": "bold red",
    "restarting": "red",
}


def agents_table(statuses: Sequence[AgentStatus]) -> Table:
    """One row per agent; fits an 80-column terminal (bytes and failed rounds go to the caption)."""
    table = Table(expand=True, show_edge=False, header_style="bold", pad_edge=False)
    columns = (("peer", "left", 6), ("state", "left", 8), ("samples", "right", 7), ("/s", "right", 4),
               ("loss", "right", 9), ("epoch", "right", 5), ("lease", "left", 6), ("credited", "right", 8))  # fmt: skip
    for name, justify, width in columns:
        table.add_column(name, justify=justify, min_width=width, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]
    for s in statuses:
        lease = (
            ProgressBar(total=max(1, s.lease_samples), completed=s.lease_samples_done, width=6)
            if s.lease_samples
            else Text("-")
        )
        loss = f"{s.loss:.3f}" if s.loss is not None else "-"
        if s.first_loss is not None and s.loss is not None:
            loss = f"{s.first_loss:.2f}→{s.loss:.2f}"
        state = "offline" if not s.coordinator_ok and s.state == "training" else s.state
        table.add_row(
            s.name,
            Text(state, style=STATE_STYLES.get(s.state, "")),
            human(s.samples_total),
            f"{s.samples_per_second:.0f}",
            loss,
            f"{s.local_epoch}/{s.global_epoch}",
            lease,
            human(s.samples_credited),
        )
    sent = sum(s.bytes_sent for s in statuses)
    failed = sum(s.failed_rounds for s in statuses)
    paused = [s.name for s in statuses if s.state == "paused" and s.paused_by]
    swarm = max((s.swarm_size for s in statuses), default=0)
    rounds = max((s.averaging_rounds for s in statuses), default=0)
    notes = [f"swarm of {swarm}", f"{rounds} averaging rounds ({human_bytes(sent)} sent)"]
    if failed:
        notes.append(f"{failed} without a group")
    if paused:
        notes.append(f"paused by the {statuses[0].paused_by}: {', '.join(paused)}")
    table.caption = " · ".join(notes)
    return table


_LEASE_CREDITED = re.compile(r"lease \S+ credited: \d+ samples(?: \((?P<notes>.*)\))?")
"""``volunteer_app.agent.leases``' line for a credited lease, with its notes in parentheses: "awaiting the
swarm's confirmation", "flagged: REASON; REASON" (the coordinator's reasons, ``; ``-separated)."""
ROUTINE_MESSAGES = frozenset(
    {
        WAITING_MESSAGES["confirmation"],
        "the coordinator has work for this machine again",  # LeaseKeeper, when that wait ends
    }
)
"""Whole messages that are part of the routine lease cycle: a peer faster than the swarm's confirmations
waits for them, and takes work again, once per lease or so (the panel shows the peer "waiting")."""


def is_routine(text: str) -> bool:
    """Whether an agent's message is routine lease bookkeeping, shown only with ``--verbose``.

    Routine: a lease credited with nothing flagged but "awaiting the swarm's confirmation" (the
    coordinator credits a lease before its swarm peer has read the progress records that confirm it; the
    older wording of the same note is "flagged: unverified: ..."), and the wait for those confirmations
    (:data:`ROUTINE_MESSAGES`). Everything else is shown: joins, worker start-up, evaluations, errors,
    restarts, refusals, a lease that was not credited or whose claim the coordinator flagged for another
    reason (capped, heartbeats that claimed too much). Unknown text counts as worth showing, so that a new
    warning is never hidden by default.
    """
    if text in ROUTINE_MESSAGES:
        return True
    credited = _LEASE_CREDITED.fullmatch(text)
    if credited is None:
        return False
    notes = credited["notes"] or ""
    flagged = notes.split("flagged: ", 1)[1] if "flagged: " in notes else ""
    return all(reason.startswith(UNVERIFIED_REASON_PREFIX) for reason in flagged.split("; ") if reason)


class LiveDisplay:
    """A rich live panel of agents, with messages scrolling above it.

    :param plain: no panel redrawn in place; a progress line every ``plain_every`` seconds instead, for
      logs, serial consoles and terminals that cannot redraw (``demo --headless``).
    :param verbose: show every message; False leaves out the routine ones (:func:`is_routine`, one per
      lease), so that the lines above the panel are the events a person watching wants to see. The panel's
      footer then counts what was left out (``plain``: a line says so once). Whoever makes the display
      keeps its own log of every line.
    """

    def __init__(
        self,
        title: str,
        console: Console | None = None,
        *,
        plain: bool = False,
        plain_every: float = 15.0,
        verbose: bool = True,
    ):
        self.title = title
        self.console = console or Console(stderr=False)
        self.footer: str = ""
        self.plain = plain
        self.plain_every = plain_every
        self.verbose = verbose
        self.hidden = 0
        """Routine messages left out so far."""
        self._last_line: float | None = None
        self._last_footer = ""
        self._live: Live | None = None
        self._statuses: Sequence[AgentStatus] = ()

    def __enter__(self) -> LiveDisplay:
        if self.plain:
            self.console.print(Text(self.title, style="bold"))
            return self
        self._live = Live(self._render(), console=self.console, refresh_per_second=2, transient=False)
        self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(*exc)

    def message(self, text: str, *, who: str | None = None) -> None:
        """Print a message above the panel, unless it is routine and the display is not verbose."""
        if not self.verbose and is_routine(text):
            self.hidden += 1
            if self.plain and self.hidden == 1:  # no footer to count them in: say it once
                self.message(
                    "routine lease lines (one per credited lease) are not shown: --verbose shows them"
                )
            return
        stamp = time.strftime("%H:%M:%S")
        prefix = f"[dim]{stamp}[/dim] " + (f"[bold]{who}[/bold] " if who else "")
        self.console.print(prefix + Text(clean(text)).markup, highlight=False)

    def update(self, statuses: Sequence[AgentStatus], footer: str = "") -> None:
        self._statuses, self.footer = statuses, footer
        if self._live is not None:
            self._live.update(self._render())
        elif (
            self.plain
            and statuses
            and (self._last_line is None or time.monotonic() - self._last_line >= self.plain_every)
        ):
            self._last_line = time.monotonic()
            # the footer (addresses, "Ctrl-C stops") once, and again only when it changes
            news = f" · {footer}" if footer and footer != self._last_footer else ""
            self._last_footer = footer
            self.message(progress_line(statuses) + news)

    def _render(self) -> Panel:
        parts: list[Any] = [agents_table(self._statuses)]
        footer = self.footer
        if self.hidden:
            lines = "line" if self.hidden == 1 else "lines"
            footer = f"{footer}  ·  " if footer else ""
            footer += f"{self.hidden} lease {lines} not shown (--verbose shows them)"
        if footer:
            parts.append(Text(footer, style="dim"))
        return Panel(Group(*parts), title=self.title, border_style="blue")


def progress_line(statuses: Sequence[AgentStatus]) -> str:
    """The agents in one line: samples, speed, loss, averaging rounds (``demo --headless``)."""
    samples = sum(s.samples_total for s in statuses)
    speed = sum(s.samples_per_second for s in statuses)
    losses = [s.loss for s in statuses if s.loss is not None]
    rounds = max((s.averaging_rounds for s in statuses), default=0)
    failed = max((s.failed_rounds for s in statuses), default=0)
    states = sorted({s.state for s in statuses})
    loss = f"lowest loss {min(losses):.3f}" if losses else "loss -"
    return (
        f"{len(statuses)} peers {'/'.join(states)} · {human(samples)} samples · {speed:.0f} samples/s · {loss} · "
        f"{rounds} averaging rounds ({failed} failed)"
    )


class JsonLines:
    """One JSON object per line on stdout: ``message``, ``status`` and ``summary`` events."""

    def __init__(self) -> None:
        self._last_status = 0.0
        self.closed = False  # the reader went away (``| head``, a dead parent): nothing more is written

    def emit(self, event: str, **fields: Any) -> None:
        if self.closed:
            return
        try:
            sys.stdout.write(
                json.dumps({"event": event, "time": round(time.time(), 3), **fields}, default=str) + "\n"
            )
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            self.closed = True
            # point stdout at /dev/null so that the interpreter's final flush cannot fail again
            with contextlib.suppress(OSError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())

    def message(self, text: str, *, who: str | None = None) -> None:
        self.emit("message", text=text, **({"peer": who} if who else {}))

    def status(self, statuses: Sequence[AgentStatus], *, every: float = 5.0, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_status < every:
            return
        self._last_status = now
        for s in statuses:
            self.emit("status", **status_dict(s))
