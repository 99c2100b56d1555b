"""The agent's file cache against a coordinator that lies about a run's files (a real HTTP server)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from tests.security.hostile_coordinator import HostileCoordinator
from volunteer_app.agent.cache import CacheError, FileCache
from volunteer_app.client import CoordinatorClient, CoordinatorRefused
from volunteer_app.protocol import RunFile

TEXT = b"The old fox finds a red key near the river.\n" * 200


def _file(data: bytes, *, size: int | None = None, sha256: str | None = None) -> RunFile:
    return RunFile(
        field="text_path",
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        bytes=len(data) if size is None else size,
    )


def _fetch(cache: FileCache, url: str, file: RunFile) -> Path:
    async def go() -> Path:
        client = CoordinatorClient(url, credential="vc_test")
        try:
            return await cache.fetch(client, run="evil", file=file)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_a_file_is_fetched_checked_and_kept_by_its_digest(tmp_path: Path) -> None:
    file = _file(TEXT)
    cache = FileCache(tmp_path / "cache", budget_bytes=1 << 20)
    with HostileCoordinator({"files": {file.sha256: TEXT.hex()}}) as coordinator:
        path = _fetch(cache, coordinator.url, file)
        again = _fetch(cache, coordinator.url, file)
    assert path == again == tmp_path / "cache" / file.sha256
    assert path.read_bytes() == TEXT
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == "0o700"
    downloads = [r for r in coordinator.requests if "/files/" in r["path"]]
    assert len(downloads) == 1  # the second fetch came from the cache


def test_bytes_that_do_not_match_the_digest_are_discarded(tmp_path: Path) -> None:
    file = _file(TEXT)
    forged = TEXT.replace(b"fox", b"cat")
    cache = FileCache(tmp_path / "cache", budget_bytes=1 << 20)
    with (
        HostileCoordinator({"files": {file.sha256: forged.hex()}}) as coordinator,
        pytest.raises(CacheError, match="does not match its SHA-256"),
    ):
        _fetch(cache, coordinator.url, file)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_server_sending_more_than_it_listed_is_cut_off(tmp_path: Path) -> None:
    """Listed at 100 bytes, it sends 8.8 kB: the agent reads 100 bytes, no more, and checks them."""
    file = _file(TEXT[:100])
    cache = FileCache(tmp_path / "cache", budget_bytes=1 << 20)
    with HostileCoordinator({"files": {file.sha256: TEXT.hex()}}) as coordinator:
        path = _fetch(cache, coordinator.url, file)
    assert path.read_bytes() == TEXT[:100]
    assert sum(p.stat().st_size for p in (tmp_path / "cache").iterdir()) == 100


def test_a_file_beyond_the_budget_is_refused_before_any_download(tmp_path: Path) -> None:
    file = _file(TEXT, size=5 * 2**30)
    cache = FileCache(tmp_path / "cache", budget_bytes=1 << 20)
    with (
        HostileCoordinator({"files": {file.sha256: TEXT.hex()}}) as coordinator,
        pytest.raises(CacheError, match="more than this computer's cache budget") as refused,
    ):
        _fetch(cache, coordinator.url, file)
    assert refused.value.code == "file_too_big"
    assert not any("/files/" in r["path"] for r in coordinator.requests)


def test_names_are_digests_only(tmp_path: Path) -> None:
    """A file name from the coordinator cannot leave the cache: a RunFile's name must be a SHA-256, and the
    cache refuses anything else even if handed one."""
    with pytest.raises(ValueError):
        RunFile(field="text_path", sha256="../../.bashrc", bytes=1)
    cache = FileCache(tmp_path / "cache", budget_bytes=1 << 20)
    with pytest.raises(CacheError, match="named by SHA-256"):
        cache.path_of("../../.bashrc")


def test_least_recently_used_files_make_room(tmp_path: Path) -> None:
    first, second = os.urandom(600), os.urandom(600)
    a, b = _file(first), _file(second)
    cache = FileCache(tmp_path / "cache", budget_bytes=1000)
    with HostileCoordinator({"files": {a.sha256: first.hex(), b.sha256: second.hex()}}) as coordinator:
        _fetch(cache, coordinator.url, a)
        _fetch(cache, coordinator.url, b)
    assert cache.cached(a.sha256) is None and cache.cached(b.sha256) is not None
    assert cache.used_bytes() == 600


def test_a_partial_download_is_resumed_with_a_range_request(tmp_path: Path) -> None:
    file = _file(TEXT)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    (root / f"{file.sha256}.part").write_bytes(TEXT[:1000])
    cache = FileCache(root, budget_bytes=1 << 20)
    # this server ignores ranges (answers 200 with the whole file): the agent starts over, and still ends right
    with HostileCoordinator({"files": {file.sha256: TEXT.hex()}}) as coordinator:
        assert _fetch(cache, coordinator.url, file).read_bytes() == TEXT


def test_a_refused_download_says_why(tmp_path: Path) -> None:
    file = _file(TEXT)
    cache = FileCache(tmp_path / "cache", budget_bytes=1 << 20)
    with HostileCoordinator({}) as coordinator, pytest.raises(CoordinatorRefused) as refused:
        _fetch(cache, coordinator.url, file)
    assert refused.value.status == 404


def test_an_invite_only_runs_files_are_fetched_once_joined(tmp_path: Path) -> None:
    """An invite-only run serves its files to members, and a volunteer already registered on that coordinator
    becomes one by joining: the agent skips the speed test, joins, then fetches and checks the files before
    its worker could start."""
    from volunteer_app.agent.contribution import Contribution
    from volunteer_app.settings import AgentSettings

    file = _file(TEXT)
    scenario = {
        "run": {"task": "tiny-lm", "task_config": {"text_path": "corpus.txt", "text_sha256": file.sha256},
                "files": [file.model_dump()], "initial_peers": []},
        "files": {file.sha256: TEXT.hex()},
        "files_after_join": True,
    }  # fmt: skip
    messages: list[str] = []

    async def go(url: str) -> dict[str, str]:
        settings = AgentSettings(config_dir=tmp_path / "agent", benchmark_seconds=1)
        contribution = Contribution(
            settings=settings, coordinator=url, run="evil", on_message=messages.append
        )
        try:
            await contribution.connect()
            return dict(contribution.run_files)
        finally:
            await contribution.close()

    with HostileCoordinator(scenario) as coordinator:
        files = asyncio.run(go(coordinator.url))
    assert Path(files[file.sha256]).read_bytes() == TEXT
    assert any("the speed test is skipped" in m for m in messages), messages
    paths = [r["path"] for r in coordinator.requests]
    join = next(i for i, p in enumerate(paths) if p.endswith("/join"))
    assert any(p.endswith(f"/files/{file.sha256}") for p in paths[join:]), paths
