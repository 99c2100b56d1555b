"""``/metrics`` in Prometheus text format (prometheus-client), per run where it makes sense.

Two kinds of figures:

* **From the store, at each scrape** (:class:`StoreCollector`): peers online, samples/s, samples trained,
  credited and verified, the swarm's epoch, leases issued / completed / expired / returned / active, runs by
  state. They are exact and survive a restart of ``serve`` (a lease counter read from the store is still a
  counter: leases are never deleted).
* **Counted by this process** (:class:`Metrics`): heartbeats per run, refused credentials and peer tokens by
  reason, requests refused by a rate limit by action, dashboard sign-ins, live-feed sockets. Like every
  Prometheus counter they start at 0 when the process starts.

Each app has its own registry (built in ``create_app``), so several apps in one process never mix figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Float, case, cast, func, select

from coordinator.accounts.limits import RateLimiter
from coordinator.errors import RateLimited
from coordinator.models import Lease, LedgerEntry, PeerSession, PrunedTotals, Run
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store
from volunteer_app.states import LeaseState, RunState, SessionState

PREFIX = "volunteer_coordinator"

TOKEN_CODES = frozenset(
    {
        "malformed_token",
        "forged_token",
        "unknown_key",
        "expired_token",
        "wrong_run",
        "wrong_key",
        "wrong_session",
        "revoked_token",
        "token_superseded",
    }
)
"""Refusals of a peer token (as opposed to a credential or a sign-in)."""

AUTH_CODES = frozenset(
    {
        "missing_credential",
        "invalid_credential",
        "revoked_credential",
        "volunteer_banned",
        "organizer_only",
        "volunteer_only",
        "invalid_session",
        "session_expired",
        "csrf_failed",
        "cross_site_request",
    }
)
"""Refusals of who is calling: credentials, the organizer token, dashboard sign-ins and CSRF checks."""


class Metrics:
    """This process's counters, on a registry of their own (``registry`` is what ``/metrics`` serves)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.heartbeats = Counter(
            f"{PREFIX}_heartbeats", "Heartbeats accepted, per run.", ["run"], registry=self.registry
        )
        self.auth_failures = Counter(
            f"{PREFIX}_auth_failures",
            "Requests refused for who is calling (missing, unknown, revoked or banned credentials, "
            "organizer-only endpoints, dashboard sign-ins and CSRF checks), by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.token_failures = Counter(
            f"{PREFIX}_token_failures",
            "Peer tokens refused (forged, expired, superseded, revoked, another run's ...), by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.rate_limited = Counter(
            f"{PREFIX}_rate_limited_requests",
            "Requests refused with 429 by a rate limit, by the limited action.",
            ["action"],
            registry=self.registry,
        )
        self.logins = Counter(
            f"{PREFIX}_dashboard_logins",
            "Dashboard sign-ins, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.live_sockets = Gauge(
            f"{PREFIX}_live_feed_sockets", "Live-feed websockets open now.", registry=self.registry
        )

    def refused(self, code: str) -> None:
        """Count a 401/403 answer by its error code."""
        if code in TOKEN_CODES:
            self.token_failures.labels(reason=code).inc()
        elif code in AUTH_CODES:
            self.auth_failures.labels(reason=code).inc()

    def watch_store(
        self, *, store: Store, settings: CoordinatorSettings, clock: Callable[[], float]
    ) -> StoreCollector:
        collector = StoreCollector(store=store, settings=settings, clock=clock)
        self.registry.register(collector)
        return collector


class CountingRateLimiter(RateLimiter):
    """The rate limiter, counting each refusal in ``metrics.rate_limited`` by action."""

    def __init__(self, *, burst: int, metrics: Metrics, clock: Callable[[], float] = time.monotonic):
        super().__init__(burst=burst, clock=clock)
        self.metrics = metrics

    def check(self, action: str, key: str, *, per_minute: float, burst: int | None = None) -> None:
        try:
            super().check(action, key, per_minute=per_minute, burst=burst)
        except RateLimited:
            self.metrics.rate_limited.labels(action=action).inc()
            raise


def _with_pruned_figures(trained: Any, pruned: list[PrunedTotals]) -> list[tuple[str, float, int]]:
    """Per run (samples reported, epoch) from the sessions, plus what its deleted sessions had reported."""
    figures = {run_id: (float(samples or 0.0), int(epoch or 0)) for run_id, samples, epoch in trained}
    for totals in pruned:
        samples, epoch = figures.get(totals.run_id, (0.0, 0))
        figures[totals.run_id] = (samples + totals.samples_total, max(epoch, totals.global_epoch))
    return [(run_id, samples, epoch) for run_id, (samples, epoch) in figures.items()]


class StoreCollector(Collector):
    """Per-run figures read from the store at each scrape (one query per family, whatever the run count)."""

    def __init__(self, *, store: Store, settings: CoordinatorSettings, clock: Callable[[], float]):
        self.store = store
        self.settings = settings
        self.clock = clock

    def describe(self) -> list[Metric]:
        return []  # families are known only once the store is read; the registry then takes collect()'s

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        online_after = now - self.settings.work.session_timeout
        with self.store.read() as db:
            names = {run_id: name for run_id, name in db.execute(select(Run.id, Run.name))}
            states = db.execute(select(Run.state, func.count()).group_by(Run.state)).all()
            online = db.execute(
                select(
                    PeerSession.run_id,
                    func.count(),
                    func.coalesce(func.sum(PeerSession.samples_per_second), 0.0),
                )
                .where(
                    PeerSession.state == SessionState.ACTIVE, PeerSession.last_heartbeat_at >= online_after
                )
                .group_by(PeerSession.run_id)
            ).all()
            trained_rows = db.execute(
                select(
                    PeerSession.run_id,
                    func.coalesce(func.sum(cast(PeerSession.samples_total, Float)), 0.0),
                    func.coalesce(func.max(PeerSession.global_epoch), 0),
                ).group_by(PeerSession.run_id)
            ).all()
            credited = db.execute(
                select(
                    LedgerEntry.run_id,
                    func.coalesce(func.sum(cast(LedgerEntry.samples, Float)), 0.0),
                    func.coalesce(
                        func.sum(case((LedgerEntry.verified, cast(LedgerEntry.samples, Float)), else_=0.0)),
                        0.0,
                    ),
                ).group_by(LedgerEntry.run_id)
            ).all()
            leases = db.execute(
                select(Lease.run_id, Lease.state, func.count()).group_by(Lease.run_id, Lease.state)
            ).all()
            # what deleted sessions and their dead leases had added (coordinator.retention): counters never go down
            pruned = list(db.scalars(select(PrunedTotals)))
        trained = _with_pruned_figures(trained_rows, pruned)
        lease_rows = [
            *leases,
            *((p.run_id, LeaseState.RETURNED.value, p.leases_returned) for p in pruned),
            *((p.run_id, LeaseState.EXPIRED.value, p.leases_expired) for p in pruned),
        ]

        def per_run(family: Any, rows: Any, column: int = 1) -> Any:
            seen = set()
            for row in rows:
                name = names.get(row[0])
                if name is not None:
                    family.add_metric([name], float(row[column] or 0))
                    seen.add(name)
            for name in set(names.values()) - seen:
                family.add_metric([name], 0.0)
            return family

        runs = GaugeMetricFamily(f"{PREFIX}_runs", "Runs by state.", labels=["state"])
        counted = dict((state, n) for state, n in states)
        for state in RunState:
            runs.add_metric([state.value], float(counted.get(state.value, 0)))
        yield runs
        yield per_run(GaugeMetricFamily(f"{PREFIX}_peers_online", "Peers online.", labels=["run"]), online)
        yield per_run(
            GaugeMetricFamily(
                f"{PREFIX}_samples_per_second", "The swarm's reported throughput.", labels=["run"]
            ),
            online,
            2,
        )
        yield per_run(
            CounterMetricFamily(
                f"{PREFIX}_samples_trained", "Samples trained, as the peers report them.", labels=["run"]
            ),
            trained,
        )
        yield per_run(
            GaugeMetricFamily(f"{PREFIX}_global_epoch", "The swarm's epoch.", labels=["run"]), trained, 2
        )
        yield per_run(
            CounterMetricFamily(
                f"{PREFIX}_samples_credited",
                "Samples credited in the ledger, verified or not.",
                labels=["run"],
            ),
            credited,
        )
        yield per_run(
            CounterMetricFamily(
                f"{PREFIX}_samples_verified", "Credited samples the swarm confirmed.", labels=["run"]
            ),
            credited,
            2,
        )
        by_state: dict[tuple[str, str], int] = {}
        issued: dict[str, int] = {}
        for run_id, state, count in lease_rows:
            name = names.get(run_id)
            if name is None:
                continue
            by_state[(name, state)] = by_state.get((name, state), 0) + int(count)
            issued[name] = issued.get(name, 0) + int(count)
        families = {
            "issued": CounterMetricFamily(f"{PREFIX}_leases_issued", "Leases handed out.", labels=["run"]),
            "completed": CounterMetricFamily(
                f"{PREFIX}_leases_completed", "Leases reported done.", labels=["run"]
            ),
            "expired": CounterMetricFamily(
                f"{PREFIX}_leases_expired", "Leases whose deadline passed.", labels=["run"]
            ),
            "returned": CounterMetricFamily(
                f"{PREFIX}_leases_returned",
                "Leases given back (a peer left, paused past the deadline, or was banned).",
                labels=["run"],
            ),
        }
        active = GaugeMetricFamily(f"{PREFIX}_leases_active", "Leases held now.", labels=["run"])
        for name in sorted(set(names.values())):
            families["issued"].add_metric([name], float(issued.get(name, 0)))
            for state in (LeaseState.COMPLETED, LeaseState.EXPIRED, LeaseState.RETURNED):
                families[state.value].add_metric([name], float(by_state.get((name, state.value), 0)))
            active.add_metric([name], float(by_state.get((name, LeaseState.ACTIVE.value), 0)))
        yield from families.values()
        yield active
