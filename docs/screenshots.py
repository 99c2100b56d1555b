"""Export the README's pictures of the app, as Textual itself draws them (``App.save_screenshot``, SVG).

    python docs/screenshots.py [--config-dir DIR] [--size 100x32] [--points 30]

Attaches to the running agent of ``--config-dir`` (it must be training a run, ideally long enough for
its model to draw something), waits until the app has ``--points`` points for its charts and the
agent has an evaluation, and writes ``docs/app-contribute.svg`` and ``docs/app-model.svg``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))

from tui.app import VolunteerApp  # noqa: E402
from volunteer_app.settings import AgentSettings  # noqa: E402


async def export(settings: AgentSettings, size: tuple[int, int], points: int, timeout: float) -> None:
    app = VolunteerApp(settings=settings)
    async with app.run_test(size=size) as pilot:
        deadline = time.monotonic() + timeout

        def ready() -> bool:
            state = app.state
            return (
                app.attached
                and state is not None
                and state.evaluation is not None
                and len(app.history.speed) >= points
                and bool(app.board_entries)
            )

        while not ready():
            if time.monotonic() > deadline:
                raise SystemExit("the agent is not training a run with an evaluation yet; try again later")
            await pilot.pause(0.5)
        for mode in ("contribute", "model"):
            app.show_mode(mode)
            await pilot.pause(2)  # the contribute screen redraws at most once a second (REDRAW_INTERVAL)
            path = DOCS / f"app-{mode}.svg"
            app.save_screenshot(filename=path.name, path=str(DOCS))
            print(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config-dir", type=Path, default=None, help="the agent's config dir")
    parser.add_argument("--size", default="100x32", help="terminal size, COLUMNSxROWS")
    parser.add_argument("--points", type=int, default=30, help="chart points to collect first")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for them")
    args = parser.parse_args()
    settings = AgentSettings(config_dir=args.config_dir) if args.config_dir else AgentSettings()
    width, height = (int(v) for v in args.size.lower().split("x"))
    asyncio.run(export(settings, (width, height), args.points, args.timeout))


if __name__ == "__main__":
    main()
