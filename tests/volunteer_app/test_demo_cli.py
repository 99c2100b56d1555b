"""``volunteer-app demo``'s arguments: the command runs the demo the README and the benchmark describe."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from volunteer_app.cli import build_parser, demo_options
from volunteer_app.demo import DemoError, DemoOptions, run_demo


def test_the_demo_command_runs_the_documented_demo_by_default() -> None:
    options = demo_options(build_parser().parse_args(["demo"]))
    assert options == DemoOptions()  # mini, 270 s, 2 peers, the coordinator's round size
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    help_text = " ".join(out.getvalue().split())
    defaults = DemoOptions()
    assert f"(default {defaults.duration:.0f})" in help_text and f"default {defaults.preset}" in help_text
    assert f"(default {defaults.peers})" in help_text


def test_the_demo_command_passes_what_was_given() -> None:
    args = build_parser().parse_args(
        [
            "demo",
            "--peers",
            "3",
            "--duration",
            "840",
            "--preset",
            "tiny",
            "--target-batch-size",
            "512",
            "--json",
            "--headless",
        ]
    )
    assert demo_options(args) == dataclasses.replace(
        DemoOptions(),
        peers=3,
        duration=840.0,
        preset="tiny",
        target_batch_size=512,
        json=True,
        headless=True,
    )


def test_headless_progress_is_plain_lines_not_a_redrawn_panel() -> None:
    """``demo --headless`` writes a progress line now and then (a log file reads well), never the panel's
    cursor movements, and rate-limits the lines however often the agents report."""
    from rich.console import Console

    from volunteer_app.display import LiveDisplay

    def peer(name: str, samples: int, loss: float) -> SimpleNamespace:
        return SimpleNamespace(
            name=name, state="training", samples_total=samples, samples_per_second=200.0, loss=loss,
            averaging_rounds=7, failed_rounds=1,
        )  # fmt: skip

    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    with LiveDisplay("demo", console=console, plain=True, plain_every=3600) as display:
        for i in range(20):
            display.update([peer("peer-0", 1000 + i, 0.5), peer("peer-1", 2500, 0.25)])
    text = buffer.getvalue()
    assert "\x1b[2K" not in text and "\x1b[1A" not in text  # no line erased, no cursor moved up
    lines = [line for line in text.splitlines() if "samples/s" in line]
    assert len(lines) == 1, text
    assert "2 peers training" in lines[0] and "3.5k samples" in lines[0] and "400 samples/s" in lines[0]
    assert "lowest loss 0.250" in lines[0] and "7 averaging rounds (1 failed)" in lines[0]


def test_a_demo_that_fails_keeps_the_log_its_error_points_to() -> None:
    """The coordinator cannot listen on a port another program holds: the error names its log, and the
    log is still there to read (the temporary directory used to be removed with it)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(DemoError) as failure:
            run_demo(DemoOptions(port=port, json=True, duration=5))
    message = str(failure.value)
    log = Path(re.search(r"see (\S+)", message).group(1))  # type: ignore[union-attr]
    kept = Path(re.search(r"kept in (\S+?)\)", message).group(1))  # type: ignore[union-attr]
    try:
        assert log.is_file() and log.read_text().strip(), message
        assert log.is_relative_to(kept)
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_the_demo_help_documents_verbose_and_the_flag_reaches_the_options() -> None:
    """Per-lease lines are off the demo's screen by default; ``--verbose`` is how a user gets them back."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    assert "--verbose" in out.getvalue()
    assert demo_options(build_parser().parse_args(["demo", "--verbose"])).verbose is True
    assert demo_options(build_parser().parse_args(["demo"])).verbose is False


def test_a_sample_budget_sets_the_learning_rate_decay_and_lifts_the_time_limit_unless_one_is_given() -> None:
    """``demo --samples N``: the same model on a slow machine as on a fast one (the decay spans exactly N
    samples), with no time limit unless ``--duration`` sets one too."""
    from volunteer_app.demo import planned_samples

    options = demo_options(build_parser().parse_args(["demo", "--samples", "50000"]))
    assert options.samples == 50000 and planned_samples(options) == 50000
    assert options.duration == float("inf")
    both = demo_options(build_parser().parse_args(["demo", "--samples", "50000", "--duration", "100"]))
    assert both.samples == 50000 and both.duration == 100.0
    assert planned_samples(DemoOptions(duration=100.0)) != planned_samples(DemoOptions(duration=200.0))
    with pytest.raises(DemoError, match="--samples must be positive"):
        run_demo(DemoOptions(samples=0))
