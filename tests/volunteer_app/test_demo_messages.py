"""What the demo prints above its panel: the events that matter by default, every line with ``--verbose``.

The messages are the real ones: a lease keeper reporting to a real coordinator app (an honest peer's first
leases, which the swarm has not confirmed yet, the wait for that confirmation, a capped claim) and a
contribution handling real worker events (ready, evaluation, errors), so that a change of wording in the
agent cannot silently turn the demo's screen back into a flood, or hide an error.
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from tests.conftest import Coordinator
from tests.volunteer_app.test_agent_parts import ThroughTestClient, keeper_for
from volunteer_app.agent.contribution import Contribution
from volunteer_app.control import ContributionState
from volunteer_app.demo import _messenger
from volunteer_app.display import JsonLines, LiveDisplay, is_routine
from volunteer_app.settings import AgentSettings
from volunteer_app.worker_protocol import ErrorEvent, EvalEvent, LeaseDoneEvent, ReadyEvent, StateEvent


def lease_messages(coordinator: Coordinator, tmp_path: Path) -> tuple[list[str], list[str]]:
    """The lease keeper's lines for an honest peer's lease cycle, and for a claim the coordinator caps."""
    from coordinator.credit.ledger import settle_claims
    from tests.coordinator.conftest import swarm_sees

    status = ContributionState(coordinator="http://coordinator.test", run="shapes", name="lea")

    async def main() -> tuple[list[str], list[str]]:
        keeper, _sent, messages = keeper_for(
            coordinator,
            tmp_path,
            url="http://coordinator.test",
            transport=ThroughTestClient(coordinator),
            status=status,
        )
        clock, stop = keeper.clock, asyncio.Event()

        async def take() -> bool:
            task = asyncio.create_task(keeper._take_one(stop))
            while not task.done():
                await asyncio.sleep(0.01)
                await clock.advance(60)  # type: ignore[attr-defined]
            return task.result()

        async def finish(samples: int) -> None:
            lease_id = next(iter(keeper.outstanding))
            await keeper.finished(
                LeaseDoneEvent(lease_id=lease_id, samples=samples, compute_seconds=1.0, loss=2.5)
            )
            while keeper.outbox.path.exists():  # a report sent before the lease's minimum duration goes again
                await asyncio.sleep(0.05)
                await keeper.flush()

        # an honest peer the swarm has not seen yet: its leases are credited before the swarm confirms them,
        # and after max_unverified_claims (2) it waits for that confirmation
        await finish(64)
        assert await take()
        await finish(64)
        assert not await take()
        swarm_sees(coordinator, keeper.session_id or "")
        resources = coordinator.client.app.state.resources  # type: ignore[attr-defined]
        with resources.store.write() as db:
            settle_claims(db, settings=coordinator.settings, now=resources.clock())
        assert await take()
        routine = list(messages)
        await finish(10_000)  # more than the shard holds: the coordinator caps the claim and flags it
        return routine, messages[len(routine) :]

    return asyncio.run(main())


def worker_messages(tmp_path: Path) -> list[str]:
    """A contribution's lines for what its worker says: ready, syncing, an evaluation, errors."""
    said: list[str] = []
    contribution = Contribution(
        settings=AgentSettings(config_dir=tmp_path / "agent"),
        coordinator="http://c.test",
        run="r",
        name="n",
        on_message=said.append,
    )

    async def main() -> None:
        await contribution._handle_event(
            ReadyEvent(
                peer_id="p",
                maddrs=[],
                parameters=360_000,
                device="cpu",
                threads=1,
                micro_batch_size=16,
                accumulation_steps=1,
                client_mode=False,
            )
        )
        await contribution._handle_event(
            StateEvent(state="syncing", detail="downloading the current model from peers")
        )
        await contribution._handle_event(EvalEvent(metrics={"loss": 1.25, "prompt_accuracy": 0.5}, epoch=7))
        await contribution._handle_event(
            ErrorEvent(message="averaging while idle failed, continuing: timed out")
        )
        await contribution._handle_event(
            ErrorEvent(message="worker failed: RuntimeError: out of memory", fatal=True)
        )

    asyncio.run(main())
    return said


def test_the_demo_shows_the_events_that_matter_and_leaves_lease_lines_to_verbose(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    routine, capped = lease_messages(coordinator, tmp_path)
    notable = worker_messages(tmp_path)
    credited = [m for m in routine if " credited: " in m]
    assert len(credited) == 2 and any("confirm" in m for m in routine), routine  # what the cycle says
    assert len(capped) == 1 and "flagged" in capped[0] and "claimed 10000 samples" in capped[0], capped
    assert len(notable) == 5 and any(m.startswith("evaluation at epoch 7") for m in notable), notable
    assert [m for m in routine if not is_routine(m)] == []
    assert [m for m in capped + notable if is_routine(m)] == []

    def screen(verbose: bool, log: io.StringIO) -> str:
        buffer = io.StringIO()
        display = LiveDisplay("demo", console=Console(file=buffer, width=400), verbose=verbose)
        with display:
            say = _messenger(display, "peer-0", log)
            for text in routine + capped + notable:
                say(text)
        return buffer.getvalue()

    log = io.StringIO()
    quiet = screen(False, log)
    for text in capped + notable:
        assert text in quiet
    for text in credited:
        assert text not in quiet
    assert f"{len(routine)} lease lines not shown (--verbose shows them)" in quiet
    assert all(text in log.getvalue() for text in routine + capped + notable), "the log keeps every line"
    loud = screen(True, io.StringIO())
    assert all(text in loud for text in routine + capped + notable) and "not shown" not in loud


def test_json_lines_keep_every_message(capsys: pytest.CaptureFixture[str]) -> None:
    """Scripts read ``demo --json``: a routine line is a message event like any other."""
    texts = ["lease 0123abcd credited: 256 samples", "evaluation at epoch 3: loss 1.200"]
    say = _messenger(JsonLines(), "peer-1")
    for text in texts:
        say(text)
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["event"], e["text"], e["peer"]) for e in events] == [("message", t, "peer-1") for t in texts]


@pytest.mark.parametrize(
    ("text", "routine"),
    [
        ("lease 0123abcd credited: 256 samples", True),
        ("lease 0123abcd credited: 256 samples (awaiting the swarm's confirmation)", True),
        (
            "lease 0123abcd credited: 256 samples (awaiting the swarm's confirmation; picked for a spot check)",
            True,
        ),
        (
            "lease 0123abcd credited: 64 samples (awaiting the swarm's confirmation; flagged: claimed 90 samples "
            "for a shard of 64)",
            False,
        ),
        (
            "lease 0123abcd credited: 64 samples (flagged: unverified: this peer's progress records are at epoch 2 "
            "while the swarm is at 9: it took no part in the swarm's averaging rounds)",
            True,
        ),
        ("lease 0123abcd was not credited: the lease expired", False),
        ("the coordinator is unreachable: training on unleased data (not credited) until it is back", False),
    ],
)
def test_routine_means_a_credited_lease_with_nothing_but_the_pending_confirmation(
    text: str, routine: bool
) -> None:
    """The wording that leases.py is to use for a claim awaiting the swarm's confirmation, and the flags that
    must stay on screen whichever wording the agent uses."""
    assert is_routine(text) is routine


def test_headless_says_once_that_lease_lines_are_left_out() -> None:
    """``demo --headless`` has no panel footer to count the hidden lines in: one line says they exist."""
    buffer = io.StringIO()
    display = LiveDisplay("demo", console=Console(file=buffer, width=400), plain=True, verbose=False)
    with display:
        for i in range(5):
            display.message(f"lease 0000000{i} credited: 256 samples", who="peer-0")
    text = buffer.getvalue()
    assert text.count("--verbose shows them") == 1 and "credited: 256" not in text, text
    assert display.hidden == 5
