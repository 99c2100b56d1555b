"""A small live line chart (textual-plotext), redrawn only when its data changed."""

from __future__ import annotations

import time

from textual.timer import Timer
from textual_plotext import PlotextPlot

from tui.formatting import human
from tui.history import Series


def ticks(low: float, high: float, count: int) -> list[float]:
    if high <= low:
        return [low]
    step = (high - low) / (count - 1)
    return [low + i * step for i in range(count)]


class LineChart(PlotextPlot):
    """One series against the samples trained (the x axis, in samples); the title carries the latest value.

    :param title: what the y axis is (``samples/s``, ``loss``).
    :param digits: decimals of the latest value and of the y ticks.
    :param ylim: fixed y range (e.g. 0..1 for accuracies), else fitted to the data.
    :param empty: what the chart says while it has no points.
    """

    DEFAULT_CSS = """
    LineChart { height: 1fr; min-height: 5; }
    """

    MIN_INTERVAL = 5.0
    """Seconds between redraws: the agent updates twice a second, and building a plot is the costliest
    thing this app draws (tests/perf/bench_tui.py)."""

    def __init__(
        self,
        title: str,
        *,
        digits: int = 1,
        ylim: tuple[float, float] | None = None,
        empty: str = "waiting for data",
        **kwargs: object,
    ):
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.title = title
        self.digits = digits
        self.ylim = ylim
        self.empty = empty
        self._shown: tuple[int, float, float] | None = None
        self._series = Series()
        self._drawn_at = 0.0
        self._pending: Timer | None = None
        self.points_drawn = 0
        self._draw()

    def show(self, series: Series, *, force: bool = False) -> None:
        """Draw ``series`` (now, or within ``MIN_INTERVAL`` of the last drawing)."""
        key = (len(series), series.x[-1], series.y[-1]) if len(series) else (0, 0.0, 0.0)
        self._series = series
        if key == self._shown and not force:
            return
        self._shown = key
        wait = self._drawn_at + self.MIN_INTERVAL - time.monotonic()
        if force or wait <= 0 or not self.is_mounted or not self.points_drawn:  # the first points at once
            self._redraw()
        elif self._pending is None:
            self._pending = self.set_timer(wait, self._redraw)

    def _redraw(self) -> None:
        self._pending = None
        self._drawn_at = time.monotonic()
        self._draw()
        self.points_drawn = len(self._series)
        self.refresh()

    def _draw(self) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        series = self._series
        if not len(series):
            plt.title(f"{self.title}: {self.empty}")
            plt.xticks([])
            plt.yticks([])
            return
        plt.title(f"{self.title}: {series.y[-1]:,.{self.digits}f}")
        if len(series) == 1:
            plt.scatter(series.x, series.y, marker="braille")
        else:
            plt.plot(series.x, series.y, marker="braille")
        xs = ticks(series.x[0], series.x[-1], 3 if len(series) > 1 else 1)
        plt.xticks(xs, [human(x) for x in xs])
        low, high = self.ylim if self.ylim is not None else (min(series.y), max(series.y))
        if self.ylim is not None:
            plt.ylim(low, high)
        ys = ticks(low, high, 3 if high > low else 1)
        plt.yticks(ys, [f"{y:.{self.digits}f}" for y in ys])
