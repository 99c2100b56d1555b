"""The lease keeper: keeps the worker stocked with work and reports the work it finishes.

The worker holds up to :data:`MAX_LEASES` leases (the shard it trains and the next one, so that it
never waits between shards). Finished leases are reported through the :class:`Outbox` (written before
sending, removed once answered), so a report survives an unreachable coordinator and a crash. While
the coordinator is unreachable and the worker has nothing leased, it gets an *offline* lease: an
unleased shard of its own choosing, so that the swarm keeps this peer's compute; that work is not
credited and the volunteer is told so.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable, Callable

from pydantic import BaseModel

from volunteer_app.agent.clock import Clock
from volunteer_app.agent.link import CoordinatorLink, backoff_delay
from volunteer_app.agent.outbox import LeaseReport, Outbox
from volunteer_app.client import CoordinatorRefused, CoordinatorUnreachable
from volunteer_app.control import WAITING_MESSAGES, ContributionState
from volunteer_app.protocol import (
    UNVERIFIED_REASON_PREFIX,
    LeaseCompleteRequest,
    LeaseCompleteResponse,
    LeaseOut,
    TrainingFigures,
)
from volunteer_app.worker_protocol import DropLeaseCommand, LeaseCommand, LeaseDoneEvent

MAX_LEASES = 2
RETURN_MARGIN_SECONDS = 30.0
"""While paused, a lease is given back once finishing it at the usual speed would end this close to (or
past) its deadline, rather than left to expire."""
TOO_MANY_LEASES_RETRY_SECONDS = 30.0
"""How long to wait before asking again when the coordinator says this session holds its maximum of leases
while fewer are in hand here."""
OFFLINE_LEASE_PREFIX = "offline-"


def credited_message(answer: LeaseCompleteResponse) -> str:
    """The line a credited lease gets: what was credited and, in parentheses, what is still open about it.

    The coordinator credits a lease at once but confirms it only when its swarm peer has read this peer's
    signed progress records for the time of the lease (every few seconds), so an honest peer's first leases
    are usually credited before they are confirmed. That is said as "awaiting the swarm's confirmation", not
    as a flag: a volunteer should not read "flagged" for doing everything right. The coordinator's other
    reasons (a claim larger than the shard or than this device trains, heartbeats that claimed too much)
    follow "flagged:", and a spot check is announced as such.
    """
    reasons = [
        reason
        for reason in (answer.reason or "").split("; ")
        if reason and not reason.startswith(UNVERIFIED_REASON_PREFIX)
    ]
    notes = []
    if not answer.verified:
        notes.append("awaiting the swarm's confirmation")
    if answer.pending_check:
        notes.append("picked for a spot check, counted in the ranking once it passes")
    if answer.flagged and reasons:
        notes.append("flagged: " + "; ".join(reasons))
    shown = f" ({'; '.join(notes)})" if notes else ""
    return f"lease {answer.lease_id[:8]} credited: {answer.credited_samples} samples{shown}"


class LeaseKeeper:
    """Takes leases for one session and reports them.

    :param link: the coordinator link. :param outbox: where reports wait.
    :param send: hands a lease to the worker (returns False when the worker is gone).
    :param status: the contribution's state (credited samples, leases completed...), updated in place.
    :param on_refused: a refusal that ends or changes the session (the contribution decides).
    :param on_run_finished: the run has no more work.
    """

    def __init__(
        self,
        *,
        link: CoordinatorLink,
        outbox: Outbox,
        coordinator: str,
        clock: Clock,
        status: ContributionState,
        send: Callable[[BaseModel], Awaitable[bool]],
        on_message: Callable[[str], None],
        on_refused: Callable[[CoordinatorRefused], Awaitable[None]],
        on_run_finished: Callable[[], None],
    ):
        self.link = link
        self.outbox = outbox
        self.coordinator = coordinator
        self.clock = clock
        self.status = status
        self.send = send
        self.on_message = on_message
        self.on_refused = on_refused
        self.on_run_finished = on_run_finished
        self.session_id: str | None = None
        self.outstanding: dict[str, LeaseOut] = {}
        self.wanted = asyncio.Event()
        self.taking = True
        self._offline_pending = False
        self._waiting_for: str | None = None
        # the outbox file is read, sent and rewritten by flush(); a report added meanwhile must not be lost
        self._outbox_lock = asyncio.Lock()

    def reset(self, session_id: str, first: LeaseOut | None) -> None:
        """A new session: its first lease (from the join answer) is the only one in hand."""
        self.session_id = session_id
        self.outstanding = {first.lease_id: first} if first is not None else {}
        self._offline_pending = False
        self._waiting_for = None
        self._update_status()

    def leases(self) -> list[LeaseOut]:
        return list(self.outstanding.values())

    def _update_status(self) -> None:
        self.status.leases_in_hand = len(self.outstanding)

    async def run(self, stop: asyncio.Event) -> None:
        """Keep up to MAX_LEASES leases in hand until ``stop`` is set (or the session ends)."""
        self.wanted.set()
        while not stop.is_set():
            await self.wanted.wait()
            self.wanted.clear()
            while self.taking and len(self.outstanding) < MAX_LEASES and not stop.is_set():
                if not await self._take_one(stop):
                    break

    async def _take_one(self, stop: asyncio.Event) -> bool:
        assert self.session_id is not None
        session = self.session_id
        try:
            answer = await self.link.once(lambda: self.link.client.take_lease(session))
        except CoordinatorUnreachable:
            if not self.outstanding and not self._offline_pending:
                await self._send_offline_lease()
            await self.clock.wait(stop, backoff_delay(2, initial=2.0))
            self.wanted.set()
            return False
        except CoordinatorRefused as exc:
            if exc.code == "too_many_leases":
                # the coordinator counts leases of this session that this agent no longer holds (a reply
                # lost on the way): they come free at their deadline, so ask again now and then
                await self.clock.wait(stop, TOO_MANY_LEASES_RETRY_SECONDS)
                self.wanted.set()
                return False
            if exc.status == 429:
                await self.clock.wait(stop, exc.retry_after or 10.0)
                self.wanted.set()
                return False
            await self.on_refused(exc)
            return False
        if answer.lease is None:
            if answer.run_state == "finished":
                self.on_run_finished()
                return False
            self._say_why_waiting(answer.waiting_for)
            await self.clock.wait(stop, answer.retry_after or 30.0)
            self.wanted.set()
            return False
        if self._waiting_for is not None:
            self.on_message("the coordinator has work for this machine again")
            self._waiting_for = None
        self.outstanding[answer.lease.lease_id] = answer.lease
        self._update_status()
        await self.send(LeaseCommand(lease=answer.lease))
        return True

    def _say_why_waiting(self, waiting_for: str | None) -> None:
        """Tell the volunteer once why no work comes (not on every retry); a paused run says so itself."""
        if waiting_for == self._waiting_for or waiting_for not in WAITING_MESSAGES:
            return
        self._waiting_for = waiting_for
        self.on_message(WAITING_MESSAGES[waiting_for])

    async def return_due(
        self, *, samples_per_second: float = 0.0, margin: float = RETURN_MARGIN_SECONDS
    ) -> int:
        """Give back every lease in hand that can no longer be finished in time.

        A lease is due when the time it still needs at ``samples_per_second`` (this peer's recent speed; 0:
        unknown, only the margin counts) plus ``margin`` seconds no longer fits before its deadline.

        Called while the volunteer is paused: the shard goes back to the queue for another peer instead of
        sitting unfinished until it expires, and the worker forgets it. Samples already trained on it still
        went into the shared model; they are counted as unleased (shards are credited whole). Returns how
        many leases were given back; one the coordinator cannot be told about yet is tried again later.
        """
        if self.session_id is None:
            return 0
        session, now, returned = self.session_id, self.clock.time(), 0
        for lease in list(self.outstanding.values()):
            done = self.status.lease_samples_done if self.status.lease_id == lease.lease_id else 0
            needed = max(0, lease.samples - done) / samples_per_second if samples_per_second > 0 else 0.0
            if lease.deadline - now >= needed + margin:
                continue
            try:
                await self.link.once(
                    lambda lease=lease: self.link.client.return_lease(session, lease.lease_id)  # type: ignore[misc]
                )
            except CoordinatorUnreachable:
                continue
            except CoordinatorRefused as exc:
                if exc.code == "lease_completed" or exc.status == 429:
                    continue
                # lease_not_found: the coordinator has already let it go (session ended, expired)
            self.outstanding.pop(lease.lease_id, None)
            await self.send(DropLeaseCommand(lease_id=lease.lease_id))
            if done:
                self.status.samples_unleased += done
                self.status.lease_id, self.status.lease_samples_done = None, 0
            returned += 1
            self.on_message(
                f"paused past the deadline of lease {lease.lease_id[:8]} (shard {lease.shard}): "
                f"gave it back to the coordinator; {done} samples trained on it count as uncredited"
            )
        self._update_status()
        return returned

    async def _send_offline_lease(self) -> None:
        now = self.clock.time()
        lease = LeaseOut(
            lease_id=f"{OFFLINE_LEASE_PREFIX}{uuid.uuid4().hex[:12]}",
            shard=-1,
            data_epoch=0,
            samples=0,
            seed=random.randrange(2**31),
            issued_at=now,
            deadline=now + 3600,
        )
        self._offline_pending = True
        if self.status.samples_unleased == 0:
            self.on_message(
                "the coordinator is unreachable: training on unleased data (not credited) until it is back"
            )
        await self.send(LeaseCommand(lease=lease))

    async def finished(self, event: LeaseDoneEvent) -> None:
        """The worker finished a lease: report it (through the outbox) and ask for the next."""
        if event.lease_id.startswith(OFFLINE_LEASE_PREFIX):
            self._offline_pending = False
            self.status.samples_unleased += event.samples
        else:
            self.outstanding.pop(event.lease_id, None)
            self._update_status()
            assert self.session_id is not None
            async with self._outbox_lock:
                self.outbox.add(
                    LeaseReport(
                        coordinator=self.coordinator,
                        session_id=self.session_id,
                        lease_id=event.lease_id,
                        report=LeaseCompleteRequest(
                            samples=event.samples,
                            compute_seconds=event.compute_seconds,
                            loss=TrainingFigures.of(event).loss,  # a non-finite loss is reported as none
                        ),
                    )
                )
            await self.flush()
        self.wanted.set()

    async def flush(self) -> None:
        """Send every waiting report of this coordinator; keep those that cannot be sent yet."""
        async with self._outbox_lock:
            await self._flush()

    async def _flush(self) -> None:
        items = self.outbox.load()
        if not items:
            return
        kept = []
        for item in items:
            if item.coordinator != self.coordinator:
                kept.append(item)
                continue
            try:
                answer = await self.link.once(
                    lambda item=item: self.link.client.complete_lease(  # type: ignore[misc]
                        item.session_id, item.lease_id, item.report
                    )
                )
            except CoordinatorUnreachable:
                kept.append(item)
                continue
            except CoordinatorRefused as exc:
                if exc.status == 429 or exc.code == "lease_too_early":
                    # too many requests, or reported before the coordinator believes the shard could be
                    # trained on this device class: the report waits and goes again (every heartbeat)
                    kept.append(item)
                    continue
                self.on_message(f"lease {item.lease_id[:8]} was not credited: {exc.detail}")
                continue
            if not answer.already_completed:
                self.status.leases_completed += 1
                self.status.samples_credited += answer.credited_samples
                self.on_message(credited_message(answer))
        self.outbox.save(kept)
