"""The agent's local control API: a websocket for UIs and a few HTTP calls for one-shot commands.

The protocol (messages, versions, what each command does) is documented in :mod:`volunteer_app.control`.
This module is the transport, on the ``websockets`` library:

* every request must present the control token (``Authorization: Bearer ...``) except
  ``GET /api/v1/health``, which says only that an agent listens here;
* a request whose ``Origin`` is not the agent's own is refused (403): a web page the volunteer visits
  cannot drive the agent through the volunteer's browser (cross-site websocket hijacking);
* a request whose ``Host`` is not the agent's own address is refused (403): DNS rebinding;
* it listens on 127.0.0.1 unless started with ``allow_remote`` (and then still needs the token).

A malformed or refused websocket message gets an ``error`` reply and the connection stays open; a
slow UI never holds the agent up, because each connection is sent the *latest* values of the fields
that changed, coalesced, not a queue of every change.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import http
import json
import logging
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pydantic import ValidationError
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from volunteer_app import __version__
from volunteer_app.agent.service import AgentService, CommandError
from volunteer_app.control import (
    COMMANDS,
    PROTOCOL_VERSION,
    ErrorMessage,
    LogMessage,
    UpdateMessage,
    json_schema,
    parse_duration,
    parse_setting,
    validation_problems,
)

logger = logging.getLogger(__name__)

PREFIX = "/api/v1"
MAX_MESSAGE_BYTES = 1 << 20
COMMAND_SECONDS = 660.0
"""The longest a command may take to answer over HTTP (leaving waits up to 240 s for the worker, an
evaluation up to 300 s)."""
ERROR_STATUS = {
    "not_joined": 409,
    "already_joined": 409,
    "not_ready": 409,
    "timeout": 409,
    "unknown_command": 404,
    "invalid_message": 422,
    "invalid_setting": 422,
    "unknown_setting": 422,
}


def _json_response(status: int, body: Any) -> Response:
    data = json.dumps(body).encode()
    headers = Headers(
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(data))),
            ("Cache-Control", "no-store"),
            ("Connection", "close"),
        ]
    )
    return Response(status, http.HTTPStatus(status).phrase, headers, data)


def _error(status: int, code: str, detail: str) -> Response:
    return _json_response(status, ErrorMessage(error=code, detail=detail).model_dump(mode="json"))


class ControlServer:
    """Serves :class:`AgentService` on ``host:port``.

    :param token: the control token every request must present.
    :param allow_remote: accept any ``Host`` header (listening beyond loopback was asked for explicitly).
    """

    def __init__(
        self, service: AgentService, *, host: str, port: int, token: str, allow_remote: bool = False
    ):
        self.service = service
        self.host = host
        self.port = port
        self.token = token
        self.allow_remote = allow_remote
        self._server: Server | None = None
        self.url = ""
        self.connections = 0
        self._commands: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await serve(
            self._handler,
            self.host,
            self.port,
            process_request=self._process_request,
            max_size=MAX_MESSAGE_BYTES,
            server_header=f"volunteer-app-agent/{__version__}",
            ping_interval=20,
            ping_timeout=20,
            # an HTTP command is answered from inside the opening handshake: give the longest (leave, stop:
            # the worker leaves the swarm; evaluate) the time it takes, not websockets' default of 10 s
            open_timeout=COMMAND_SECONDS,
        )
        socket = next(iter(self._server.sockets))
        self.port = socket.getsockname()[1]
        shown = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        self.url = f"http://{shown}:{self.port}"
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), timeout=5)

    # ------------------------------------------------------------------ checks
    def _allowed_hosts(self) -> set[str]:
        return {f"127.0.0.1:{self.port}", f"localhost:{self.port}", f"[::1]:{self.port}"}

    def _refusal(self, request: Request, *, need_token: bool = True) -> Response | None:
        hosts = request.headers.get_all("Host")
        host = hosts[0] if len(hosts) == 1 else ", ".join(hosts)
        if not self.allow_remote and (len(hosts) != 1 or host.lower() not in self._allowed_hosts()):
            return _error(403, "forbidden_host", f"this agent answers only at {self.url} (Host was {host!r})")
        origins = request.headers.get_all("Origin")
        allowed_origins = {f"http://{h}" for h in self._allowed_hosts()}
        if origins and (len(origins) > 1 or origins[0].lower() not in allowed_origins):
            return _error(403, "forbidden_origin", f"requests from {', '.join(origins)} are not allowed")
        if need_token:
            given = request.headers.get_all("Authorization")
            scheme, _, secret = (given[0] if len(given) == 1 else "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                secret.strip().encode(), self.token.encode()
            ):
                return _error(
                    401,
                    "invalid_token",
                    "missing or wrong control token (Authorization: Bearer <the token in the config dir's "
                    "control-token file>)",
                )
        return None

    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path)
        method = request.method.upper()
        if path.path == f"{PREFIX}/health":
            refusal = self._refusal(request, need_token=False)
            return refusal or _json_response(200, {"ok": True, "service": "volunteer-app-agent"})
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        if path.path == f"{PREFIX}/ws":
            if method != "GET" or "upgrade" not in request.headers.get("Connection", "").lower():
                return _error(426, "upgrade_required", "this is the websocket endpoint")
            return None
        if path.path == f"{PREFIX}/state" and method == "GET":
            self.service._sync_contribution()
            self.service.hub.publish()
            return _json_response(200, self.service.hub.snapshot())
        if path.path == f"{PREFIX}/schema" and method == "GET":
            return _json_response(200, json_schema())
        if path.path.startswith(f"{PREFIX}/commands/"):
            if method != "POST":
                return _error(405, "method_not_allowed", "commands are POST requests")
            name = path.path.removeprefix(f"{PREFIX}/commands/")
            return await self._http_command(name, parse_qs(path.query, keep_blank_values=True))
        return _error(404, "not_found", f"no such endpoint: {method} {path.path}")

    async def _http_command(self, name: str, query: dict[str, list[str]]) -> Response:
        try:
            body = self._command_from_query(name, query)
            command = COMMANDS.validate_python(body)
        except CommandError as exc:
            return _error(ERROR_STATUS.get(exc.code, 400), exc.code, exc.detail)
        except ValidationError as exc:
            return _error(422, "invalid_message", validation_problems(exc))
        try:
            result = await self.service.run_command(command)
        except CommandError as exc:
            return _error(ERROR_STATUS.get(exc.code, 400), exc.code, exc.detail)
        return _json_response(200, result.model_dump(mode="json"))

    @staticmethod
    def _command_from_query(name: str, query: dict[str, list[str]]) -> dict[str, Any]:
        known = {schema["properties"]["command"]["const"] for schema in _command_schemas()}
        if name not in known:
            raise CommandError(
                "unknown_command", f"unknown command {name!r}; the commands are {', '.join(sorted(known))}"
            )
        single = {k: v[-1] for k, v in query.items()}
        try:
            if name == "settings":
                return {"command": name, "values": {k: parse_setting(k, v) for k, v in single.items()}}
            if name == "snooze" and "duration" in single:
                return {"command": name, "seconds": parse_duration(single.pop("duration")), **single}
            if name == "evaluate" and "prompt" in query:
                return {"command": name, "prompts": query["prompt"]}
        except ValueError as exc:
            raise CommandError("invalid_message", str(exc)) from exc
        return {"command": name, **single}

    # ------------------------------------------------------------------ websocket
    async def _handler(self, connection: ServerConnection) -> None:
        hub = self.service.hub
        self.service._sync_contribution()
        hub.publish()
        subscriber = hub.subscribe()
        self.connections += 1
        send_lock = asyncio.Lock()

        async def send(message: Any) -> None:
            async with send_lock:
                await connection.send(message.model_dump_json())

        try:
            # a SnapshotMessage, built from the already-serialized state
            snapshot = {"type": "snapshot", "version": PROTOCOL_VERSION, "state": hub.snapshot(), "log": [
                e.model_dump(mode="json") for e in list(hub.log)[-100:]]}  # fmt: skip
            async with send_lock:
                await connection.send(json.dumps(snapshot))
            sender = asyncio.create_task(self._sender(subscriber, send))
            try:
                async for raw in connection:
                    task = asyncio.create_task(self._on_message(raw, send))
                    self._commands.add(task)  # held here: it outlives this connection if need be
                    task.add_done_callback(self._commands.discard)
            finally:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                    await sender
        except ConnectionClosed:
            pass
        finally:
            # commands in progress are carried out even though their UI went away (a `stop` cancelled
            # halfway would leave the agent running); their answers are dropped
            hub.unsubscribe(subscriber)
            self.connections -= 1

    async def _sender(self, subscriber: Any, send: Any) -> None:
        while True:
            await subscriber.ready.wait()
            changes, log = subscriber.take()
            if changes:
                await send(UpdateMessage(changes=changes))
            for entry in log:
                await send(LogMessage(entry=entry))

    async def _on_message(self, raw: str | bytes, send: Any) -> None:
        request_id = None
        try:
            if isinstance(raw, bytes):
                raise CommandError("invalid_message", "binary messages are not understood; send JSON text")
            try:
                data = json.loads(raw)
            except ValueError as exc:
                raise CommandError("invalid_message", f"not JSON: {exc}") from exc
            if not isinstance(data, dict):
                raise CommandError("invalid_message", "a command is a JSON object with a 'command' field")
            request_id = data.get("id") if isinstance(data.get("id"), str) else None
            try:
                command = COMMANDS.validate_python(data)
            except ValidationError as exc:
                raise CommandError("invalid_message", validation_problems(exc)) from exc
            result = await self.service.handle(command)
            await send(result)
        except CommandError as exc:
            with contextlib.suppress(ConnectionClosed):
                await send(ErrorMessage(id=request_id, error=exc.code, detail=exc.detail))
        except ConnectionClosed:
            pass
        except Exception as exc:  # a bug: say so to the UI, keep the connection, log it for a report
            logger.exception("command failed")
            with contextlib.suppress(ConnectionClosed):
                await send(
                    ErrorMessage(id=request_id, error="internal_error", detail=f"{type(exc).__name__}: {exc}")
                )


def _command_schemas() -> list[dict[str, Any]]:
    schema = COMMANDS.json_schema()
    definitions = schema.get("$defs", {})
    return [definitions[ref["$ref"].split("/")[-1]] for ref in schema["oneOf"]]
