"""A run's files: copied in from the organizer's shell, named by SHA-256, served to volunteers only.

``tiny-lm``'s text is the file a run needs. The organizer names it once, on the server
(``runs create --config text_path=...``); the coordinator keeps a copy and serves it by digest, so that no
volunteer's computer ever opens a path from a run's config (docs/security.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from coordinator.api import create_app
from tests.conftest import bearer, python_env, settings_for
from tests.coordinator.test_cli import cli

TEXT = ("The old fox finds a red key near the river. 3 plus 4 is 7.\n" * 300).encode()
DIGEST = hashlib.sha256(TEXT).hexdigest()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TestClient, Path]]:
    """A coordinator with run ``lm`` created from the shell on ``corpus.txt``, and an invite-only ``club``."""
    settings = settings_for(tmp_path)
    source = tmp_path / "corpus.txt"
    source.write_bytes(TEXT)
    data = str(settings.data_dir)
    for name, extra in (
        ("lm", []),
        ("club", ["--visibility", "invite", "--invite-code", "club-code-0123456789"]),
    ):
        created = cli("runs", "create", "--data-dir", data, "--name", name, "--task", "tiny-lm",
                      "--config", f"text_path={source}", *extra, env=python_env())  # fmt: skip
        assert created.returncode == 0, created.stderr
    with TestClient(create_app(settings)) as client:
        yield client, source


def _register(client: TestClient, name: str, **body: str) -> dict[str, str]:
    answer = client.post("/api/v1/volunteers", json={"name": name, **body})
    assert answer.status_code == 201, answer.text
    return bearer(answer.json()["credential"])


def test_the_coordinator_keeps_its_own_copy_and_lists_it_by_digest(
    served: tuple[TestClient, Path], tmp_path: Path
) -> None:
    client, source = served
    run = client.get("/api/v1/runs/lm").json()
    assert run["files"] == [{"field": "text_path", "sha256": DIGEST, "bytes": len(TEXT)}]
    assert run["task_config"]["text_sha256"] == DIGEST
    stored = Path(run["task_config"]["text_path"])
    assert stored.name == DIGEST and stored.read_bytes() == TEXT
    source.unlink()  # the organizer's original may go: the run keeps its copy
    assert client.get("/api/v1/runs/lm").json()["files"][0]["sha256"] == DIGEST


def test_volunteers_download_it_whole_or_by_range(served: tuple[TestClient, Path]) -> None:
    client, _ = served
    headers = _register(client, "ada")
    whole = client.get(f"/api/v1/runs/lm/files/{DIGEST}", headers=headers)
    assert whole.status_code == 200 and whole.content == TEXT
    assert whole.headers["etag"] == f'"{DIGEST}"'
    rest = client.get(f"/api/v1/runs/lm/files/{DIGEST}", headers={**headers, "Range": "bytes=1000-"})
    assert rest.status_code == 206 and rest.content == TEXT[1000:]


def test_only_the_runs_own_files_to_registered_volunteers(served: tuple[TestClient, Path]) -> None:
    client, _ = served
    headers = _register(client, "ada")
    assert client.get(f"/api/v1/runs/lm/files/{DIGEST}").status_code == 401
    other = hashlib.sha256(b"/etc/passwd").hexdigest()
    missing = client.get(f"/api/v1/runs/lm/files/{other}", headers=headers)
    assert missing.status_code == 404 and missing.json()["error"] == "file_not_found"
    bad = client.get("/api/v1/runs/lm/files/..%2F..%2Fadmin-token", headers=headers)
    assert bad.status_code in (404, 422) and bad.headers["content-type"].startswith("application/json")


def test_an_invite_only_runs_files_go_to_its_members_only(served: tuple[TestClient, Path]) -> None:
    client, _ = served
    stranger = _register(client, "eve")
    refused = client.get(f"/api/v1/runs/club/files/{DIGEST}", headers=stranger)
    assert refused.status_code == 403 and refused.json()["error"] == "invite_required"
    member = _register(client, "bob", invite_code="club-code-0123456789")
    assert client.get(f"/api/v1/runs/club/files/{DIGEST}", headers=member).content == TEXT


def test_a_run_made_over_http_may_not_name_a_file_of_the_server(tmp_path: Path) -> None:
    """Whoever holds the organizer token over HTTP cannot have the coordinator read and serve its files."""
    settings = settings_for(tmp_path)
    with TestClient(create_app(settings)) as client:
        admin = bearer((settings.data_dir / "admin-token").read_text().strip())
        answer = client.post(
            "/api/v1/runs",
            json={
                "name": "leak",
                "task": "tiny-lm",
                "task_config": {"text_path": str(settings.data_dir / "admin-token")},
            },
            headers=admin,
        )
    assert answer.status_code == 422 and answer.json()["error"] == "files_not_allowed"
    assert not (settings.data_dir / "files").exists()


def test_a_task_given_by_module_path_is_refused_from_the_shell_too(tmp_path: Path) -> None:
    (tmp_path / "my_task.py").write_text("raise SystemExit('imported')\n")
    created = subprocess_cli(tmp_path, "runs", "create", "--data-dir", str(tmp_path / "data"), "--name", "x",
                             "--task", "my_task:TASK")  # fmt: skip
    assert created.returncode != 0 and "unknown task 'my_task:TASK'" in created.stderr
    assert "imported" not in created.stderr


def subprocess_cli(cwd: Path, *args: str) -> object:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], cwd=cwd, env=python_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
