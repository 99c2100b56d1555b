"""The gallery's ``generate`` service: the run's swarm peer draws captions with the latest checkpoint for the
web process, which never imports torch and forwards each request over a loopback socket (the port and a
secret are in ``DATA_DIR/swarm/<run>.generate.json``, mode 0600:
:func:`coordinator.checkpoints.generate_endpoint_file`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from coordinator.checkpoints import CheckpointStore

logger = logging.getLogger("coordinator.swarm")


class GenerateServer:
    """Draws captions with the run's latest checkpoint for the gallery's ``generate`` endpoint.

    Listens on a loopback TCP port (published with a random secret in ``endpoint_file``, mode 0600) and
    answers one request at a time: one JSON line ``{"secret", "prompts": [...]}`` in, one JSON line out,
    ``{"ok": true, "epoch": N, "samples": [EvalSample...]}`` or ``{"ok": false, "error": code,
    "detail": text}``. The model is loaded from the newest intact checkpoint and reloaded when a newer
    one appears; requests time out after ``REQUEST_TIMEOUT`` seconds of silence.

    :param store: the run's checkpoints.
    :param endpoint_file: where the port and secret are published.
    """

    REQUEST_TIMEOUT = 10.0
    MAX_REQUEST_BYTES = 64 * 1024

    def __init__(self, *, store: CheckpointStore, endpoint_file: Path):
        import secrets
        import socketserver
        import threading

        self.store = store
        self.endpoint_file = endpoint_file
        self.secret = secrets.token_urlsafe(24)
        self._loaded: tuple[Path, Any, Any] | None = None  # (checkpoint path, runtime, model)
        self._lock = threading.Lock()
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = owner.REQUEST_TIMEOUT

            def handle(self) -> None:
                try:
                    line = self.rfile.readline(owner.MAX_REQUEST_BYTES + 1)
                except OSError:
                    return
                answer = owner.answer(line)
                with contextlib.suppress(OSError):
                    self.wfile.write(json.dumps(answer).encode() + b"\n")

        self.server = socketserver.TCPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        endpoint_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = endpoint_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"port": self.port, "secret": self.secret, "pid": os.getpid()}, f)
        os.replace(tmp, endpoint_file)
        self.thread = threading.Thread(target=self.server.serve_forever, name="generate", daemon=True)
        self.thread.start()

    def answer(self, line: bytes) -> dict[str, Any]:
        """The answer to one request line (never raises)."""
        import hmac

        from volunteer_app.worker_protocol import MAX_EVAL_PROMPTS, MAX_PROMPT_CHARS

        if len(line) > self.MAX_REQUEST_BYTES:
            return {"ok": False, "error": "request_too_large", "detail": "the request is too large"}
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError:
            return {"ok": False, "error": "bad_request", "detail": "the request is not a JSON object"}
        if not hmac.compare_digest(str(request.get("secret", "")), self.secret):
            return {"ok": False, "error": "forbidden", "detail": "wrong secret"}
        prompts = request.get("prompts")
        if (
            not isinstance(prompts, list)
            or not 1 <= len(prompts) <= MAX_EVAL_PROMPTS
            or not all(isinstance(p, str) and len(p) <= MAX_PROMPT_CHARS for p in prompts)
        ):
            return {"ok": False, "error": "bad_request", "detail": "prompts must be 1 to 16 strings"}
        try:
            with self._lock:
                loaded = self._model()
                if loaded is None:
                    return {
                        "ok": False,
                        "error": "no_checkpoint",
                        "detail": "the run has no checkpoint yet; the swarm peer saves one every few minutes",
                    }
                epoch, runtime, model = loaded
                from workers.evaluation import answer

                samples = answer(runtime, model, prompts)
        except Exception as exc:
            logger.exception("generate failed")
            return {"ok": False, "error": "generate_failed", "detail": f"drawing failed: {exc}"}
        return {"ok": True, "epoch": epoch, "samples": [s.model_dump(mode="json") for s in samples]}

    def _model(self) -> tuple[int, Any, Any] | None:
        from coordinator.checkpoints import MODEL_FILE
        from coordinator.swarm.checkpointer import build_model_for, load_model_file

        latest = self.store.latest()
        if latest is None:
            return None
        if self._loaded is None or self._loaded[0] != latest.path:
            runtime, model = build_model_for(latest.manifest)
            load_model_file(model, latest.path / MODEL_FILE)
            model.eval()
            self._loaded = (latest.path, runtime, model)
            logger.info("generate: using the checkpoint of epoch %d", latest.epoch)
        return latest.epoch, self._loaded[1], self._loaded[2]

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.endpoint_file.unlink()
        self.server.shutdown()
        self.server.server_close()
