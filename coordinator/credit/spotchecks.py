"""Proof-of-training spot checks: the coordinator's side.

When a lease is completed, :func:`maybe_sample` picks it for a check with probability
``credit.spot_check_fraction`` (``flagged_spot_check_fraction`` for a volunteer who already failed one),
from an unpredictable random source, and records a pending check with everything needed to redo a piece
of the work: the shard, the lease's shuffle seed, the peer's micro-batch size, the loss the peer reported
and the swarm epoch it was at. The credit of a lease under check is *pending*: counted, shown, not ranked.

The run's swarm peer (``coordinator/swarm/``, the only coordinator process with torch) does the check
(:class:`coordinator.swarm.spotchecker.SpotChecker`):

    with store.write() as db:
        checks = spotchecks.claim_pending(db, run_id=run_id, now=time.time(), settings=settings, limit=1)
    for check in checks:   # a PendingCheck: shard, seed, micro_batch_size, reported_loss, model_epoch, ...
        recomputed = ...   # the loss of the shard's first micro-batches on the shared model
        control, untrained = ...  # the same on control data, and on an untrained model (see judge_loss)
        passed, detail = spotchecks.judge_loss(check.reported_loss, recomputed, control=control,
                                               untrained=untrained)
        with store.write() as db:
            spotchecks.record_verdict(db, check_id=check.check_id, passed=passed, detail=detail,
                                      recomputed_loss=recomputed, now=time.time())

A failed check removes the lease's credit (the ledger keeps the claim), sends the shard back to the
queue, flags the volunteer and raises the share of its later leases that are checked. A passed check
settles the credit and, for a claim the swarm had not confirmed, verifies it. A check nobody decides
within ``spot_check_timeout`` expires and the credit settles as it stands, so a coordinator without a
checker never holds credit back for long.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from coordinator.accounts.authority import new_id
from coordinator.credit import flags
from coordinator.credit.ledger import mark_verified
from coordinator.errors import Conflict, NotFound
from coordinator.models import Lease, LedgerEntry, PeerSession, Shard, SpotCheck
from coordinator.settings import CoordinatorSettings
from volunteer_app.states import ShardState, SpotCheckState

_SYSTEM_RANDOM = random.SystemRandom()


@dataclass(frozen=True)
class PendingCheck:
    """One check for the swarm peer to run: redo ``shard`` of ``data_epoch`` shuffled with ``seed`` in
    micro-batches of ``micro_batch_size`` and compare the loss with ``reported_loss``."""

    check_id: str
    run_id: str
    lease_id: str
    session_id: str
    volunteer_id: str
    peer_public_key: str
    data_epoch: int
    shard: int
    seed: int
    samples: int
    micro_batch_size: int
    reported_loss: float | None
    model_epoch: int | None
    created_at: float


def failed_checks(db: Session, *, volunteer_id: str) -> int:
    return int(
        db.scalar(
            select(func.count())
            .select_from(SpotCheck)
            .where(SpotCheck.volunteer_id == volunteer_id, SpotCheck.state == SpotCheckState.FAILED)
        )
        or 0
    )


def maybe_sample(
    db: Session,
    *,
    lease: Lease,
    session: PeerSession,
    reported_loss: float | None,
    settings: CoordinatorSettings,
    now: float,
    rng: random.Random | None = None,
) -> SpotCheck | None:
    """Pick ``lease`` for a spot check, or not. Returns the new pending check when picked."""
    fraction = settings.credit.spot_check_fraction
    if settings.credit.flagged_spot_check_fraction > fraction and failed_checks(
        db, volunteer_id=lease.volunteer_id
    ):
        fraction = settings.credit.flagged_spot_check_fraction
    if fraction <= 0 or (rng or _SYSTEM_RANDOM).random() >= fraction:
        return None
    assignment = session.assignment or {}
    check = SpotCheck(
        id=new_id(),
        run_id=lease.run_id,
        lease_id=lease.id,
        session_id=session.id,
        volunteer_id=lease.volunteer_id,
        data_epoch=lease.data_epoch,
        shard=lease.shard,
        seed=lease.seed,
        samples=lease.samples,
        micro_batch_size=int(assignment.get("micro_batch_size") or 16),
        reported_loss=reported_loss if reported_loss is not None and math.isfinite(reported_loss) else None,
        model_epoch=session.dht_epoch,
        state=SpotCheckState.PENDING,
        created_at=now,
    )
    db.add(check)
    return check


def claim_pending(
    db: Session, *, run_id: str, now: float, settings: CoordinatorSettings, limit: int = 1
) -> list[PendingCheck]:
    """Hand the oldest pending checks of a run to its checker (they become ``running``). A check claimed
    more than a tenth of ``spot_check_timeout`` ago without a verdict is offered again."""
    stale = now - settings.credit.spot_check_timeout / 10
    rows = db.execute(
        select(SpotCheck, PeerSession.peer_public_key)
        .join(PeerSession, PeerSession.id == SpotCheck.session_id)
        .where(
            SpotCheck.run_id == run_id,
            (SpotCheck.state == SpotCheckState.PENDING)
            | ((SpotCheck.state == SpotCheckState.RUNNING) & (SpotCheck.claimed_at < stale)),
        )
        .order_by(SpotCheck.created_at, SpotCheck.id)
        .limit(max(1, limit))
    ).all()
    claimed = []
    for check, peer_public_key in rows:
        check.state = SpotCheckState.RUNNING
        check.claimed_at = now
        claimed.append(
            PendingCheck(
                check_id=check.id,
                run_id=check.run_id,
                lease_id=check.lease_id,
                session_id=check.session_id,
                volunteer_id=check.volunteer_id,
                peer_public_key=peer_public_key,
                data_epoch=check.data_epoch,
                shard=check.shard,
                seed=check.seed,
                samples=check.samples,
                micro_batch_size=check.micro_batch_size,
                reported_loss=check.reported_loss,
                model_epoch=check.model_epoch,
                created_at=check.created_at,
            )
        )
    return claimed


def record_verdict(
    db: Session,
    *,
    check_id: str,
    passed: bool,
    detail: str,
    now: float,
    recomputed_loss: float | None = None,
) -> SpotCheck:
    """Record the checker's verdict. A failed check removes the lease's credit, returns its shard to the
    queue and flags the volunteer; a passed one settles (and verifies) the credit.

    :raises NotFound: no such check. :raises Conflict: the check was already decided.
    """
    check = db.get(SpotCheck, check_id)
    if check is None:
        raise NotFound(f"no spot check {check_id!r}", code="spot_check_not_found")
    if check.state in (SpotCheckState.PASSED, SpotCheckState.FAILED):
        raise Conflict(
            f"spot check {check_id} was already decided ({check.state})", code="spot_check_decided"
        )
    check.state = SpotCheckState.PASSED if passed else SpotCheckState.FAILED
    check.decided_at = now
    check.detail = detail[:500]
    if recomputed_loss is not None and math.isfinite(recomputed_loss):
        check.recomputed_loss = recomputed_loss
    lease = db.get(Lease, check.lease_id)
    entry = db.scalars(select(LedgerEntry).where(LedgerEntry.lease_id == check.lease_id)).first()
    if lease is None:
        return check
    if passed:
        mark_verified(db, lease=lease, entry=entry)
        return check
    reason = f"failed a proof-of-training spot check: {detail}"[:500]
    lease.samples_credited = 0
    lease.flagged = True
    lease.flag_reason = reason
    if entry is not None:
        entry.samples = 0
        entry.flagged = True
        entry.reason = reason
    db.execute(
        update(Shard)
        .where(
            Shard.run_id == lease.run_id,
            Shard.data_epoch == lease.data_epoch,
            Shard.shard == lease.shard,
            Shard.lease_id == lease.id,
            Shard.state.in_((ShardState.CLAIMED, ShardState.DONE)),
        )
        .values(state=ShardState.PENDING, lease_id=None, done_at=None)
    )
    flags.flag_lease(db, lease, kind=flags.SPOT_CHECK_FAILED, detail=reason, now=now)
    return check


def expire_checks(db: Session, *, now: float, settings: CoordinatorSettings) -> int:
    """Checks nobody decided within ``spot_check_timeout``: expired, their credit settles as it stands."""
    expired = list(
        db.scalars(
            select(SpotCheck).where(
                SpotCheck.state.in_((SpotCheckState.PENDING, SpotCheckState.RUNNING)),
                SpotCheck.created_at < now - settings.credit.spot_check_timeout,
            )
        )
    )
    for check in expired:
        check.state = SpotCheckState.EXPIRED
        check.decided_at = now
        check.detail = "no checker decided it in time"
    return len(expired)


def judge_loss(
    reported: float | None,
    recomputed: float,
    *,
    control: float | None = None,
    untrained: float | None = None,
    rel_tol: float = 0.25,
    abs_tol: float = 0.05,
    high_factor: float = 1.5,
    high_abs: float = 0.5,
) -> tuple[bool, str]:
    """Judge a peer's reported training loss against what the shared model scores on the peer's shard.

    The test is one-sided, because of what an honest report is: the worker's running average of its
    *training* loss, each micro-batch measured before the step that learns from it, on a model at most as
    trained as the shared model the checker holds (the checker only judges with a model past the
    swarm epoch the peer reported, :class:`coordinator.swarm.spotchecker.SpotChecker`). Training since
    then, and the peer's own steps on this very shard, only lower the shared model's loss, and early in a run they lower
    it a lot. So an honest report is *at or above* the recomputed loss, give or take the noise of a few
    micro-batches, and the judgement fails only what honest training cannot produce:

    * **too low**: ``reported < (1 - rel_tol) * reference - abs_tol``, where ``reference`` is the lower of
      the shared model's loss on the peer's shard (``recomputed``) and on control data of the same
      distribution that no lease hands out (``control``): a claim of a loss the shared model does not
      reach, such as a made-up tiny loss or the loss of a model fitted to other (easier, repeated) data.
      Taking the lower of the two keeps an unusually hard shard from failing an honest peer.
    * **too high**: ``reported > high_factor * untrained + high_abs``, where ``untrained`` is what a freshly
      initialised model scores on the shard: no training loss is far above the loss of no training.
    * **missing**: no finite report at all (every worker reports the loss of the lease it completes).

    A plausible loss that the peer did not earn (copied from the dashboard, say) is *not* caught here; the
    docs/credit-and-trust.md#what-it-does-not-catch says what bounds such a peer instead.

    :param reported: the loss the peer sent with the completed lease.
    :param recomputed: the shared model's loss on the first micro-batches of the peer's shard.
    :param control: the shared model's loss on as many micro-batches of control data (optional).
    :param untrained: a freshly initialised model's loss on the peer's shard (optional; no upper test
      without it).
    :param rel_tol: relative slack below ``reference``; :param abs_tol: absolute slack below it.
    :param high_factor: :param high_abs: how far above ``untrained`` a report may be.
    """
    if reported is None or not math.isfinite(reported):
        return False, "the peer reported no loss for this lease"
    if not math.isfinite(recomputed):
        return False, f"the recomputed loss is {recomputed}: the peer's shard cannot be checked"
    reference = recomputed
    if control is not None and math.isfinite(control):
        reference = min(reference, control)
    floor = (1.0 - rel_tol) * reference - abs_tol
    shown = f"reported loss {reported:.4f}, recomputed {recomputed:.4f}"
    if control is not None and math.isfinite(control):
        shown += f" (control data {control:.4f})"
    if reported < floor:
        return False, (
            f"{shown}: outside the tolerance, below {floor:.4f}, a loss the shared model does not reach "
            "on this shard"
        )
    if untrained is not None and math.isfinite(untrained):
        ceiling = high_factor * untrained + high_abs
        if reported > ceiling:
            return False, (
                f"{shown}: outside the tolerance, above {ceiling:.4f}, far worse than an untrained model "
                f"({untrained:.4f})"
            )
    return True, f"{shown}: within the tolerance (at least {floor:.4f})"
