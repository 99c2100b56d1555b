"""A coordinator that lies: it speaks the agent-facing half of ``/api/v1`` well enough for a real agent
to register and join, and answers with whatever malicious fields a test gives it.

It is a real HTTP server (stdlib ``ThreadingHTTPServer``), run in a thread of the test
(:class:`HostileCoordinator`) or as its own process (``python -m tests.security.hostile_coordinator
--port P --scenario JSON``, for a test that puts it in a network namespace). Every request it receives is
recorded (path and body) so that a test can check what the agent sent.

A scenario is a dict:

``run``: fields merged into the run's description (task, task_config, description, initial_peers, files);
``join``: fields merged into the join answer (initial_peers, coordinator_keys, run...), or
``{"error": {"status": 409, "error": code, "detail": text}}`` to refuse the join with that text;
``register_error``: the same, for registration;
``files``: SHA-256 -> hex of the bytes served for that digest (served as given, whatever the run lists);
``leave_delay``: seconds the answer to a session's leave takes (a slow or overloaded coordinator);
``files_after_join``: files are refused (403 ``invite_required``, as an invite-only run does for
non-members) until a join was asked for.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from volunteer_app.tokens import SigningKey, issue_peer_token

API = "/api/v1"


def run_answer(name: str, scenario: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "name": name,
        "task": "tiny-lm",
        "description": "a run",
        "state": "active",
        "visibility": "open",
        "created_at": 0.0,
        "data_epochs": 1,
        "task_config": {"preset": "tiny", "fallback_chars": 20000},
        "optimizer": {},
        "stats": {},
        "initial_peers": [],
        "files": [],
    }
    answer.update(scenario.get("run", {}))
    return answer


class Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: Any, *, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header(
            "Content-Type", "application/octet-stream" if raw is not None else "application/json"
        )
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw.decode(errors="replace")

    def _record(self, body: Any) -> None:
        with self.server.lock:
            self.server.requests.append({"method": self.command, "path": self.path, "body": body})

    def do_GET(self) -> None:
        self._record(None)
        scenario = self.server.scenario
        path = self.path.split("?", 1)[0]
        if path == f"{API}/time":
            return self._send(200, {"server_time": time.time()})
        if path == f"{API}/runs":
            return self._send(200, [run_answer("evil", scenario)])
        parts = path[len(API) :].strip("/").split("/")
        if len(parts) == 2 and parts[0] == "runs":
            return self._send(200, run_answer(parts[1], scenario))
        if len(parts) == 4 and parts[0] == "runs" and parts[2] == "files":
            content = scenario.get("files", {}).get(parts[3])
            if scenario.get("files_after_join") and not any(
                r["path"].endswith("/join") for r in self.server.requests
            ):
                return self._send(
                    403, {"error": "invite_required", "detail": "join with the invite code first"}
                )
            if content is None:
                return self._send(404, {"error": "file_not_found", "detail": "no such file"})
            return self._send(200, None, raw=bytes.fromhex(content))
        return self._send(404, {"error": "not_found", "detail": f"nothing at {path}"})

    def do_POST(self) -> None:
        body = self._body()
        self._record(body)
        scenario = self.server.scenario
        path = self.path.split("?", 1)[0]
        parts = path[len(API) :].strip("/").split("/")
        if parts == ["volunteers"]:
            error = scenario.get("register_error")
            if error:
                return self._send(error.get("status", 409), error)
            name = body.get("name", "volunteer") if isinstance(body, dict) else "volunteer"
            return self._send(
                201, {"volunteer_id": uuid.uuid4().hex, "name": name, "credential": "vc_" + uuid.uuid4().hex}
            )
        if len(parts) == 3 and parts[0] == "runs" and parts[2] == "join":
            join = scenario.get("join", {})
            if "error" in join:
                return self._send(join["error"].get("status", 409), join["error"])
            key = body.get("peer_public_key", "") if isinstance(body, dict) else ""
            return self._send(200, self.server.join_answer(parts[1], join, peer_public_key=key))
        if len(parts) == 3 and parts[0] == "sessions" and parts[2] == "heartbeat":
            return self._send(
                200,
                {"commands": [], "run_state": "active", "server_time": time.time(), "next_heartbeat": 2.0},
            )
        if len(parts) == 3 and parts[0] == "sessions" and parts[2] == "leases":
            return self._send(
                200, {"lease": None, "retry_after": 30.0, "waiting_for": "shards", "run_state": "active"}
            )
        if len(parts) == 3 and parts[0] == "sessions" and parts[2] == "leave":
            time.sleep(float(scenario.get("leave_delay", 0.0)))
            return self._send(200, {"session_id": parts[1], "state": "left", "leases_returned": 0})
        return self._send(404, {"error": "not_found", "detail": f"nothing at {path}"})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], scenario: dict[str, Any]):
        super().__init__(address, Handler)
        self.scenario = scenario
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.key = SigningKey.generate()

    def join_answer(self, run: str, overrides: dict[str, Any], *, peer_public_key: str) -> dict[str, Any]:
        """A join answer a real worker accepts (a peer token this server signed for the worker's key), with
        the scenario's fields over it."""
        described = run_answer(run, self.scenario)
        session, volunteer = uuid.uuid4().hex, uuid.uuid4().hex
        token = issue_peer_token(
            self.key, run=run, volunteer=volunteer, session=session,
            peer_public_key=peer_public_key.strip().encode(), ttl=3600,
        )  # fmt: skip
        answer: dict[str, Any] = {
            "session_id": session,
            "volunteer_id": volunteer,
            "peer_token": token.encode(),
            "token_expires_at": time.time() + 3600,
            "coordinator_keys": [{"kid": self.key.kid, "public_key": self.key.public_key_text}],
            "initial_peers": described["initial_peers"],
            "run": {
                "name": run,
                "task": described["task"],
                "task_config": described["task_config"],
                "optimizer": described["optimizer"],
                "hivemind_run_id": f"va-{run}",
                "files": described["files"],
            },
            "assignment": {
                "device": "cpu",
                "threads": 1,
                "micro_batch_size": 4,
                "accumulation_steps": 1,
                "client_mode": True,
                "amp": False,
                "offload_optimizer": False,
                "delay_optimizer_step": False,
            },
            "lease": None,
            "heartbeat_interval": 2.0,
        }
        answer.update(overrides)
        return answer


class HostileCoordinator:
    """The server in a thread of this process; ``url`` once started. Use as a context manager."""

    def __init__(self, scenario: dict[str, Any], *, host: str = "127.0.0.1", port: int = 0):
        self.server = _Server((host, port), scenario)
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="hostile-coordinator", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def requests(self) -> list[dict[str, Any]]:
        with self.server.lock:
            return list(self.server.requests)

    def __enter__(self) -> HostileCoordinator:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--scenario", default="{}", help="the scenario as JSON")
    args = parser.parse_args()
    server = _Server((args.host, args.port), json.loads(args.scenario))
    print(f"listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
