"""What the charts draw: this contribution's throughput and loss as training goes on.

The agent sends the current values only, so the app keeps their history itself from the updates it
receives (from the moment it attached). Points are keyed by the samples trained so far, so a pause
leaves no gap and a chart shows the same thing whatever the refresh rate. To stay small over a long
session, the history is thinned (every other point dropped, the spacing doubled) when it is full.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from volunteer_app.control import ContributionState, MetricPoint


@dataclass
class Series:
    """Aligned x (samples trained) and y values."""

    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)

    def add(self, x: float, y: float) -> None:
        self.x.append(x)
        self.y.append(y)

    def thin(self) -> None:
        self.x, self.y = self.x[::2], self.y[::2]

    def __len__(self) -> int:
        return len(self.x)


@dataclass
class ContributionHistory:
    """Samples/s and loss of one contribution (one session of one run), thinned to ``max_points``."""

    max_points: int = 600
    session: str | None = None
    speed: Series = field(default_factory=Series)
    loss: Series = field(default_factory=Series)
    _last_samples: int = -1
    _step: int = 1

    def record(self, c: ContributionState | None) -> bool:
        """Add the contribution's current values; True when the charts have something new."""
        if c is None:
            return False
        session = f"{c.coordinator} {c.run} {c.session_id}"
        if session != self.session or c.samples_total < self._last_samples:
            self.session, self.speed, self.loss = session, Series(), Series()
            self._last_samples, self._step = -1, 1
        if c.samples_total <= 0 or c.samples_total < self._last_samples + self._step:
            return False
        self._last_samples = c.samples_total
        self.speed.add(c.samples_total, c.samples_per_second)
        if c.loss is not None:
            self.loss.add(c.samples_total, c.loss)
        if len(self.speed) > self.max_points:
            self.speed.thin()
            self.loss.thin()
            self._step *= 2
        return True


def metric_series(history: list[MetricPoint], metric: str) -> Series:
    """One metric of the agent's evaluations over the samples trained."""
    series = Series()
    for point in history:
        if metric in point.metrics:
            series.add(point.samples, point.metrics[metric])
    return series
