"""The agent's parts, each alone: the outbox, the restart budget, the clock, the lease keeper (against the
real coordinator app over ASGI), the speed-test cache and a contribution's pause bookkeeping."""

from __future__ import annotations

import asyncio
import json
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Coordinator
from volunteer_app.agent.clock import ManualClock
from volunteer_app.agent.contribution import Contribution
from volunteer_app.agent.leases import MAX_LEASES, TOO_MANY_LEASES_RETRY_SECONDS, LeaseKeeper
from volunteer_app.agent.link import CoordinatorLink, backoff_delay
from volunteer_app.agent.outbox import LeaseReport, Outbox
from volunteer_app.agent.speedtest import SpeedTestCache
from volunteer_app.agent.worker import RestartBudget
from volunteer_app.client import CoordinatorClient, CoordinatorRefused
from volunteer_app.control import ContributionState, parse_duration
from volunteer_app.protocol import Command, LeaseCompleteRequest, TaskBenchmark
from volunteer_app.settings import AgentSettings
from volunteer_app.worker_protocol import DropLeaseCommand, LeaseCommand, LeaseDoneEvent, ProgressEvent


# ----------------------------------------------------------------------------------------- outbox
def _report(lease_id: str) -> LeaseReport:
    return LeaseReport(
        coordinator="http://c", session_id="s", lease_id=lease_id,
        report=LeaseCompleteRequest(samples=64, compute_seconds=1.0),
    )  # fmt: skip


def test_outbox_keeps_reports_in_a_private_file(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.json")
    outbox.add(_report("a"))
    outbox.add(_report("b"))
    assert stat.S_IMODE(outbox.path.stat().st_mode) == 0o600
    assert [item.lease_id for item in Outbox(outbox.path).load()] == ["a", "b"]
    assert Outbox(outbox.path).load()[0].report.samples == 64
    outbox.save([])
    assert not outbox.path.exists()


def test_an_outbox_of_an_earlier_version_is_read_and_a_bad_report_left_out(tmp_path: Path) -> None:
    """Reports written before they were typed (their fields beside the lease's) still go out; one that does
    not parse is left out and said, the others stay."""
    path = tmp_path / "outbox.json"
    path.write_text(
        '[{"coordinator": "http://c", "session_id": "s", "lease_id": "old", "samples": 64, '
        '"compute_seconds": 2.5, "loss": null}, {"lease_id": "broken"}]'
    )
    dropped: list[object] = []
    loaded = Outbox(path, on_unreadable=dropped.append).load()
    assert [(r.lease_id, r.report.samples, r.report.compute_seconds) for r in loaded] == [("old", 64, 2.5)]
    assert dropped == [{"lease_id": "broken"}]


@pytest.mark.parametrize("damage", ['[{"lease_id": "a"', '{"not": "a list"}', "[1, 2]", "\x00\xff"])
def test_a_damaged_outbox_is_set_aside_not_lost(tmp_path: Path, damage: str) -> None:
    told: list[Path] = []
    path = tmp_path / "outbox.json"
    path.write_text(damage)
    outbox = Outbox(path, on_damaged=told.append)
    assert outbox.load() == []
    assert len(told) == 1 and told[0].read_text() == damage, "the damaged file must be kept, byte for byte"
    assert not path.exists()
    outbox.add(_report("c"))
    assert outbox.load() == [_report("c")]


# ----------------------------------------------------------------------------------------- time
def test_restart_budget_backs_off_then_gives_up_then_recovers() -> None:
    async def main() -> None:
        clock = ManualClock()
        budget = RestartBudget(limit=3, clock=clock, window=3600)
        delays = [budget.failed() for _ in range(3)]
        assert all(d is not None for d in delays)
        assert delays[0] < 2.5 and delays[2] > delays[0], delays
        assert budget.failed() is None, "the fourth crash within the hour must give up"
        await clock.advance(3601)
        assert budget.recent_failures == 0
        assert budget.failed() is not None

    asyncio.run(main())


def test_backoff_grows_to_its_cap() -> None:
    assert 0.5 <= backoff_delay(1) <= 2.0
    assert backoff_delay(20, cap=60) <= 61
    assert backoff_delay(20, cap=60) >= 59


def test_manual_clock_wakes_sleepers_in_order_without_waiting() -> None:
    async def main() -> None:
        clock = ManualClock()
        woke: list[str] = []

        async def sleeper(name: str, seconds: float) -> None:
            await clock.sleep(seconds)
            woke.append(name)

        tasks = [asyncio.create_task(sleeper("late", 10)), asyncio.create_task(sleeper("early", 5))]
        await asyncio.sleep(0)
        start = clock.time()
        await clock.advance(6)
        assert woke == ["early"]
        await clock.advance(5)
        assert woke == ["early", "late"] and clock.time() == start + 11
        event = asyncio.Event()
        waiter = asyncio.create_task(clock.wait(event, 30))
        await asyncio.sleep(0)
        event.set()
        assert await waiter is True
        await asyncio.gather(*tasks)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2h", 7200), ("90m", 5400), ("1h30m", 5400), ("45s", 45), ("1d", 86400), ("600", 600)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


# ----------------------------------------------------------------------------------------- leases
class ThroughTestClient(httpx.AsyncBaseTransport):
    """Async requests answered by the coordinator app running in a TestClient (with its lifespan)."""

    def __init__(self, coordinator: Coordinator):
        self.client = coordinator.client

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url.raw_path.decode()
        answer = await asyncio.to_thread(
            self.client.request, request.method, url, headers=dict(request.headers), content=request.content
        )
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)


class Sent:
    def __init__(self) -> None:
        self.leases: list[str] = []
        self.dropped: list[str] = []

    async def __call__(self, command: Any) -> bool:
        if isinstance(command, DropLeaseCommand):
            self.dropped.append(command.lease_id)
        else:
            assert isinstance(command, LeaseCommand)
            self.leases.append(command.lease.lease_id)
        return True


def keeper_for(
    coordinator: Coordinator, tmp_path: Path, *, url: str, transport: Any, status: ContributionState
) -> tuple[LeaseKeeper, Sent, list[str]]:
    volunteer = coordinator.register("lea")
    coordinator.create_run()
    joined = coordinator.join(volunteer)
    messages: list[str] = []
    clock = ManualClock()
    client = CoordinatorClient(url, credential=volunteer.credential, transport=transport)
    link = CoordinatorLink(client=client, clock=clock, stop=asyncio.Event(), on_message=messages.append,
                           on_reachable=lambda ok: setattr(status, "coordinator_ok", ok))  # fmt: skip
    sent = Sent()
    keeper = LeaseKeeper(
        link=link, outbox=Outbox(tmp_path / "outbox.json"), coordinator=url, clock=clock, status=status, send=sent,
        on_message=messages.append, on_refused=lambda exc: asyncio.sleep(0), on_run_finished=lambda: None,
    )  # fmt: skip
    from volunteer_app.protocol import LeaseOut

    keeper.reset(joined["session_id"], LeaseOut.model_validate(joined["lease"]))
    return keeper, sent, messages


TEST_URL = "http://coordinator.test"


def keeper_through_test_client(
    coordinator: Coordinator, tmp_path: Path, status: ContributionState
) -> tuple[LeaseKeeper, Sent, list[str]]:
    """:func:`keeper_for` reaching the coordinator through its TestClient, at :data:`TEST_URL`."""
    return keeper_for(
        coordinator, tmp_path, url=TEST_URL, transport=ThroughTestClient(coordinator), status=status
    )


def test_lease_keeper_keeps_two_leases_and_reports_through_the_outbox(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    status = ContributionState(coordinator=TEST_URL, run="shapes", name="lea")
    transport = ThroughTestClient(coordinator)

    async def main() -> None:
        keeper, sent, messages = keeper_for(
            coordinator, tmp_path, url=TEST_URL, transport=transport, status=status
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(keeper.run(stop))

        async def leases_in_hand(what: str) -> None:
            # The keeper may ask for the replacement while the finished lease's report is still held back
            # by its minimum duration (wall time); the coordinator then answers "too many leases" and the
            # keeper retries after a pause on its clock, which in this test is a manual one: move it on.
            # (Without that, this wait hung past the test's 300 s timeout once in CI.)
            deadline = time.monotonic() + 60
            while len(keeper.outstanding) < MAX_LEASES:
                assert time.monotonic() < deadline, (what, len(keeper.outstanding), status, messages)
                await asyncio.sleep(0.01)
                await keeper.clock.advance(1.0)

        await leases_in_hand("the join answer's lease plus one more")
        assert len(sent.leases) == MAX_LEASES - 1, "the join answer's lease plus one more"
        assert status.leases_in_hand == MAX_LEASES
        first = next(iter(keeper.outstanding))
        await keeper.finished(LeaseDoneEvent(lease_id=first, samples=64, compute_seconds=30.0, loss=2.5))
        # a report sent before the lease's minimum duration waits and goes again (a deadline, not a count of
        # tries: on a busy machine each flush is slow and the minimum duration is wall time)
        deadline = time.monotonic() + 30
        while not status.leases_completed and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            await keeper.flush()
        assert status.leases_completed == 1, messages
        assert status.samples_credited > 0, messages
        assert not keeper.outbox.path.exists(), "a report the coordinator answered leaves the outbox"
        await leases_in_hand("the finished lease replaced")
        stop.set()
        keeper.wanted.set()
        await runner

    asyncio.run(main())


def test_reports_wait_in_the_outbox_while_the_coordinator_is_unreachable(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    status = ContributionState(coordinator=TEST_URL, run="shapes", name="lea")

    async def main() -> None:
        keeper, _sent, messages = keeper_through_test_client(coordinator, tmp_path, status)
        lease = next(iter(keeper.outstanding))
        reachable = keeper.link.client
        keeper.link.client = CoordinatorClient(
            "http://127.0.0.1:9", credential=reachable.credential, timeout=2
        )
        await keeper.finished(LeaseDoneEvent(lease_id=lease, samples=64, compute_seconds=30.0, loss=2.5))
        assert status.coordinator_ok is False
        waiting = json.loads(keeper.outbox.path.read_text())
        assert [item["lease_id"] for item in waiting] == [lease], "the report must wait on disk"
        assert status.leases_completed == 0
        keeper.link.client = reachable
        await keeper.flush()
        assert status.coordinator_ok is True
        deadline = time.monotonic() + 30  # the lease's minimum duration is wall time (see above)
        while not status.leases_completed and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            await keeper.flush()
        assert status.leases_completed == 1, messages
        assert not keeper.outbox.path.exists()
        assert "the coordinator is reachable again" in messages

    asyncio.run(main())


def test_a_lease_near_its_deadline_is_given_back_and_its_shard_goes_to_the_next_peer(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    status = ContributionState(coordinator=TEST_URL, run="shapes", name="lea")

    async def main() -> None:
        keeper, sent, messages = keeper_through_test_client(coordinator, tmp_path, status)
        lease = keeper.outstanding[next(iter(keeper.outstanding))]
        status.lease_id, status.lease_samples_done = lease.lease_id, 40
        clock = ManualClock(start=lease.deadline - 120)
        keeper.clock = clock
        # 120 s left; the rest (lease.samples - 40) takes 60 s at 1/60 of the lease per second, + 30 s margin
        rate = (lease.samples - 40) / 60
        assert await keeper.return_due(samples_per_second=rate, margin=30) == 0, "it can still be finished"
        await clock.advance(31)
        assert await keeper.return_due(samples_per_second=rate, margin=30) == 1
        assert sent.dropped == [lease.lease_id], "the worker is told to forget it"
        assert keeper.outstanding == {} and status.leases_in_hand == 0
        assert status.samples_unleased == 40, "what was trained on it is shown as uncredited, not lost"
        assert any("gave it back" in m for m in messages), messages
        # the shard is free again: the next volunteer to join gets exactly that shard
        other = coordinator.join(coordinator.register("ben"))
        assert other["lease"]["shard"] == lease.shard
        # asking again is harmless; reporting the returned lease is refused with a clear reason
        answer = await keeper.link.client.return_lease(keeper.session_id or "", lease.lease_id)
        assert answer.already_returned
        with pytest.raises(CoordinatorRefused) as refused:
            await keeper.link.client.complete_lease(
                keeper.session_id or "", lease.lease_id, LeaseCompleteRequest(samples=64, compute_seconds=9.0)
            )
        assert refused.value.code == "lease_returned"

    asyncio.run(main())


def test_a_volunteer_without_work_is_told_why_once_and_when_work_comes_back(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    from tests.coordinator.conftest import swarm_sees

    status = ContributionState(coordinator=TEST_URL, run="shapes", name="lea")

    async def main() -> None:
        keeper, _sent, messages = keeper_through_test_client(coordinator, tmp_path, status)
        clock = keeper.clock
        assert isinstance(clock, ManualClock)
        stop = asyncio.Event()

        async def take() -> bool:
            task = asyncio.create_task(keeper._take_one(stop))
            while not task.done():
                await asyncio.sleep(0.01)
                await clock.advance(60)
            return task.result()

        async def finish(lease_id: str) -> None:
            await keeper.finished(
                LeaseDoneEvent(lease_id=lease_id, samples=64, compute_seconds=1.0, loss=2.5)
            )
            while keeper.outbox.path.exists():  # a report sent before the lease's minimum duration goes again
                await asyncio.sleep(0.05)
                await keeper.flush()

        # the swarm never saw this peer: after max_unverified_claims (2) finished shards, no more work
        await finish(next(iter(keeper.outstanding)))
        assert await take()
        await finish(next(iter(keeper.outstanding)))
        for _ in range(3):
            assert not await take()
        waiting = [m for m in messages if "waiting for the swarm to confirm" in m]
        assert len(waiting) == 1, messages
        swarm_sees(coordinator, keeper.session_id or "")  # type: ignore[arg-type]
        resources = coordinator.client.app.state.resources  # type: ignore[attr-defined]
        from coordinator.credit.ledger import settle_claims

        with resources.store.write() as db:
            assert settle_claims(db, settings=coordinator.settings, now=resources.clock())[0] == 2
        assert await take()
        assert messages[-1] == "the coordinator has work for this machine again", messages

    asyncio.run(main())


def test_resuming_after_finish_takes_work_again(coordinator: Coordinator, tmp_path: Path) -> None:
    """Finish with one lease in hand, then resume: no lease is taken while finishing or paused, and one is
    taken at once on resuming (the agent used to wait for the worker to ask, which the worker had already
    done while finishing: nobody asked again and no work came)."""
    status = ContributionState(coordinator=TEST_URL, run="shapes", name="lea")

    async def main() -> None:
        keeper, sent, _messages = keeper_through_test_client(coordinator, tmp_path, status)
        contribution = Contribution(
            settings=AgentSettings(config_dir=tmp_path), coordinator=TEST_URL, run="shapes",
            name="lea",
        )  # fmt: skip
        contribution.leases, contribution.status = keeper, status
        finished: list[bool] = []
        contribution.on_finished_lease = lambda: finished.append(True)
        (lease,) = keeper.outstanding
        status.state, status.lease_id = "training", lease
        await contribution.set_finishing(True)  # "f": no new lease, pause once this one is reported
        stop = asyncio.Event()
        runner = asyncio.create_task(keeper.run(stop))
        await asyncio.sleep(0.2)
        assert sent.leases == [], "finishing takes no new lease"
        await keeper.finished(LeaseDoneEvent(lease_id=lease, samples=64, compute_seconds=30.0, loss=2.5))
        status.lease_id = None
        idle = ProgressEvent(
            state="waiting", samples_total=64, samples_per_second=0.0, loss=2.5, local_epoch=0, global_epoch=0,
            swarm_size=1, samples_accumulated=64, averaging_rounds=0, failed_rounds=0, bytes_sent=0,
            bytes_received=0, lease_id=None, lease_samples_done=0, lease_samples=0, compute_seconds=30.0,
        )  # fmt: skip
        await contribution._handle_event(idle)  # the worker has nothing left: the finish is complete
        assert finished == [True]
        await contribution.pause()  # what the service does when the lease is finished
        await asyncio.sleep(0.2)
        assert sent.leases == [] and keeper.outstanding == {}, "no lease is taken to sit through a pause"
        await contribution.resume()
        for _ in range(100):
            if sent.leases:
                break
            await asyncio.sleep(0.05)
        assert len(sent.leases) >= 1, "resuming must bring work"
        stop.set()
        keeper.wanted.set()
        await runner

    asyncio.run(main())


def test_leases_the_agent_lost_track_of_do_not_stop_it_for_good(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """The coordinator says "too many leases" for leases whose replies never reached the agent: the agent
    asks again later, and gets work once they come free."""
    status = ContributionState(coordinator=TEST_URL, run="shapes", name="lea")

    async def main() -> None:
        keeper, sent, _messages = keeper_through_test_client(coordinator, tmp_path, status)
        clock = keeper.clock
        assert isinstance(clock, ManualClock)
        stop = asyncio.Event()
        runner = asyncio.create_task(keeper.run(stop))
        while len(keeper.outstanding) < MAX_LEASES:
            await asyncio.sleep(0.01)
        lost = list(keeper.outstanding)
        keeper.outstanding.clear()  # both replies lost, as it were
        keeper.wanted.set()
        await asyncio.sleep(0.3)
        taken = len(sent.leases)
        assert keeper.outstanding == {}, "the coordinator refuses while it counts the lost leases"
        for lease_id in lost:  # they come free (their deadline passes; here: given back)
            await keeper.link.client.return_lease(keeper.session_id or "", lease_id)
        for _ in range(20):
            await clock.advance(TOO_MANY_LEASES_RETRY_SECONDS)
            await asyncio.sleep(0.05)
            if len(sent.leases) > taken:
                break
        assert len(sent.leases) > taken and keeper.outstanding, "the agent must ask again"
        stop.set()
        keeper.wanted.set()
        await runner

    asyncio.run(main())


# ----------------------------------------------------------------------------------------- speed test cache
def test_speed_test_cache_survives_a_damaged_file(tmp_path: Path) -> None:
    cache = SpeedTestCache(tmp_path / "benchmarks.json")
    result = TaskBenchmark(task="shapes-dalle", threads=1, micro_batch_size=16, samples_per_second=100.0)
    cache.put("k", result)
    assert SpeedTestCache(cache.path).get("k") == result
    cache.path.write_text("{broken")
    assert cache.get("k") is None
    cache.put("k", result)
    assert cache.get("k") == result


# ----------------------------------------------------------------------------------------- pauses
def test_pause_reasons_from_the_volunteer_the_policy_and_the_organizers_combine(tmp_path: Path) -> None:
    async def main() -> None:
        contribution = Contribution(
            settings=AgentSettings(config_dir=tmp_path), coordinator="http://c.test", run="r", name="n"
        )
        await contribution.set_pause(["running on battery"], by="policy")
        assert (
            contribution.status.pause_reasons == ["running on battery"]
            and contribution.status.paused_by == "policy"
        )
        contribution._join = object()  # type: ignore[assignment]
        await contribution._apply_commands([Command(type="pause", reason="maintenance")])
        assert contribution.status.pause_reasons == ["running on battery", "paused by the run's organizers"]
        await contribution.set_pause([], by=None)
        assert contribution.status.pause_reasons == ["paused by the run's organizers"]
        assert contribution.status.paused_by == "organizers"
        await contribution._apply_commands([Command(type="resume")])
        assert contribution.status.pause_reasons == [] and contribution.status.paused_by is None

    asyncio.run(main())


def test_a_worker_that_stops_unasked_does_not_end_the_contribution(tmp_path: Path) -> None:
    """A worker that gave up (its model broke, say) ends with state "stopped"; the agent restarts it, so
    the contribution must not look stopped (``join --foreground`` and the app end when it does)."""
    from volunteer_app.worker_protocol import StateEvent

    async def main() -> None:
        contribution = Contribution(
            settings=AgentSettings(config_dir=tmp_path), coordinator="http://c.test", run="r", name="n"
        )
        await contribution._handle_event(StateEvent(state="training"))
        await contribution._handle_event(StateEvent(state="stopping"))
        await contribution._handle_event(StateEvent(state="stopped"))
        assert contribution.status.state == "stopping"

    asyncio.run(main())


# ----------------------------------------------------------------------------------------- isolation
def test_a_worker_whose_rounds_keep_failing_while_others_train_says_its_work_is_not_reaching_the_model(
    tmp_path: Path,
) -> None:
    def progress(rounds: int, failed: int, swarm: int = 2) -> ProgressEvent:
        return ProgressEvent(
            state="training", samples_total=64, samples_per_second=10.0, loss=2.5, local_epoch=failed,
            global_epoch=failed, swarm_size=swarm, samples_accumulated=0, averaging_rounds=rounds,
            failed_rounds=failed, bytes_sent=0, bytes_received=0, lease_id=None, lease_samples_done=0,
            lease_samples=0, compute_seconds=1.0,
        )  # fmt: skip

    async def main() -> None:
        messages: list[str] = []
        contribution = Contribution(
            settings=AgentSettings(config_dir=tmp_path), coordinator="http://c.test", run="r", name="n",
            on_message=messages.append,
        )  # fmt: skip
        contribution.status.reachability = "client"
        status = contribution.status
        for failed in range(3):  # alone, failing rounds is expected: nobody to average with
            await contribution._handle_event(progress(0, failed, swarm=1))
        assert status.isolated is None
        await contribution._handle_event(progress(1, 2))  # it averaged once: counting starts there
        await contribution._handle_event(progress(1, 4))
        assert status.isolated is None, "two failed rounds in a row are weather, not isolation"
        await contribution._handle_event(progress(1, 5))
        assert status.isolated is not None and "last 3 rounds" in status.isolated
        assert "two clients cannot average with each other" in status.isolated
        assert sum("not reaching the shared model" in m for m in messages) == 1
        await contribution._handle_event(progress(1, 9))
        assert sum("not reaching the shared model" in m for m in messages) == 1, "said once, not every report"
        await contribution._handle_event(progress(2, 9))
        assert status.isolated is None and messages[-1] == "averaging with the swarm again"
        # a restarted worker counts from zero: its first reports are not read as rounds gone backwards
        contribution._last_averaged = (0, 0)
        await contribution._handle_event(progress(0, 2))
        assert status.isolated is None

    asyncio.run(main())


def test_a_worker_cut_off_from_averaging_has_its_reachability_checked_again_at_most_every_interval(
    tmp_path: Path,
) -> None:
    """A direct verdict goes stale when the network changes (a laptop moves behind a router): an isolated worker
    makes the agent join again, and the coordinator dials it back anew; not in a loop."""

    class Worker:  # the worker process's side of a restart: asked to stop, it stops
        running = True

        def __init__(self) -> None:
            self.stops: list[float] = []

        async def stop(self, grace: float, on_late: Callable[[str], None] | None = None) -> None:
            self.stops.append(grace)

    def failing(failed: int) -> ProgressEvent:
        return ProgressEvent(
            state="training", samples_total=64, samples_per_second=10.0, loss=2.5, local_epoch=failed,
            global_epoch=failed, swarm_size=3, samples_accumulated=0, averaging_rounds=0, failed_rounds=failed,
            bytes_sent=0, bytes_received=0, lease_id=None, lease_samples_done=0, lease_samples=0,
            compute_seconds=1.0,
        )  # fmt: skip

    async def main() -> None:
        clock = ManualClock()
        messages: list[str] = []
        contribution = Contribution(
            settings=AgentSettings(config_dir=tmp_path, reachability_recheck=600), coordinator="http://c.test",
            run="r", name="n", clock=clock, on_message=messages.append,
        )  # fmt: skip
        worker = Worker()
        contribution._worker = worker  # type: ignore[assignment]
        contribution._reachability_checked = clock.time() - 3600  # the last join was an hour ago
        contribution.status.reachability = "direct"
        for failed in range(4):
            await contribution._handle_event(failing(failed))
        await asyncio.sleep(0.05)  # the restart runs in the background
        assert contribution.status.isolated is not None
        assert worker.stops == [60.0] and contribution._rejoin, "an isolated worker joins again"
        assert any("checking again how other peers reach this computer" in m for m in messages), messages
        # the rejoined worker is still cut off (a client without a relay): no second check before the interval
        contribution._rejoin = False
        contribution._last_averaged = (0, 0)
        contribution.status.isolated = None
        for failed in range(4):
            await contribution._handle_event(failing(failed))
        await asyncio.sleep(0.05)
        assert worker.stops == [60.0] and not contribution._rejoin
        await clock.advance(601)
        contribution.status.isolated, contribution._last_averaged = None, (0, 0)
        for failed in range(4):
            await contribution._handle_event(failing(failed))
        await asyncio.sleep(0.05)
        assert worker.stops == [60.0, 60.0], "checked again once the interval has passed"

    asyncio.run(main())
