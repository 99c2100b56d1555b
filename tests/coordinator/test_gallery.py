"""The gallery API against real checkpoint files and the swarm peer's real generate service.

The web app runs in a TestClient as always; the generate service (``coordinator.swarm.generate.GenerateServer``,
which the run's swarm peer process runs in production) runs in this test process on loopback, and the
app reaches it over its published socket exactly as in production.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.checkpoints import CheckpointStore, checkpoint_directory, generate_endpoint_file
from coordinator.swarm.generate import GenerateServer
from tests.conftest import Coordinator, make_coordinator
from tests.coordinator.conftest import SMALL, write_shapes_checkpoint
from volunteer_app.pictures import read_png


@pytest.fixture
def gallery(tmp_path: Path) -> Iterator[tuple[Coordinator, dict[str, Any]]]:
    for coordinator in make_coordinator(tmp_path):
        coordinator.create_run("shapes", task_config={**SMALL, "num_shards": 4, "samples_per_shard": 32})
        run = coordinator.client.get("/api/v1/runs/shapes").json()
        yield coordinator, run


def _write_checkpoint(coordinator: Coordinator, run: dict[str, Any], epoch: int) -> Any:
    return write_shapes_checkpoint(
        coordinator.settings.data_dir,
        run["task_config"],
        epoch=epoch,
        samples=epoch * 4096,
        recorded_config=run["task_config"],
    )


def _serve(coordinator: Coordinator) -> GenerateServer:
    data = coordinator.settings.data_dir
    return GenerateServer(
        store=CheckpointStore(checkpoint_directory(data, "shapes")),
        endpoint_file=generate_endpoint_file(data, "shapes"),
    )


def test_generate_answers_a_png_for_a_caption_and_422_for_nonsense(
    gallery: tuple[Coordinator, dict[str, Any]],
) -> None:
    coordinator, run = gallery
    http = coordinator.client
    # no swarm peer yet: a clear 503, not a 500
    assert http.post("/api/v1/runs/nope/generate", json={"prompt": "a big red circle"}).status_code == 404
    refused = http.post("/api/v1/runs/shapes/generate", json={"prompt": "a big red circle in the center"})
    assert refused.status_code == 503 and refused.json()["error"] == "swarm_peer_unavailable"
    server = _serve(coordinator)
    try:
        empty = http.post("/api/v1/runs/shapes/generate", json={"prompt": "a big red circle in the center"})
        assert empty.status_code == 503 and empty.json()["error"] == "no_checkpoint"
        _write_checkpoint(coordinator, run, 3)
        drawn = http.post("/api/v1/runs/shapes/generate", json={"prompt": "a big red circle in the center"})
        assert drawn.status_code == 200, drawn.text
        assert drawn.headers["content-type"] == "image/png" and drawn.headers["x-checkpoint-epoch"] == "3"
        assert drawn.headers["x-prompt-correct"] in ("true", "false")
        picture = read_png(drawn.content)
        assert (picture.width, picture.height) == (256, 256)
        for nonsense in ("a purple elephant on the moon", "a red circle at the top"):
            answer = http.post("/api/v1/runs/shapes/generate", json={"prompt": nonsense})
            assert answer.status_code == 422, answer.text
            body = answer.json()
            assert body["error"] == "unreadable_prompt" and body["detail"]
        assert (
            "elephant"
            in http.post("/api/v1/runs/shapes/generate", json={"prompt": "an elephant"}).json()["detail"]
        )
        assert http.post("/api/v1/runs/shapes/generate", json={"prompt": ""}).status_code == 422
        # rate-limited per client: once the burst is spent, requests are refused with 429 and Retry-After
        for _ in range(30):
            limited = http.post(
                "/api/v1/runs/shapes/generate", json={"prompt": "a big blue square on the left"}
            )
            if limited.status_code != 200:
                break
        assert limited.status_code == 429 and limited.json()["error"] == "rate_limited"
        assert int(limited.headers["retry-after"]) >= 1
    finally:
        server.shutdown()
    assert not generate_endpoint_file(coordinator.settings.data_dir, "shapes").exists()


def test_checkpoints_are_listed_with_metrics_and_their_sample_grids(
    gallery: tuple[Coordinator, dict[str, Any]],
) -> None:
    coordinator, run = gallery
    http = coordinator.client
    assert http.get("/api/v1/runs/shapes/checkpoints").json() == []
    _write_checkpoint(coordinator, run, 2)
    damaged = _write_checkpoint(coordinator, run, 5)
    path = damaged.path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])  # truncated: left out of the gallery
    listed = http.get("/api/v1/runs/shapes/checkpoints").json()
    assert [c["epoch"] for c in listed] == [2]
    entry = listed[0]
    assert entry["samples"] == 2 * 4096 and entry["metric"] == "prompt_accuracy"
    assert set(entry["metrics"]) >= {"loss", "prompt_accuracy"}
    assert len(entry["prompts"]) == 8 and all(p["correct"] in (True, False) for p in entry["prompts"])
    grid = http.get(entry["samples_png"])
    assert grid.status_code == 200 and grid.headers["content-type"] == "image/png"
    assert read_png(grid.content).width > 32
    missing = http.get("/api/v1/runs/shapes/checkpoints/5/samples.png")
    assert missing.status_code == 404 and missing.json()["error"] == "checkpoint_not_found"
    assert http.get("/api/v1/runs/nope/checkpoints").status_code == 404
