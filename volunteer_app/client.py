"""The coordinator HTTP client (async, httpx) and the agent's credential store."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar
from urllib.parse import quote, urlparse

import httpx
from pydantic import BaseModel, ValidationError

from volunteer_app import __version__
from volunteer_app.protocol import (
    API_PREFIX,
    HeartbeatRequest,
    HeartbeatResponse,
    JoinRequest,
    JoinResponse,
    LeaseCompleteRequest,
    LeaseCompleteResponse,
    LeaseReturnResponse,
    LeaseTakeResponse,
    RegisterRequest,
    RegisterResponse,
    RunOut,
    SessionLeaveResponse,
    TokenRefreshResponse,
)
from volunteer_app.safetext import one_line
from volunteer_app.tokens import write_private_file

Model = TypeVar("Model", bound=BaseModel)


MAX_ANSWER_BYTES = 8 * 2**20
"""The largest answer the agent reads from a coordinator (the largest real one, a run list, is a few kB)."""
MAX_DETAIL_CHARS = 500
"""A refusal's detail is cut to this many characters (it is shown to the volunteer in one line)."""


async def _read_capped(response: httpx.Response, limit: int) -> bytes | None:
    """The body, or None once it passes ``limit`` bytes (the rest is not read)."""
    parts, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


class CoordinatorRefused(Exception):
    """The coordinator answered with an error the agent caused (4xx): retrying the same call will not help."""

    def __init__(self, status: int, code: str, detail: str, *, retry_after: float | None = None):
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.retry_after = retry_after


class CoordinatorUnreachable(Exception):
    """The coordinator could not be reached or failed (network error, timeout, 5xx): retry with backoff."""


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://", url):
        url = f"http://{url}"
    parsed = urlparse(url)
    if not parsed.hostname:
        raise ValueError(f"not a coordinator URL: {url!r}")
    return url


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds from a ``Retry-After`` header (429 answers), when it holds a number."""
    try:
        value = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return value if 0 <= value <= 86400 else None


class CoordinatorClient:
    """Typed calls of the ``/api/v1`` contract. Build one per coordinator; close with ``aclose()``."""

    def __init__(
        self,
        base_url: str,
        *,
        credential: str | None = None,
        timeout: float = 20.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = normalize_url(base_url)
        self.credential = credential
        self._http = httpx.AsyncClient(
            base_url=self.base_url + API_PREFIX,
            timeout=timeout,
            headers={"User-Agent": f"volunteer-app/{__version__}"},
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self, method: str, path: str, answer: type[Model] | None, body: BaseModel | None = None
    ) -> Any:
        headers = {"Authorization": f"Bearer {self.credential}"} if self.credential else {}
        try:
            async with self._http.stream(
                method,
                path,
                headers=headers,
                json=body.model_dump(mode="json", exclude_none=True) if body else None,
            ) as response:
                raw = await _read_capped(response, MAX_ANSWER_BYTES)
        except httpx.HTTPError as exc:
            raise CoordinatorUnreachable(
                f"cannot reach the coordinator at {self.base_url}: {exc or type(exc).__name__}"
            ) from exc
        if raw is None:
            raise CoordinatorUnreachable(
                f"{self.base_url} sent an answer larger than {MAX_ANSWER_BYTES // 2**20} MiB; ignored"
            )
        self._raise_for(response, raw)
        data = self._json(raw)
        if answer is None:
            return data
        try:
            return answer.model_validate(data)
        except ValidationError as exc:
            raise CoordinatorUnreachable(
                f"unexpected answer from the coordinator: {one_line(exc.errors()[0]['msg'], limit=200)}"
            ) from exc

    def _json(self, raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise CoordinatorUnreachable(
                f"{self.base_url} did not answer like a volunteer-coordinator"
            ) from exc

    def _raise_for(self, response: httpx.Response, raw: bytes | None = None) -> None:
        """Raise for a failed answer: :class:`CoordinatorUnreachable` for 5xx, :class:`CoordinatorRefused`
        (its code and detail cleaned to one line of text) for 4xx."""
        if response.status_code >= 500:
            raise CoordinatorUnreachable(
                f"the coordinator failed ({response.status_code}); it will be retried"
            )
        if response.status_code < 400:
            return
        data = self._json(raw if raw is not None else response.content)
        code = data.get("error", "error") if isinstance(data, dict) else "error"
        detail = (
            data.get("detail", response.reason_phrase) if isinstance(data, dict) else response.reason_phrase
        )
        raise CoordinatorRefused(
            response.status_code,
            one_line(code, limit=64),
            one_line(detail, limit=MAX_DETAIL_CHARS),
            retry_after=_retry_after(response),
        )

    async def server_time(self) -> float:
        return float((await self._call("GET", "/time", None))["server_time"])

    async def list_runs(self) -> list[RunOut]:
        data = await self._call("GET", "/runs", None)
        try:
            return [RunOut.model_validate(item) for item in data]
        except (ValidationError, TypeError) as exc:
            raise CoordinatorUnreachable(
                f"{self.base_url} did not answer like a volunteer-coordinator"
            ) from exc

    async def get_run(self, name: str) -> RunOut:
        return await self._call("GET", f"/runs/{quote(name, safe='')}", RunOut)

    async def register(self, request: RegisterRequest) -> RegisterResponse:
        return await self._call("POST", "/volunteers", RegisterResponse, request)

    async def join(self, run: str, request: JoinRequest) -> JoinResponse:
        return await self._call("POST", f"/runs/{quote(run, safe='')}/join", JoinResponse, request)

    async def heartbeat(self, session_id: str, report: HeartbeatRequest) -> HeartbeatResponse:
        return await self._call("POST", f"/sessions/{session_id}/heartbeat", HeartbeatResponse, report)

    async def refresh_token(self, session_id: str, peer_token: str) -> TokenRefreshResponse:
        from volunteer_app.protocol import TokenRefreshRequest

        return await self._call(
            "POST",
            f"/sessions/{session_id}/token",
            TokenRefreshResponse,
            TokenRefreshRequest(peer_token=peer_token),
        )

    async def take_lease(self, session_id: str) -> LeaseTakeResponse:
        return await self._call("POST", f"/sessions/{session_id}/leases", LeaseTakeResponse)

    async def complete_lease(
        self, session_id: str, lease_id: str, report: LeaseCompleteRequest
    ) -> LeaseCompleteResponse:
        return await self._call(
            "POST", f"/sessions/{session_id}/leases/{lease_id}/complete", LeaseCompleteResponse, report
        )

    async def return_lease(self, session_id: str, lease_id: str) -> LeaseReturnResponse:
        """Give an unfinished lease back: its shard goes back to the queue for another peer."""
        return await self._call(
            "POST", f"/sessions/{session_id}/leases/{lease_id}/return", LeaseReturnResponse
        )

    async def leave(self, session_id: str) -> SessionLeaveResponse:
        return await self._call("POST", f"/sessions/{session_id}/leave", SessionLeaveResponse)

    async def download_file(
        self,
        run: str,
        sha256: str,
        out: BinaryIO,
        *,
        offset: int,
        limit: int,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Append the run's file ``sha256`` to ``out`` from byte ``offset``, reading no more than ``limit``
        bytes in all; returns the bytes ``out`` then holds. Checking them is the caller's job.

        A server that ignores the range request (200 instead of 206) is read from the start again."""
        headers = {"Authorization": f"Bearer {self.credential}"} if self.credential else {}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        path = f"/runs/{quote(run, safe='')}/files/{sha256}"
        try:
            async with self._http.stream("GET", path, headers=headers, timeout=60.0) as response:
                if response.status_code >= 400:
                    await response.aread()
                    self._raise_for(response)
                if offset and response.status_code != 206:
                    out.seek(0)
                    out.truncate(0)
                    offset = 0
                have = offset
                async for chunk in response.aiter_bytes():
                    room = limit - have
                    if room <= 0:
                        break
                    out.write(chunk[:room])
                    have += min(len(chunk), room)
                    if on_progress is not None:
                        on_progress(have, limit)
                return have
        except httpx.HTTPError as exc:
            raise CoordinatorUnreachable(
                f"cannot download a file from the coordinator at {self.base_url}: {exc or type(exc).__name__}"
            ) from exc


@dataclass(frozen=True)
class StoredCredential:
    coordinator: str
    volunteer_id: str
    name: str
    credential: str


class CredentialStoreError(Exception):
    pass


class CredentialStore:
    """``credentials.json`` in the config dir (mode 0600): one credential per coordinator URL.

    A damaged file is reported, never silently replaced, so a credential is never lost by accident.
    """

    def __init__(self, path: Path):
        self.path = path

    def _load(self) -> dict[str, dict[str, str]]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise CredentialStoreError(
                f"the credential file {self.path} is unreadable ({exc}); move it away to register again"
            ) from exc
        if not isinstance(data, dict):
            raise CredentialStoreError(
                f"the credential file {self.path} is damaged; move it away to register again"
            )
        return data

    def get(self, coordinator: str) -> StoredCredential | None:
        entry = self._load().get(normalize_url(coordinator))
        if not isinstance(entry, dict) or not {"volunteer_id", "name", "credential"} <= set(entry):
            return None
        return StoredCredential(
            normalize_url(coordinator), entry["volunteer_id"], entry["name"], entry["credential"]
        )

    def put(self, stored: StoredCredential) -> None:
        data = self._load()
        data[normalize_url(stored.coordinator)] = {
            "volunteer_id": stored.volunteer_id,
            "name": stored.name,
            "credential": stored.credential,
        }
        write_private_file(self.path, (json.dumps(data, indent=2) + "\n").encode())

    def forget(self, coordinator: str) -> None:
        data = self._load()
        if data.pop(normalize_url(coordinator), None) is not None:
            write_private_file(self.path, (json.dumps(data, indent=2) + "\n").encode())
