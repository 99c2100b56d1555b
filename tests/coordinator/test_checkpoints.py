"""Checkpoints without a swarm: write, verify, skip damaged ones, prune, export and load the export."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.checkpoint_cli import cmd_checkpoints
from coordinator.checkpoints import (
    MANIFEST,
    MODEL_FILE,
    OPTIMIZER_FILE,
    SAMPLES_FILE,
    CheckpointStore,
    checkpoint_directory,
)
from coordinator.errors import Conflict, NotFound
from coordinator.swarm.checkpointer import load_checkpoint_into, save_checkpoint
from tests.conftest import python_env
from volunteer_app.pictures import read_png
from workers.optim import adamw
from workers.tasks import load_task

SMALL = {
    "preset": "tiny",
    "d_model": 32,
    "n_heads": 2,
    "n_layers": 1,
    "eval_prompts": 4,
    "eval_samples": 8,
    "samples_per_shard": 32,
}


class Trained:
    def __init__(self) -> None:
        spec = load_task("shapes-dalle")
        self.spec = spec
        self.config = spec.make_config(SMALL)
        self.runtime: Any = spec.build_runtime(self.config)
        self.model = self.runtime.build_model()
        self.optimizer = adamw(self.runtime.param_groups(self.model), lr=3e-3)
        for batch in self.runtime.shard_batches(0, batch_size=16, seed=0):
            self.runtime.loss(self.model, batch).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()

    def save(self, store: CheckpointStore, epoch: int) -> Any:
        return save_checkpoint(
            store,
            runtime=self.runtime,
            model=self.model,
            optimizer=self.optimizer,
            epoch=epoch,
            run="shapes",
            task="shapes-dalle",
            task_config=self.spec.config_to_dict(self.config),
            metric="prompt_accuracy",
            samples=epoch * 256,
        )


@pytest.fixture(scope="module")
def trained() -> Trained:
    torch.manual_seed(0)
    return Trained()


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_checkpoint_holds_the_model_optimizer_metrics_and_drawings(
    trained: Trained, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "shapes")
    info = trained.save(store, 3)
    assert info.valid and info.epoch == 3 and info.path.name == "epoch-00000003"
    assert {p.name for p in info.path.iterdir()} == {MODEL_FILE, OPTIMIZER_FILE, SAMPLES_FILE, MANIFEST}
    manifest = json.loads((info.path / MANIFEST).read_text())
    assert manifest["task"] == "shapes-dalle" and manifest["samples"] == 3 * 256
    assert set(manifest["metrics"]) >= {"loss", "prompt_accuracy"} and manifest["metric"] == "prompt_accuracy"
    prompts = trained.runtime.showcase_prompts()
    assert [p["prompt"] for p in manifest["prompts"]] == prompts
    grid = read_png((info.path / SAMPLES_FILE).read_bytes())  # 8 drawings, 4 per row, magnified 4x
    assert (grid.width, grid.height) == (4 * (4 * 33 + 1), 4 * (2 * 33 + 1))
    # loading gives back exactly the same weights and optimizer moments
    fresh = trained.runtime.build_model()
    optimizer = adamw(trained.runtime.param_groups(fresh), lr=3e-3)
    for p in fresh.parameters():  # an optimizer with initialised state, as hivemind keeps one
        p.grad = torch.zeros_like(p)
    optimizer.step()
    load_checkpoint_into(store.latest(), model=fresh, optimizer=optimizer)  # type: ignore[arg-type]
    for (name, a), b in zip(trained.model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    first = next(iter(trained.optimizer.state.values()))
    loaded = next(iter(optimizer.state.values()))
    assert torch.equal(first["exp_avg"], loaded["exp_avg"]) and torch.equal(first["step"], loaded["step"])


def test_a_damaged_or_partial_checkpoint_is_skipped_for_the_one_before(
    trained: Trained, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "shapes")
    trained.save(store, 1)
    newest = trained.save(store, 2)
    assert store.latest().epoch == 2  # type: ignore[union-attr]
    _flip_a_byte(newest.path / MODEL_FILE)
    fresh = CheckpointStore(tmp_path / "shapes")  # a new process: nothing cached
    assert fresh.latest().epoch == 1  # type: ignore[union-attr]
    listed = {i.epoch: i for i in fresh.checkpoints()}
    assert not listed[2].valid and "checksum mismatch" in (listed[2].problem or "")
    assert store.latest().epoch == 1, "a cached verification must not hide a change on disk"  # type: ignore[union-attr]
    # a checkpoint whose manifest never got written (a crash mid-write) is skipped too
    partial = store.path_for(5)
    partial.mkdir()
    (partial / MODEL_FILE).write_bytes(b"half")
    assert store.latest().epoch == 1  # type: ignore[union-attr]
    # the swarm peer sets damaged ones aside, and never reads them again
    moved = store.quarantine(listed[2])
    assert moved.name == "epoch-00000002.corrupt" and [i.epoch for i in store.checkpoints()] == [5, 1]


def test_writing_is_atomic_and_only_the_last_k_are_kept(trained: Trained, tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "shapes", keep=2)
    leftover = tmp_path / "shapes" / ".epoch-00000009.crashed"
    leftover.mkdir(parents=True)
    for epoch in (1, 2, 3):
        trained.save(store, epoch)
    assert [i.epoch for i in store.checkpoints()] == [3, 2]
    assert not leftover.exists(), "staging directories of crashed writes are cleaned up"
    assert not [p for p in (tmp_path / "shapes").iterdir() if p.name.startswith(".")]


def _cli(args: list[str]) -> argparse.Namespace:
    """``volunteer-coordinator checkpoints ARGS`` as the installed command parses it."""
    from coordinator.cli import build_parser

    return build_parser().parse_args(["checkpoints", *args])


def test_cli_lists_checkpoints_and_flags_damaged_ones(
    trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    store = CheckpointStore(checkpoint_directory(data, "shapes"))
    trained.save(store, 4)
    damaged = trained.save(store, 7)
    _flip_a_byte(damaged.path / OPTIMIZER_FILE)
    assert cmd_checkpoints(_cli(["list", "shapes", "--data-dir", str(data)])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "7" and "DAMAGED" in lines[1]
    assert lines[2].split()[:2] == ["4", "1024"] and lines[2].endswith("ok")
    assert cmd_checkpoints(_cli(["list", "shapes", "--data-dir", str(data), "--json"])) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(c["epoch"], c["valid"]) for c in listed] == [(7, False), (4, True)]
    with pytest.raises(NotFound, match="has no checkpoints"):
        cmd_checkpoints(_cli(["list", "nope", "--data-dir", str(data)]))
    with pytest.raises(NotFound, match="damaged"):
        cmd_checkpoints(_cli(["export", "shapes", "--epoch", "7", "--data-dir", str(data)]))


def test_an_export_loads_in_a_plain_python_session_with_two_lines(trained: Trained, tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = CheckpointStore(checkpoint_directory(data, "shapes"))
    trained.save(store, 4)
    trained.save(store, 6)
    out = tmp_path / "exported"
    args = _cli(["export", "shapes", "--epoch", "4", "--data-dir", str(data), "--output", str(out)])
    assert cmd_checkpoints(args) == 0
    assert {p.name for p in out.iterdir()} == {MODEL_FILE, SAMPLES_FILE, MANIFEST}
    with pytest.raises(Conflict):  # never overwrites
        cmd_checkpoints(args)
    snippet = (
        "from workers.export import load_model\n"
        f"model, runtime = load_model({str(out)!r})\n"
        # beyond the two lines: show that the loaded model draws what the trained one draws
        "import json; print(json.dumps(runtime.sample(model, ['a big red circle in the center'], "
        "temperature=0).tolist()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, env=python_env(), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    expected = trained.runtime.sample(trained.model, ["a big red circle in the center"], temperature=0)
    assert json.loads(result.stdout) == expected.tolist()
    _flip_a_byte(out / MODEL_FILE)
    broken = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, env=python_env(), cwd=tmp_path
    )
    assert broken.returncode != 0 and "does not match its checksum" in broken.stderr
