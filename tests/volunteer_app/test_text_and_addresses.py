"""What a coordinator's text and addresses may do on a volunteer's computer: shown as text, dialled only
where the coordinator itself is (docs/security.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import python_env
from volunteer_app.netcheck import check_peer_addresses, coordinator_scope
from volunteer_app.protocol import ErrorBody, RunOut
from volunteer_app.safetext import clean, is_clean, one_line

ESCAPES = "\x1b]0;title\x07 \x1b]52;c;Y3VybCB8IHNo\x07 \x1b[2K\r\x9b31m \u202eevil\u202c"


def test_control_characters_and_bidi_overrides_become_visible_replacements() -> None:
    shown = clean("line one\n\tline two" + ESCAPES)
    assert is_clean(shown) and "\x1b" not in shown and "\x07" not in shown and "\r" not in shown
    assert "\x9b" not in shown and "\u202e" not in shown
    assert shown.startswith("line one\n\tline two") and "title" in shown  # the words stay readable
    assert one_line("a\nb\t c" + ESCAPES, limit=20) == one_line("a b c" + ESCAPES)[:19] + "…"
    assert "\n" not in one_line("a\nb")


def test_every_string_a_coordinator_answers_is_cleaned_as_it_is_read() -> None:
    run = RunOut.model_validate({
        "name": "r", "task": "t", "description": "hi\x1b]52;c;eA==\x07", "state": "active", "visibility": "open",
        "created_at": 0, "data_epochs": 1, "task_config": {"note\x1b[2K": ["\x1b[31mred"]}, "optimizer": {},
        "stats": {},
    })  # fmt: skip
    assert is_clean(run.description) and run.task_config == {"note�[2K": ["�[31mred"]}
    assert is_clean(ErrorBody.model_validate({"error": "e\x07", "detail": "d\x1b"}).detail)


def _resolver(table: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    return lambda host: table.get(host, [])


PEER = "/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@pytest.mark.parametrize(
    ("coordinator", "maddr", "kept"),
    [
        ("https://train.example.org", f"/ip4/93.184.216.34/tcp/31337{PEER}", True),
        ("https://train.example.org", f"/ip4/127.0.0.1/tcp/631{PEER}", False),
        ("https://train.example.org", f"/ip4/0.0.0.0/tcp/22{PEER}", False),
        ("https://train.example.org", f"/ip6/::1/tcp/22{PEER}", False),
        ("https://train.example.org", f"/ip6/::ffff:127.0.0.1/tcp/22{PEER}", False),
        ("https://train.example.org", f"/ip4/192.168.1.1/tcp/80{PEER}", False),
        ("https://train.example.org", f"/ip4/169.254.169.254/tcp/80{PEER}", False),
        ("https://train.example.org", f"/dns4/sneaky.example.org/tcp/80{PEER}", False),
        ("https://train.example.org", f"/dns4/peer.example.org/tcp/31337{PEER}", True),
        ("https://train.example.org", f"/dns4/nowhere.example.org/tcp/31337{PEER}", False),
        (
            "https://train.example.org",
            f"/ip4/93.184.216.34/tcp/1{PEER}/p2p-circuit/ip4/10.0.0.1/tcp/1",
            False,
        ),
        ("https://train.example.org", f"/ip4/93.184.216.34/tcp/1{PEER}/p2p-circuit{PEER}", True),
        ("https://train.example.org", f"/ip4/93.184.216.34/udp/31337/quic-v1{PEER}", True),
        ("https://train.example.org", "not a multiaddr", False),
        ("https://train.example.org", f"/unix/run/docker.sock{PEER}", False),
        ("http://192.168.1.5:8470", f"/ip4/192.168.1.7/tcp/31337{PEER}", True),
        ("http://192.168.1.5:8470", f"/ip4/127.0.0.1/tcp/631{PEER}", False),
        ("http://127.0.0.1:8470", f"/ip4/127.0.0.1/tcp/31337{PEER}", True),
        ("http://localhost:8470", f"/ip4/192.168.1.7/tcp/31337{PEER}", True),
    ],
)
def test_swarm_addresses_are_dialled_only_where_the_coordinator_is(
    coordinator: str, maddr: str, kept: bool
) -> None:
    resolver = _resolver({
        "train.example.org": ["93.184.216.35"], "peer.example.org": ["93.184.216.36"],
        "sneaky.example.org": ["93.184.216.37", "127.0.0.1"], "localhost": ["127.0.0.1", "::1"],
    })  # fmt: skip
    checked = check_peer_addresses([maddr], coordinator_url=coordinator, resolver=resolver)
    assert (checked.kept == [maddr]) is kept, checked.refused


def test_a_coordinator_name_that_resolves_anywhere_public_counts_as_public() -> None:
    resolver = _resolver({"mixed.example.org": ["127.0.0.1", "93.184.216.34"]})
    assert coordinator_scope("https://mixed.example.org", resolver=resolver) == "public"
    assert coordinator_scope("http://[::1]:8470") == "loopback"


def test_the_speed_test_imports_nothing_from_the_folder_the_volunteer_is_in(tmp_path: Path) -> None:
    """Issue point 2's other half: ``python -m`` puts the current folder first on the import path, so a
    ``torch.py`` in it (a download, say) would run when the speed test imports torch. The agent starts it in
    its own empty folder, without the user site-packages."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "torch.py").write_text(
        "import pathlib; pathlib.Path(__file__).with_name('RAN').write_text('x')\n"
    )
    code = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from volunteer_app.agent.speedtest import SpeedTestCache, measure_speed\n"
        "from volunteer_app.profile import profile_machine\n"
        "from volunteer_app.protocol import OptimizerSettings, RunOut, RunStats\n"
        "run = RunOut(name='r', task='tiny-lm', description='', state='active', visibility='open', created_at=0,\n"
        "             data_epochs=1, task_config={'fallback_chars': 20000}, optimizer=OptimizerSettings(),\n"
        "             stats=RunStats())\n"
        f"work = Path({str(tmp_path / 'work')!r})\n"
        "result = asyncio.run(measure_speed(run=run, profile=profile_machine(), cache=SpeedTestCache(work / 'b.json'),\n"
        "    seconds=0.5, max_threads=1, device='cpu', on_message=print, work_dir=work))\n"
        "print('measured', result is not None)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=home, env=python_env(), capture_output=True,
                            text=True, timeout=180)  # fmt: skip
    assert "measured True" in result.stdout, result.stdout + result.stderr
    assert not (home / "RAN").exists()
