"""Each run's time series: loss, held-out metric, throughput, peers online, averaging rounds and bytes,
kept in the store so that the dashboard draws a run's whole history, after a restart too.

A :class:`SeriesRecorder` in the app's lifespan takes a point every ``series.interval`` seconds for each run
that changed (a heartbeat, a lease, a peer lost, a new checkpoint); an idle run adds nothing. As points age
they are merged into coarser ones (:data:`TIERS`): a month-long run at the default 10 s interval keeps about
3,000 rows (``tests/perf/bench_series.py`` prints the figures). Rates and the loss of a merged point are
means over its span, weighted by how many raw points it holds; cumulative figures (samples, epoch, rounds,
bytes) are the span's last; the held-out metric is the span's newest.

The held-out metric comes from the run's checkpoints (``coordinator.checkpoints``): when the swarm peer
writes a newer one, the next point carries its metric, so the metric's history outlives the checkpoints,
of which only the newest few are kept.
"""

from __future__ import annotations

import logging
import math
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field
from sqlalchemy import Float, Table, cast, delete, func, insert, select
from sqlalchemy.orm import Session

from coordinator.credit.ledger import run_stats
from coordinator.models import PeerSession, Run, SeriesPoint
from coordinator.retention import pruned_totals
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store
from volunteer_app.states import RunState

logger = logging.getLogger("coordinator.series")

TIERS: tuple[tuple[float, float], ...] = (
    (3600.0, 60.0),  # older than an hour: one point a minute
    (86400.0, 600.0),  # older than a day: one point per 10 minutes
    (7 * 86400.0, 3600.0),  # older than a week: one point an hour
)
"""(age in seconds, span in seconds): points older than the age are merged into points of that span."""

COLUMNS = (
    "t",
    "span",
    "peers",
    "samples_per_second",
    "loss",
    "metric",
    "eval_loss",
    "samples_total",
    "samples_verified",
    "global_epoch",
    "averaging_rounds",
    "bytes",
)
"""The columns the API serves, in order."""

_MEANS = ("peers", "samples_per_second")
_LASTS = ("samples_total", "samples_verified", "global_epoch", "averaging_rounds", "bytes")
_COMPARED = ("peers", "samples_per_second", "loss", *_LASTS)


@dataclass(frozen=True)
class Evaluation:
    """A checkpoint's held-out figures: its epoch, the task's headline metric and the held-out loss."""

    epoch: int
    metric: float | None
    loss: float | None


def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def run_figures(db: Session, *, run: Run, settings: CoordinatorSettings, now: float) -> dict[str, Any]:
    """The figures one point records for ``run`` now (what ``run_stats`` shows, plus rounds and bytes)."""
    stats = run_stats(db, run=run, settings=settings, now=now)
    # Summed as floats: hostile peers may report up to 2**53 bytes each, and SQL integers overflow.
    rounds, traffic = db.execute(
        select(
            func.coalesce(func.sum(cast(PeerSession.averaging_rounds, Float)), 0.0),
            func.coalesce(
                func.sum(cast(PeerSession.bytes_sent, Float) + cast(PeerSession.bytes_received, Float)), 0.0
            ),
        ).where(PeerSession.run_id == run.id)
    ).one()
    pruned = pruned_totals(db, run_id=run.id)  # what deleted sessions had reported
    rounds = (rounds or 0.0) + pruned.averaging_rounds
    traffic = (traffic or 0.0) + pruned.bytes
    return {
        "peers": float(stats.active_peers),
        "samples_per_second": float(stats.samples_per_second),
        "loss": _finite(stats.loss),
        "samples_total": float(stats.samples_total),
        "samples_verified": float(stats.samples_verified),
        "global_epoch": int(stats.global_epoch),
        "averaging_rounds": float(rounds or 0.0),
        "bytes": float(traffic or 0.0),
    }


def latest_point(db: Session, *, run_id: str) -> SeriesPoint | None:
    return db.scalars(
        select(SeriesPoint).where(SeriesPoint.run_id == run_id).order_by(SeriesPoint.t.desc()).limit(1)
    ).first()


def last_evaluated_epoch(db: Session, *, run_id: str) -> int | None:
    """The newest checkpoint epoch whose metric is in the series (None: none yet)."""
    return db.scalar(select(func.max(SeriesPoint.checkpoint_epoch)).where(SeriesPoint.run_id == run_id))


def changed(previous: SeriesPoint | None, figures: dict[str, Any]) -> bool:
    """Whether ``figures`` differ from the point recorded before (so an idle run adds no rows)."""
    if previous is None:
        return True
    return any(getattr(previous, name) != figures[name] for name in _COMPARED)


def record_point(
    db: Session, *, run_id: str, figures: dict[str, Any], now: float, evaluation: Evaluation | None = None
) -> SeriesPoint:
    """Append one raw point to a run's series."""
    point = SeriesPoint(run_id=run_id, t=now, span=0.0, n=1, **figures)
    if evaluation is not None:
        point.metric = _finite(evaluation.metric)
        point.eval_loss = _finite(evaluation.loss)
        point.checkpoint_epoch = evaluation.epoch
    db.add(point)
    return point


def merge(points: list[Any], *, span: float) -> dict[str, Any]:
    """One point standing for ``points`` (rows in time order): weighted means for rates and the loss, the
    last value for cumulative figures, the newest held-out metric."""
    weights = [max(1, int(p["n"])) for p in points]
    total = sum(weights)
    pairs = list(zip(points, weights, strict=True))
    values: dict[str, Any] = {
        "run_id": points[0]["run_id"],
        "t": sum(p["t"] * w for p, w in pairs) / total,
        "span": span,
        "n": total,
    }
    for name in _MEANS:
        values[name] = sum(float(p[name]) * w for p, w in pairs) / total
    losses = [(p["loss"], w) for p, w in pairs if p["loss"] is not None]
    values["loss"] = sum(v * w for v, w in losses) / sum(w for _, w in losses) if losses else None
    for name in _LASTS:
        values[name] = points[-1][name]
    evaluated = [p for p in points if p["checkpoint_epoch"] is not None]
    last = evaluated[-1] if evaluated else None
    for name in ("metric", "eval_loss", "checkpoint_epoch"):
        values[name] = last[name] if last is not None else None
    return values


def compact(db: Session, *, run_id: str, now: float) -> int:
    """Merge aged points of one run into coarser ones (:data:`TIERS`). Returns how many rows it removed.

    A bucket is merged only when all of it is past the tier's age, so each is merged once per tier. Rows
    are read and written in bulk: the first pass over a long backlog takes seconds, later ones milliseconds.
    """
    table = cast_table(SeriesPoint.__table__)
    removed = 0
    for age, span in TIERS:
        cutoff = math.floor((now - age) / span) * span
        rows = (
            db.execute(
                select(table)
                .where(table.c.run_id == run_id, table.c.t < cutoff, table.c.span < span)
                .order_by(table.c.t, table.c.id)
            )
            .mappings()
            .all()
        )
        if not rows:
            continue
        buckets: dict[int, list[Any]] = {}
        for row in rows:
            buckets.setdefault(math.floor(row["t"] / span), []).append(row)
        ids = [row["id"] for row in rows]
        for start in range(0, len(ids), 500):
            db.execute(delete(table).where(table.c.id.in_(ids[start : start + 500])))
        db.execute(insert(table), [merge(group, span=span) for group in buckets.values()])
        removed += len(rows) - len(buckets)
    return removed


def cast_table(table: Any) -> Table:
    return typing.cast(Table, table)


class SeriesOut(BaseModel):
    """A run's time series, one list per column (``GET /api/v1/runs/{name}/series``)."""

    run: str
    metric_name: str | None = Field(description="the task's headline held-out metric (the `metric` column)")
    interval: float = Field(description="seconds between raw points while the run changes")
    t: list[float] = Field(description="Unix time of each point (the mean time of a merged point)")
    span: list[float] = Field(description="seconds a point stands for: 0 for a raw point, more once merged")
    peers: list[float] = Field(description="peers online (mean over the span)")
    samples_per_second: list[float] = Field(description="the swarm's throughput (mean over the span)")
    loss: list[float | None] = Field(description="mean training loss of the peers online")
    metric: list[float | None] = Field(description="held-out metric of the checkpoint saved at this point")
    eval_loss: list[float | None] = Field(description="held-out loss of the checkpoint saved at this point")
    samples_total: list[float] = Field(description="samples trained, as the peers report them")
    samples_verified: list[float] = Field(description="samples credited and confirmed by the swarm")
    global_epoch: list[float] = Field(description="the swarm's epoch: averaging rounds or optimizer steps")
    averaging_rounds: list[float] = Field(description="averaging rounds taken part in, summed over peers")
    bytes: list[float] = Field(description="bytes sent and received by all the run's peers, cumulative")


def _short(value: Any, name: str) -> Any:
    """Six significant digits: a month of history is sent whole when a dashboard opens, and the digits
    beyond these are noise in a chart. Times stay exact (``since`` compares with them)."""
    if not isinstance(value, float) or name == "t":
        return value
    return float(f"{value:.6g}")


def point_row(point: SeriesPoint) -> dict[str, Any]:
    """One point as a row (the live feed sends the newest this way)."""
    return {name: _short(getattr(point, name), name) for name in COLUMNS}


def series_out(
    db: Session,
    *,
    run: Run,
    settings: CoordinatorSettings,
    metric_name: str | None,
    since: float | None = None,
    limit: int = 20_000,
) -> SeriesOut:
    """The series of ``run`` from ``since`` on (all of it by default), oldest first."""
    query = select(SeriesPoint).where(SeriesPoint.run_id == run.id)
    if since is not None:
        query = query.where(SeriesPoint.t > since)
    rows = list(db.scalars(query.order_by(SeriesPoint.t.desc(), SeriesPoint.id.desc()).limit(limit)))
    rows.reverse()
    columns: dict[str, list[Any]] = {name: [_short(getattr(p, name), name) for p in rows] for name in COLUMNS}
    return SeriesOut(run=run.name, metric_name=metric_name, interval=settings.series.interval, **columns)


def task_metric_name(task: str) -> str | None:
    """The headline metric of a run's task (None when the task cannot be loaded here)."""
    from workers.tasks import load_task

    try:
        return load_task(task).metric
    except Exception:  # a task that is not installed here (any more)
        return None


# ------------------------------------------------------------------------------------------ recorder
EvaluationSource = Callable[[Run], Evaluation | None]


def latest_evaluation(data_dir: Any) -> EvaluationSource:
    """Reads the newest intact checkpoint of a run (its manifest's metrics), torch-free."""
    from coordinator.checkpoints import CheckpointStore, checkpoint_directory

    stores: dict[str, CheckpointStore] = {}

    def read(run: Run) -> Evaluation | None:
        store = stores.get(run.name)
        if store is None:
            store = stores[run.name] = CheckpointStore(checkpoint_directory(data_dir, run.name))
        info = store.latest()
        if info is None:
            return None
        metrics = info.metrics
        name = info.manifest.get("metric")
        return Evaluation(
            epoch=info.epoch,
            metric=metrics.get(name) if isinstance(name, str) else None,
            loss=metrics.get("loss"),
        )

    return read


class SeriesRecorder:
    """Takes each changed run's point and merges aged points. Call :meth:`tick` every ``series.interval``.

    :param touched: runs the API changed since the last tick (the live hub's marks).
    :param evaluation: where a run's newest checkpoint figures come from (default: its checkpoint files).
    """

    def __init__(
        self,
        *,
        settings: CoordinatorSettings,
        clock: Callable[[], float],
        evaluation: EvaluationSource | None = None,
    ):
        self.settings = settings
        self.clock = clock
        self.evaluation = evaluation or latest_evaluation(settings.data_dir)
        self._evaluated: dict[str, int | None] = {}
        self._last_compact = 0.0

    def tick(self, store: Store, *, touched: Iterable[str] = ()) -> list[str]:
        """Record a point for every run that changed (or was touched) since its last point; returns their
        names. Every ``series.compact_every`` seconds also merges aged points. The figures are read outside
        the write lock, so heartbeats never wait for them."""
        now = self.clock()
        touched = set(touched)
        planned: list[tuple[str, str, dict[str, Any], Evaluation | None]] = []
        with store.read() as db:
            for run in db.scalars(select(Run).order_by(Run.created_at)):
                if run.state == RunState.FINISHED and run.name not in touched:
                    continue
                figures = run_figures(db, run=run, settings=self.settings, now=now)
                evaluation = self._new_evaluation(db, run)
                previous = latest_point(db, run_id=run.id)
                if previous is not None and previous.t >= now:  # an injected clock that stood still
                    continue
                if run.name in touched or evaluation is not None or changed(previous, figures):
                    planned.append((run.id, run.name, figures, evaluation))
        if planned:
            with store.write() as db:
                for run_id, _name, figures, evaluation in planned:
                    record_point(db, run_id=run_id, figures=figures, now=now, evaluation=evaluation)
            for run_id, _name, _figures, evaluation in planned:
                if evaluation is not None:
                    self._evaluated[run_id] = evaluation.epoch
        if now - self._last_compact >= self.settings.series.compact_every:
            self._last_compact = now
            with store.read() as db:
                run_ids = list(db.scalars(select(Run.id)))
            for run_id in run_ids:
                with store.write() as db:
                    compact(db, run_id=run_id, now=now)
        return [name for _run_id, name, _figures, _evaluation in planned]

    def _new_evaluation(self, db: Session, run: Run) -> Evaluation | None:
        if run.id not in self._evaluated:
            self._evaluated[run.id] = last_evaluated_epoch(db, run_id=run.id)
        try:
            evaluation = self.evaluation(run)
        except OSError as exc:  # an unreadable checkpoint directory must not stop the series
            logger.warning("cannot read the checkpoints of run %s: %s", run.name, exc)
            return None
        seen = self._evaluated[run.id]
        if evaluation is None or (seen is not None and evaluation.epoch <= seen):
            return None
        return evaluation
