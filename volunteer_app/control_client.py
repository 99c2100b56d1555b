"""Talking to the running agent: finding it, one-shot commands (HTTP) and live connections (websocket).

The shell commands (``volunteer-app status|pause|...``) use :func:`send_command`; the TUI and ``join``
follow the agent with :class:`AgentConnection`, which keeps an up-to-date :class:`AgentState` from the
snapshot and the updates that follow it. The protocol itself is in :mod:`volunteer_app.control`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from volunteer_app.agentfiles import control_token, read_location
from volunteer_app.control import (
    SERVER_MESSAGES,
    AgentState,
    ErrorMessage,
    LogEntry,
    LogMessage,
    ResultMessage,
    SnapshotMessage,
    UpdateMessage,
)
from volunteer_app.settings import AgentSettings


class AgentNotRunning(Exception):
    """No agent runs for this user (or its files are unreadable)."""


class ControlError(Exception):
    """The agent refused a command, or could not be reached; ``code`` says which."""

    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code = code
        self.detail = detail


@dataclass(frozen=True)
class AgentAddress:
    url: str
    token: str
    pid: int | None = None

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/api/v1/ws"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def locate_agent(settings: AgentSettings) -> AgentAddress:
    """Where this user's agent listens, from its state file and the control token.

    :raises AgentNotRunning: no agent holds the lock, or it has not written its address yet.
    """
    location = read_location(settings)
    if location is None:
        raise AgentNotRunning(
            "no agent is running; start one with `volunteer-app agent --background` (or `volunteer-app join ...`)"
        )
    url = location.get("url")
    token = control_token(settings, create=False)
    if not isinstance(url, str) or not token:
        raise AgentNotRunning(
            f"an agent is starting or its files in {settings.config_dir} are unreadable; try again in a moment"
        )
    pid = location.get("pid")
    return AgentAddress(url=url, token=token, pid=pid if isinstance(pid, int) else None)


def send_command(
    address: AgentAddress, command: str, params: dict[str, Any] | None = None, *, timeout: float = 300.0
) -> ResultMessage:
    """One command over HTTP; returns the agent's result or raises :class:`ControlError`."""
    try:
        response = httpx.post(
            f"{address.url}/api/v1/commands/{command}",
            params={k: v for k, v in (params or {}).items() if v is not None},
            headers=address.headers,
            timeout=timeout,
        )
    except httpx.HTTPError as exc:
        raise ControlError("agent_unreachable", f"the agent at {address.url} did not answer: {exc}") from exc
    return _result(response)


def get_state(address: AgentAddress, *, timeout: float = 10.0) -> AgentState:
    try:
        response = httpx.get(f"{address.url}/api/v1/state", headers=address.headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ControlError("agent_unreachable", f"the agent at {address.url} did not answer: {exc}") from exc
    if response.status_code != 200:
        _result(response)
    try:
        return AgentState.model_validate(response.json())
    except (ValueError, ValidationError) as exc:
        raise ControlError("bad_answer", f"the agent sent a state this program cannot read: {exc}") from exc


def _result(response: httpx.Response) -> ResultMessage:
    try:
        data = response.json()
    except ValueError as exc:
        raise ControlError("bad_answer", f"the agent answered {response.status_code} without JSON") from exc
    if response.status_code >= 400:
        error = data.get("error", "error") if isinstance(data, dict) else "error"
        detail = (
            data.get("detail", response.reason_phrase) if isinstance(data, dict) else response.reason_phrase
        )
        raise ControlError(str(error), str(detail))
    try:
        return ResultMessage.model_validate(data)
    except ValidationError as exc:
        raise ControlError("bad_answer", f"the agent sent an answer this program cannot read: {exc}") from exc


class AgentConnection:
    """A live websocket connection: ``state`` follows the agent; ``call`` sends commands.

    Use as ``async with AgentConnection(address) as agent:``; iterate :meth:`events` for what changed
    (a set of state field names, or a :class:`LogEntry`). ``closed`` is set when the agent goes away.
    """

    def __init__(self, address: AgentAddress, *, open_timeout: float = 10.0):
        self.address = address
        self.open_timeout = open_timeout
        self.state: AgentState | None = None
        self.log: list[LogEntry] = []
        self.closed = asyncio.Event()
        self._ws: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future[ResultMessage]] = {}
        self._events: asyncio.Queue[set[str] | LogEntry | None] = asyncio.Queue()

    async def __aenter__(self) -> AgentConnection:
        from websockets.asyncio.client import connect

        try:
            self._ws = await connect(
                self.address.ws_url,
                additional_headers=self.address.headers,
                open_timeout=self.open_timeout,
                max_size=16 << 20,
            )
            first = SERVER_MESSAGES.validate_json(await asyncio.wait_for(self._ws.recv(), self.open_timeout))
        except (OSError, asyncio.TimeoutError) as exc:
            raise ControlError(
                "agent_unreachable", f"cannot connect to the agent at {self.address.url}: {exc}"
            ) from exc
        except ValidationError as exc:
            raise ControlError("bad_answer", f"the agent's first message is unreadable: {exc}") from exc
        except Exception as exc:  # websockets' handshake errors (401, 403) carry the refusal
            raise ControlError("refused", f"the agent refused the connection: {exc}") from exc
        if not isinstance(first, SnapshotMessage):
            raise ControlError("bad_answer", "the agent did not start with a snapshot")
        self.state = first.state
        self.log = list(first.log)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *_exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
        self._finish()

    def _finish(self) -> None:
        self.closed.set()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ControlError("agent_unreachable", "the connection to the agent closed"))
        self._events.put_nowait(None)

    async def _read(self) -> None:
        try:
            async for raw in self._ws:
                try:
                    message = SERVER_MESSAGES.validate_json(raw)
                except ValidationError:
                    continue
                self._dispatch(message)
        except Exception:  # the connection dropped: whoever waits is told through `closed`
            pass
        finally:
            self._finish()

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, UpdateMessage) and self.state is not None:
            try:
                self.state = AgentState.model_validate(
                    {**self.state.model_dump(mode="json"), **message.changes}
                )
            except ValidationError:
                return
            self._events.put_nowait(set(message.changes))
        elif isinstance(message, LogMessage):
            self.log = [*self.log[-999:], message.entry]
            self._events.put_nowait(message.entry)
        elif isinstance(message, (ResultMessage, ErrorMessage)):
            future = self._pending.get(message.id or "")
            if future is not None and not future.done():
                if isinstance(message, ErrorMessage):
                    future.set_exception(ControlError(message.error, message.detail))
                else:
                    future.set_result(message)
        elif isinstance(message, SnapshotMessage):
            self.state = message.state
            self._events.put_nowait(set(AgentState.model_fields))

    async def call(self, command: BaseModel | dict[str, Any], *, timeout: float = 300.0) -> ResultMessage:
        """Send a command; its result, or :class:`ControlError` with the agent's error."""
        if self.closed.is_set():
            raise ControlError("agent_unreachable", "the connection to the agent is closed")
        body = (
            command.model_dump(mode="json", exclude_none=True)
            if isinstance(command, BaseModel)
            else dict(command)
        )
        body["id"] = request_id = str(next(self._ids))
        future: asyncio.Future[ResultMessage] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self._ws.send(json.dumps(body))
            return await asyncio.wait_for(future, timeout=timeout)
        except asyncio.TimeoutError:
            raise ControlError("timeout", "the agent did not answer in time") from None
        except ControlError:
            raise
        except Exception as exc:
            raise ControlError("agent_unreachable", f"the connection to the agent failed: {exc}") from exc
        finally:
            self._pending.pop(request_id, None)

    async def next_event(self, timeout: float | None = None) -> set[str] | LogEntry | None:
        """The next change (a set of state field names) or log entry; None after ``timeout`` or once closed."""
        try:
            item = await asyncio.wait_for(self._events.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if item is None:
            self._events.put_nowait(None)  # closed stays closed for the next caller
        return item

    async def events(self) -> AsyncIterator[set[str] | LogEntry]:
        """What changed, as it arrives: sets of state field names and log entries; ends when closed."""
        while True:
            item = await self.next_event()
            if item is None:
                return
            yield item


class LocalConnection:
    """:class:`AgentConnection`'s interface (``state``, ``call``, ``next_event``, ``closed``) over an agent
    service running in this very process (``volunteer-app join --foreground``): the same follower code
    serves both. Its errors are the service's ``CommandError``, a :class:`ControlError`."""

    def __init__(self, service: Any):
        self.service = service
        self.subscriber = service.hub.subscribe()
        self.closed: asyncio.Event = service.stop_event
        self._pending: list[set[str] | LogEntry] = []

    @property
    def state(self) -> AgentState:
        state: AgentState = self.service.state
        return state

    async def call(self, command: BaseModel, *, timeout: float = 300.0) -> ResultMessage:
        result: ResultMessage = await asyncio.wait_for(self.service.handle(command), timeout=timeout)
        return result

    async def next_event(self, timeout: float | None = None) -> set[str] | LogEntry | None:
        if not self._pending:
            try:
                await asyncio.wait_for(self.subscriber.ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
            changes, log = self.subscriber.take()
            self._pending.extend([set(changes)] if changes else [])
            self._pending.extend(log)
        return self._pending.pop(0) if self._pending else None
