"""The agent's control API: a real AgentService and ControlServer on loopback, real websockets and HTTP.

A UI gets the whole state on connect, then what changes; every refused request (wrong token, foreign
Origin, foreign Host, malformed or binary message) gets a JSON error, and the service keeps running.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from volunteer_app.agent.server import ControlServer
from volunteer_app.agent.service import AgentService
from volunteer_app.agentfiles import AgentAlreadyRunning, control_token
from volunteer_app.control import SensorReadings, json_schema
from volunteer_app.control_client import AgentConnection, ControlError, locate_agent, send_command
from volunteer_app.settings import AgentSettings

pytestmark = pytest.mark.timeout(60)


class StillMachine:
    """Sensor readings of a quiet desktop (the sensors are not what these tests are about)."""

    def __init__(self) -> None:
        self.readings = SensorReadings(cpu_percent=5.0, volunteer_cpu_percent=0.0)

    def read(self, *, exclusive_apps: list[str] | None = None) -> SensorReadings:
        return self.readings


class Agent:
    def __init__(self, service: AgentService, server: ControlServer, token: str):
        self.service, self.server, self.token = service, server, token

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def ws(self) -> str:
        return self.url.replace("http", "ws") + "/api/v1/ws"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def agent_test(body: Callable[[Agent, AgentSettings], Awaitable[None]], tmp_path: Path) -> None:
    settings = AgentSettings(config_dir=tmp_path / "config")

    async def main() -> None:
        service = AgentService(
            settings=settings, sensors=StillMachine(), policy_interval=0.2, publish_interval=0.05
        )
        service.acquire()
        token = control_token(settings, create=True)
        assert token is not None
        server = ControlServer(service, host="127.0.0.1", port=0, token=token)
        url = await server.start()
        service.write_location(url=url, host="127.0.0.1", port=server.port)
        runner = asyncio.create_task(service.run())
        try:
            await body(Agent(service, server, token), settings)
            assert not runner.done(), "the agent service must keep running"
        finally:
            service.request_stop()
            await runner
            await server.close()
            service.release()

    asyncio.run(main())


async def receive(ws: Any) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), 10))


async def until(ws: Any, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    while True:
        message = await receive(ws)
        if predicate(message):
            return message


def test_snapshot_on_connect_then_the_changes(tmp_path: Path) -> None:
    async def body(agent: Agent, _settings: AgentSettings) -> None:
        async with connect(agent.ws, additional_headers=agent.auth) as ws:
            first = await receive(ws)
            assert first["type"] == "snapshot" and first["version"] == 1
            assert first["state"]["state"] == "idle" and first["state"]["paused_by_user"] is False
            await ws.send(json.dumps({"id": "p1", "command": "pause"}))
            result = await until(ws, lambda m: m["type"] == "result")
            assert result["id"] == "p1" and "paused" in result["message"]
            update = await until(ws, lambda m: m["type"] == "update" and "paused_by_user" in m["changes"])
            assert update["changes"]["paused_by_user"] is True
            assert update["changes"]["policy"]["reasons"] == ["paused by you"]
            log = await until(ws, lambda m: m["type"] == "log")
            assert "pausing: paused by you" in log["entry"]["message"]

    agent_test(body, tmp_path)


def test_a_second_ui_sees_what_the_first_changed(tmp_path: Path) -> None:
    async def body(agent: Agent, settings: AgentSettings) -> None:
        address = locate_agent(settings)
        async with AgentConnection(address) as first, AgentConnection(address) as second:
            assert second.state is not None and second.state.settings.max_threads is None
            result = await first.call({"command": "settings", "values": {"max_threads": 1}})
            assert result.message.startswith("max_threads = 1")
            while second.state.settings.max_threads != 1:
                assert await second.next_event(10) is not None, "no update reached the second UI"

    agent_test(body, tmp_path)


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "invalid_token"),
        ({"Authorization": "Bearer not-the-token"}, 401, "invalid_token"),
        ({"Authorization": "Basic abc"}, 401, "invalid_token"),
        ({"Origin": "https://evil.example"}, 403, "forbidden_origin"),
        ({"Host": "attacker.example:80"}, 403, "forbidden_host"),
    ],
)
def test_refused_requests_get_a_json_error_and_the_agent_goes_on(
    tmp_path: Path, headers: dict[str, str], status: int, code: str
) -> None:
    async def body(agent: Agent, _settings: AgentSettings) -> None:
        sent = dict(headers)
        if code != "invalid_token":
            sent.setdefault("Authorization", agent.auth["Authorization"])
        async with httpx.AsyncClient() as client:
            answer = await client.get(f"{agent.url}/api/v1/state", headers=sent)
            assert answer.status_code == status
            assert answer.json()["error"] == code
            command = await client.post(f"{agent.url}/api/v1/commands/pause", headers=sent)
            assert command.status_code == status
        with pytest.raises(InvalidStatus) as refused:
            async with connect(agent.ws, additional_headers=sent):
                pass
        assert refused.value.response.status_code == status
        assert json.loads(refused.value.response.body)["error"] == code
        assert agent.service.state.paused_by_user is False, "a refused request must change nothing"
        async with connect(agent.ws, additional_headers=agent.auth) as ws:
            assert (await receive(ws))["type"] == "snapshot"

    agent_test(body, tmp_path)


def test_the_agents_own_origin_is_accepted(tmp_path: Path) -> None:
    async def body(agent: Agent, _settings: AgentSettings) -> None:
        headers = {**agent.auth, "Origin": agent.url}
        async with connect(agent.ws, additional_headers=headers) as ws:
            assert (await receive(ws))["type"] == "snapshot"

    agent_test(body, tmp_path)


@pytest.mark.parametrize(
    ("frame", "detail"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"id": "x", "command": "fly"}), "does not match any of the expected tags"),
        (json.dumps({"id": "x", "command": "snooze"}), "seconds: Field required"),
        (json.dumps({"id": "x", "command": "snooze", "seconds": -5}), "greater than 0"),
        (json.dumps({"id": "x", "command": "pause", "extra": 1}), "Extra inputs are not permitted"),
        (b"\x00\x01binary", "binary messages"),
    ],
)
def test_malformed_messages_get_an_error_reply_and_the_connection_stays(
    tmp_path: Path, frame: str | bytes, detail: str
) -> None:
    async def body(agent: Agent, _settings: AgentSettings) -> None:
        async with connect(agent.ws, additional_headers=agent.auth) as ws:
            await receive(ws)
            await ws.send(frame)
            error = await until(ws, lambda m: m["type"] == "error")
            assert error["error"] == "invalid_message"
            assert detail in error["detail"]
            await ws.send(json.dumps({"id": "after", "command": "ping"}))
            pong = await until(ws, lambda m: m["type"] == "result")
            assert pong["id"] == "after" and "running" in pong["message"]

    agent_test(body, tmp_path)


def test_one_shot_http_commands(tmp_path: Path) -> None:
    async def body(agent: Agent, settings: AgentSettings) -> None:
        address = locate_agent(settings)
        result = await asyncio.to_thread(send_command, address, "snooze", {"duration": "2h"})
        assert result.message.startswith("snoozed for 2 h")
        assert agent.service.state.snoozed_until is not None
        assert any("snoozed until" in r for r in agent.service.state.policy.reasons)
        with pytest.raises(ControlError) as unknown:
            await asyncio.to_thread(send_command, address, "fly")
        assert unknown.value.code == "unknown_command"
        with pytest.raises(ControlError) as not_joined:
            await asyncio.to_thread(send_command, address, "finish")
        assert not_joined.value.code == "not_joined" and "not contributing" in not_joined.value.detail
        with pytest.raises(ControlError) as bad:
            await asyncio.to_thread(send_command, address, "settings", {"max_threads": "0"})
        assert bad.value.code == "invalid_setting" and "max_threads" in bad.value.detail
        async with httpx.AsyncClient() as client:
            wrong_method = await client.get(f"{agent.url}/api/v1/commands/pause", headers=agent.auth)
            assert wrong_method.status_code == 405 and wrong_method.json()["error"] == "method_not_allowed"
            schema = await client.get(f"{agent.url}/api/v1/schema", headers=agent.auth)
            assert schema.json() == json.loads(json.dumps(json_schema()))
            health = await client.get(f"{agent.url}/api/v1/health")
            assert health.json() == {"ok": True, "service": "volunteer-app-agent"}

    agent_test(body, tmp_path)


def test_one_agent_per_user(tmp_path: Path) -> None:
    async def body(agent: Agent, settings: AgentSettings) -> None:
        second = AgentService(settings=settings, sensors=StillMachine())
        with pytest.raises(AgentAlreadyRunning) as refused:
            second.acquire()
        assert agent.url in str(refused.value) and str(os.getpid()) in str(refused.value)

    agent_test(body, tmp_path)


def test_private_files_and_settings_survive_a_restart(tmp_path: Path) -> None:
    async def body(agent: Agent, settings: AgentSettings) -> None:
        await agent.service.handle_text({"command": "settings", "values": {"schedule": ["sat,sun all"]}})
        await agent.service.handle_text({"command": "pause"})

    agent_test(body, tmp_path)
    settings = AgentSettings(config_dir=tmp_path / "config")
    for path in (settings.control_token_path, settings.policy_path, settings.memory_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    again = AgentService(settings=settings, sensors=StillMachine())
    assert again.state.settings.schedule == ["sat,sun all"]
    assert again.state.paused_by_user is True, "a pause must survive an agent restart"


def test_a_damaged_settings_file_is_set_aside_not_lost(tmp_path: Path) -> None:
    settings = AgentSettings(config_dir=tmp_path / "config")
    settings.config_dir.mkdir(parents=True)
    settings.policy_path.write_text('{"max_threads": "many"')
    service = AgentService(settings=settings, sensors=StillMachine())
    kept = list(settings.config_dir.glob("settings.damaged-*.json"))
    assert len(kept) == 1 and kept[0].read_text() == '{"max_threads": "many"'
    assert service.state.settings.max_threads is None
    assert any("damaged" in entry.message for entry in service.hub.log)
