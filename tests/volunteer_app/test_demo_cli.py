"""``volunteer-app demo``'s arguments: the command runs the demo the README and the benchmark describe."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shutil
import socket
from pathlib import Path

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
        ]
    )
    assert demo_options(args) == dataclasses.replace(
        DemoOptions(), peers=3, duration=840.0, preset="tiny", target_batch_size=512, json=True
    )


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
