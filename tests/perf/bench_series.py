"""Benchmark: how big a month-long run's time series gets, and how fast the dashboard loads it.

    python tests/perf/bench_series.py [--days 30] [--interval 10]

Plays a run that changes all the time (a point every ``--interval`` seconds, the default recording rate)
for ``--days`` of simulated time on a real SQLite store, merging aged points every 5 minutes exactly as
``serve`` does, then measures ``GET /api/v1/runs/NAME/series`` (the whole history, what a dashboard asks
for when it opens) through the real app, beside ``GET /api/v1/runs/NAME`` of the same app for scale.
Prints the figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()

    from fastapi.testclient import TestClient
    from sqlalchemy import func, select

    from coordinator.api import create_app
    from coordinator.models import Run, SeriesPoint
    from coordinator.monitoring import series
    from tests.conftest import bearer, settings_for

    with tempfile.TemporaryDirectory() as tmp:
        settings = settings_for(Path(tmp))
        start = time.time() - args.days * 86400
        clock_now = [start]
        with TestClient(create_app(settings, clock=lambda: clock_now[0])) as client:
            admin = bearer(settings.admin_token_path.read_text().strip())
            created = client.post(
                "/api/v1/runs", json={"name": "month", "task": "shapes-dalle"}, headers=admin
            )
            assert created.status_code == 201, created.text
            store = client.app.state.resources.store  # type: ignore[attr-defined]
            with store.read() as db:
                run_id = str(db.scalar(select(Run.id)))
            raw = int(args.days * 86400 / args.interval)
            per_pass = int(settings.series.compact_every / args.interval)
            compact_seconds: list[float] = []
            written = 0
            began = time.perf_counter()
            while written < raw:
                batch = min(per_pass, raw - written)
                with store.write() as db:
                    for i in range(written, written + batch):
                        t = start + i * args.interval
                        figures = {
                            "peers": float(3 + i % 5),
                            "samples_per_second": 300.0 + (i % 17),
                            "loss": 4.0 / (1 + i / 5000),
                            "samples_total": float(i * 3000),
                            "samples_verified": float(i * 2900),
                            "global_epoch": i // 40,
                            "averaging_rounds": float(i // 10),
                            "bytes": float(i) * 2e6,
                        }
                        evaluation = series.Evaluation(i, 0.001 * (i // 30), 1.0) if i % 30 == 0 else None
                        series.record_point(db, run_id=run_id, figures=figures, now=t, evaluation=evaluation)
                written += batch
                clock_now[0] = start + written * args.interval
                tic = time.perf_counter()
                with store.write() as db:
                    series.compact(db, run_id=run_id, now=clock_now[0])
                compact_seconds.append(time.perf_counter() - tic)
            simulated = time.perf_counter() - began
            with store.read() as db:
                kept = db.scalar(select(func.count()).select_from(SeriesPoint)) or 0

            def timed(path: str) -> tuple[float, int]:
                client.get(path)  # warm
                samples = []
                size = 0
                for _ in range(args.requests):
                    tic = time.perf_counter()
                    answer = client.get(path)
                    samples.append(time.perf_counter() - tic)
                    size = len(answer.content)
                    assert answer.status_code == 200, answer.text
                return statistics.median(samples), size

            whole, whole_bytes = timed("/api/v1/runs/month/series")
            run_page, run_bytes = timed("/api/v1/runs/month")
    compact_seconds.sort()
    print(
        f"simulated {args.days:g} days at one point per {args.interval:g} s in {simulated:.1f} s of wall time"
    )
    print(f"raw points recorded: {raw:,}; rows kept after merging: {kept:,} ({kept / raw:.2%})")
    print(
        f"one merge pass (every {settings.series.compact_every:g} s): median {statistics.median(compact_seconds) * 1e3:.1f} ms, "
        f"max {compact_seconds[-1] * 1e3:.1f} ms"
    )
    print(
        f"GET /runs/month/series (whole history): median {whole * 1e3:.1f} ms, {whole_bytes / 1e3:.0f} kB; "
        f"GET /runs/month: {run_page * 1e3:.1f} ms, {run_bytes / 1e3:.1f} kB; ratio {whole / run_page:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
