"""What the coordinator keeps of peer sessions, and for how long.

Every join writes a session row, and a hostile volunteer may join as often as the rate limits allow: with
the profile stored as sent (64 GPUs with 200-character names, 26 KB) and every ended session kept, one
address grew the store by gigabytes an hour. Three rules bound it:

- **The stored profile is compact** (:func:`stored_profile`): only what the coordinator reads (CPU, memory,
  benchmark, up to :data:`MAX_STORED_GPUS` GPU names and sizes, the GPU count), every text clipped, at
  most :data:`STORED_PROFILE_MAX_BYTES` as stored.
- **Ended sessions go** (:func:`prune_sessions`): a re-join deletes the volunteer's older ended sessions in
  that run at once, and the sweeper deletes ended sessions after ``work.ended_session_retention``, when
  nothing that must be kept refers to them: no ledger entry (credit is never lost), no spot check, no
  revocation, no lease that is active or completed, no shard. Each volunteer keeps a session in each run
  it joined (its live or its newest one), so the run still counts it among its volunteers. Flags keep
  the deleted session's id as text.
- **Nothing adds up differently** afterwards: what a deleted session reported (samples, averaging rounds,
  bytes, epoch) and its returned and expired leases are added to its run's :class:`PrunedTotals` first,
  which the run statistics, the time series and ``/metrics`` add back.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from sqlalchemy import and_, case, delete, exists, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, aliased
from sqlalchemy.sql.elements import ColumnElement

from coordinator.models import Lease, LedgerEntry, PeerSession, PrunedTotals, Revocation, Shard, SpotCheck
from volunteer_app.protocol import HardwareProfile
from volunteer_app.states import LeaseState, SessionState

MAX_STORED_GPUS = 16
"""GPUs whose name and memory are stored (the count is stored whole); twice ``credit.max_credited_gpus``."""
_TEXT_BYTES = 64
"""Longest stored text (a CPU or GPU model, an OS name), in bytes of its JSON encoding."""
STORED_PROFILE_MAX_BYTES = 4096
"""Most bytes a stored profile takes as JSON, whatever the peer sent (typically 300-600)."""

ENDED_STATES = (SessionState.LEFT, SessionState.STOPPED, SessionState.LOST)
"""Session states that may be pruned. A lost session is only silent; pruning it makes a returning agent
join again (it does on ``session_not_found``)."""
_DEAD_LEASES = (LeaseState.RETURNED, LeaseState.EXPIRED)
"""Lease states that carry nothing: never credited, their shard back in the queue."""
PRUNE_BATCH = 500
"""Sessions deleted per call at most, so that one sweep stays a short transaction."""


def _clip(text: str, limit: int = _TEXT_BYTES) -> str:
    """``text`` cut so that its JSON encoding (what the store writes: non-ASCII characters escaped, up to
    12 bytes each) takes at most ``limit`` bytes between its quotes."""
    used = 0
    for index, char in enumerate(text):
        used += len(json.dumps(char)) - 2
        if used > limit:
            return text[:index]
    return text


def stored_profile(profile: HardwareProfile) -> dict[str, Any]:
    """The part of a peer's hardware profile the coordinator keeps with its session.

    The coordinator reads the GPU count (throughput ceilings), the benchmark (ceilings and lease
    deadlines), and the models, core counts and memory (the organizers' peer table, the leaderboard's
    devices). Drivers and CUDA capabilities are not kept, and GPUs past :data:`MAX_STORED_GPUS` only as the
    count ``gpu_count``. The result is at most :data:`STORED_PROFILE_MAX_BYTES` as JSON.
    """
    benchmark = profile.benchmark
    stored: dict[str, Any] = {
        "cpu_model": _clip(profile.cpu_model),
        "cpu_cores": profile.cpu_cores,
        "cpu_threads": profile.cpu_threads,
        "ram_bytes": profile.ram_bytes,
        "os": _clip(profile.os),
        "python": _clip(profile.python),
        "torch": _clip(profile.torch) if profile.torch is not None else None,
        "accepts_connections": profile.accepts_connections,
        "gpu_count": len(profile.gpus),
        "gpus": [
            {"name": _clip(gpu.name), "memory_bytes": gpu.memory_bytes}
            for gpu in profile.gpus[:MAX_STORED_GPUS]
        ],
        "benchmark": None,
    }
    if benchmark is not None:
        stored["benchmark"] = {
            **benchmark.model_dump(mode="json"),
            "task": _clip(benchmark.task),
            "preset": _clip(benchmark.preset) if benchmark.preset is not None else None,
        }
    return stored


def profile_gpu_count(profile: dict[str, Any]) -> int:
    """GPUs in a stored profile: its ``gpu_count``, or the listed GPUs of a profile stored before it."""
    count = profile.get("gpu_count")
    if isinstance(count, int) and count >= 0:
        return count
    return len(profile.get("gpus") or [])


# ------------------------------------------------------------------------------------------ pruning
def _prunable(ended_before: float | None) -> list[ColumnElement[bool]]:
    """Conditions under which a session row may be deleted (evaluated again by the DELETE itself, so that
    a session revived or credited meanwhile stays)."""
    conditions = [
        PeerSession.state.in_(ENDED_STATES),
        ~exists().where(LedgerEntry.session_id == PeerSession.id),
        ~exists().where(SpotCheck.session_id == PeerSession.id),
        ~exists().where(Revocation.session_id == PeerSession.id),
        ~exists().where(Lease.session_id == PeerSession.id, Lease.state.not_in(_DEAD_LEASES)),
    ]
    if ended_before is not None:
        conditions.append(func.coalesce(PeerSession.ended_at, PeerSession.last_heartbeat_at) < ended_before)
    return conditions


def prune_sessions(
    db: Session,
    *,
    ended_before: float | None,
    run_id: str | None = None,
    volunteer_id: str | None = None,
    keep: str | None = None,
    limit: int = PRUNE_BATCH,
) -> int:
    """Delete ended sessions that nothing must keep, with their returned and expired leases, adding what
    they reported to their runs' :class:`PrunedTotals`. Returns how many sessions were deleted.

    :param ended_before: only sessions that ended (or, when lost, were last heard of) before this time;
        None: whenever they ended (a re-join).
    :param run_id: only this run's sessions; with ``volunteer_id``, only that volunteer's.
    :param keep: the session to keep (a re-join's new one): every other ended session of ``volunteer_id``
        in ``run_id`` may go. Without it a session goes only when its volunteer has a live or a newer
        session in its run, so that every volunteer keeps one session in each run it joined.
    :param limit: at most this many sessions per call.
    """
    conditions = _prunable(ended_before)
    if run_id is not None:
        conditions.append(PeerSession.run_id == run_id)
    if volunteer_id is not None:
        conditions.append(PeerSession.volunteer_id == volunteer_id)
    if keep is not None:
        conditions.append(PeerSession.id != keep)
    else:
        # another session of the volunteer in the run that stays: a live one, or a newer one (ordered by
        # (created_at, id), so that of ended sessions the newest always stays)
        other = aliased(PeerSession)
        conditions.append(
            exists().where(
                other.volunteer_id == PeerSession.volunteer_id,
                other.run_id == PeerSession.run_id,
                or_(
                    other.state == SessionState.ACTIVE,
                    other.created_at > PeerSession.created_at,
                    and_(other.created_at == PeerSession.created_at, other.id > PeerSession.id),
                ),
            )
        )
    ids = list(db.scalars(select(PeerSession.id).where(*conditions).limit(limit)))
    if not ids:
        return 0
    # a dead lease that its shard still names (releasing a lease clears it, so it should not happen) keeps
    # its session; each lease's shard is found by its primary key
    named = set(
        db.scalars(
            select(Lease.session_id)
            .join(
                Shard,
                and_(
                    Shard.run_id == Lease.run_id,
                    Shard.data_epoch == Lease.data_epoch,
                    Shard.shard == Lease.shard,
                    Shard.lease_id == Lease.id,
                ),
            )
            .where(Lease.session_id.in_(ids))
        )
    )
    ids = [session_id for session_id in ids if session_id not in named]
    if not ids:
        return 0
    totals: dict[str, dict[str, Any]] = defaultdict(_no_totals)
    for run, state in db.execute(
        delete(Lease)
        .where(Lease.session_id.in_(ids), Lease.state.in_(_DEAD_LEASES))
        .returning(Lease.run_id, Lease.state)
        .execution_options(synchronize_session=False)
    ):
        totals[run]["leases_returned" if state == LeaseState.RETURNED else "leases_expired"] += 1
    deleted = db.execute(
        delete(PeerSession)
        .where(PeerSession.id.in_(ids), *_prunable(ended_before))
        .returning(
            PeerSession.run_id,
            PeerSession.samples_total,
            PeerSession.averaging_rounds,
            PeerSession.bytes_sent,
            PeerSession.bytes_received,
            PeerSession.global_epoch,
        )
        .execution_options(synchronize_session=False)
    ).all()
    for run, samples, rounds, sent, received, epoch in deleted:
        added = totals[run]
        added["sessions"] += 1
        added["samples_total"] += float(samples or 0)
        added["averaging_rounds"] += float(rounds or 0)
        added["bytes"] += float(sent or 0) + float(received or 0)
        added["global_epoch"] = max(added["global_epoch"], int(epoch or 0))
    for run, added in totals.items():
        _add_totals(db, run_id=run, added=added)
    db.expire_all()  # the ORM's copies of deleted rows are stale
    return len(deleted)


def _no_totals() -> dict[str, Any]:
    return {
        "sessions": 0,
        "leases_returned": 0,
        "leases_expired": 0,
        "samples_total": 0.0,
        "averaging_rounds": 0.0,
        "bytes": 0.0,
        "global_epoch": 0,
    }


def _add_totals(db: Session, *, run_id: str, added: dict[str, Any]) -> None:
    """Add to a run's pruned totals in one statement (an upsert: the sweeper and a join may both prune)."""
    insert = postgresql.insert if db.get_bind().dialect.name == "postgresql" else sqlite.insert
    statement = insert(PrunedTotals).values(run_id=run_id, **added)
    sums = {
        name: getattr(PrunedTotals, name) + statement.excluded[name]
        for name in added
        if name != "global_epoch"
    }
    epoch = case(
        (PrunedTotals.global_epoch < statement.excluded.global_epoch, statement.excluded.global_epoch),
        else_=PrunedTotals.global_epoch,
    )
    db.execute(
        statement.on_conflict_do_update(index_elements=["run_id"], set_={**sums, "global_epoch": epoch})
    )


def pruned_totals(db: Session, *, run_id: str) -> PrunedTotals:
    """What a run's deleted sessions had added to its totals (zeros when none were deleted)."""
    totals = db.get(PrunedTotals, run_id)
    if totals is not None:
        return totals
    return PrunedTotals(run_id=run_id, **_no_totals())
