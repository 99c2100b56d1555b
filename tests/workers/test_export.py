"""Loading a downloaded checkpoint runs none of its code and reads none of the loader's files.

A gallery download is data from whoever published it. ``workers.export.load_model`` (the README's two
lines) is run here in a fresh Python from the folder the download sits in, as a user would, against
exports an attacker made: a module beside the manifest named as the task, files the manifest does not
list, names that climb out of the folder, an archive that unpacks to far more than it weighs, and a
``tiny-lm`` config that names a file of the loader's computer.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import python_env
from tests.security.opens import OpenWatch, available
from workers.tasks import load_task

SMALL = {"preset": "tiny", "d_model": 32, "n_heads": 2, "n_layers": 1, "samples_per_shard": 32}
EVIL = 'import pathlib\npathlib.Path(__file__).with_name("IMPORTED").write_text("ran")\n'


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_export(folder: Path, *, task: str = "shapes-dalle", config: dict[str, Any] | None = None,
                extra_files: dict[str, bytes] | None = None) -> Path:  # fmt: skip
    """An export as ``checkpoints export`` writes it: weights, a manifest listing them with their SHA-256."""
    folder.mkdir(parents=True)
    spec = load_task("tiny-lm" if task == "tiny-lm" else "shapes-dalle")
    values = config if config is not None else SMALL
    runtime = spec.build_runtime(spec.make_config(values))
    torch.manual_seed(0)
    save_file(runtime.build_model().state_dict(), str(folder / "model.safetensors"))
    for name, data in (extra_files or {}).items():
        (folder / name).write_bytes(data)
    files = {p.name: {"sha256": _sha(p), "bytes": p.stat().st_size} for p in folder.iterdir()}
    manifest = {"task": task, "task_config": values, "epoch": 1, "files": files}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def load_in_python(path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = (
        f"from workers.export import load_model\nmodel, runtime = load_model({str(path)!r})\nprint('loaded')"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=python_env(), capture_output=True, text=True, timeout=120
    )


def zip_folder(folder: Path, archive: Path, *, names: dict[str, str] | None = None) -> Path:
    with zipfile.ZipFile(archive, "w") as bundle:
        for path in sorted(folder.iterdir()):
            bundle.write(path, (names or {}).get(path.name, f"{folder.name}/{path.name}"))
    return archive


def test_an_honest_export_loads_from_its_folder_and_from_its_zip(tmp_path: Path) -> None:
    folder = make_export(tmp_path / "shapes-epoch-00000001")
    assert load_in_python(folder, tmp_path).stdout.strip() == "loaded"
    archive = zip_folder(folder, tmp_path / "download.zip")
    result = load_in_python(archive, tmp_path)
    assert result.stdout.strip() == "loaded", result.stderr


def test_a_module_named_as_the_task_is_never_imported(tmp_path: Path) -> None:
    """Issue point 3: ``evil.py`` beside the manifest, listed with its checksum, and ``"task": "<folder>.evil:
    TASK"``: the loader refuses the task name and imports nothing."""
    folder = make_export(tmp_path / "gallery", extra_files={"evil.py": EVIL.encode()})
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["task"] = "gallery.evil:TASK"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    result = load_in_python(folder, tmp_path)
    assert result.returncode != 0
    assert "unknown task 'gallery.evil:TASK'" in result.stderr
    assert not (folder / "IMPORTED").exists()


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path: Path) -> None:
    folder = make_export(tmp_path / "gallery")
    (folder / "evil.py").write_text(EVIL)
    result = load_in_python(folder, tmp_path)
    assert result.returncode != 0 and "evil.py, which its manifest does not list" in result.stderr
    archive = zip_folder(folder, tmp_path / "download.zip")
    result = load_in_python(archive, tmp_path)
    assert result.returncode != 0 and "evil.py, which its manifest does not list" in result.stderr
    assert not (folder / "IMPORTED").exists()


def test_archive_names_that_climb_out_are_never_written(tmp_path: Path) -> None:
    folder = make_export(tmp_path / "gallery", extra_files={"notes.txt": b"hello"})
    archive = zip_folder(folder, tmp_path / "download.zip", names={"notes.txt": "../../../outside.txt"})
    result = load_in_python(archive, tmp_path / "gallery")
    assert result.returncode != 0 and "not one exported checkpoint" in result.stderr
    assert not list(tmp_path.rglob("outside.txt"))


def test_an_archive_that_unpacks_to_more_than_the_limit_is_refused(tmp_path: Path) -> None:
    """A zip bomb: 64 MiB of zeros listed in the manifest weigh 64 kB zipped; with a 16 MiB limit it is
    refused from the archive's own table of contents, before anything is unpacked."""
    folder = make_export(tmp_path / "gallery", extra_files={"padding.bin": bytes(64 * 2**20)})
    archive = tmp_path / "download.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as bundle:
        for path in sorted(folder.iterdir()):
            bundle.write(path, f"gallery/{path.name}")
    assert archive.stat().st_size < 2**20
    code = f"from workers.export import load_model\nload_model({str(archive)!r}, max_bytes=16 * 2**20)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=python_env(),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode != 0 and "more than 16777216 bytes" in result.stderr


@pytest.mark.skipif(not available(), reason="needs Linux inotify")
def test_a_tiny_lm_export_uses_the_text_it_carries_never_a_path_it_names(tmp_path: Path) -> None:
    """The manifest's ``text_path`` names a file of the loader's computer; the loader takes the text the
    export carries (by its SHA-256) and opens nothing else."""
    text = ("The old fox finds a red key near the river. " * 400).encode()
    digest = hashlib.sha256(text).hexdigest()
    secret = tmp_path / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n" * 50)
    config = {"preset": "tiny", "d_model": 32, "n_heads": 2, "n_layers": 1, "text_path": "id_ed25519",
              "text_sha256": digest}  # fmt: skip
    carried = tmp_path / "text.txt"
    carried.write_bytes(text)
    model_config = {**config, "text_path": str(carried)}
    folder = make_export(tmp_path / "lm", task="tiny-lm", config=model_config,
                         extra_files={f"text_path.{digest[:16]}": text})  # fmt: skip
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["task_config"] = config
    (folder / "manifest.json").write_text(json.dumps(manifest))
    carried.unlink()
    with OpenWatch([secret]) as watch:
        result = load_in_python(folder, tmp_path)
        opened = watch.opened()
    assert result.stdout.strip() == "loaded", result.stderr
    assert opened == []
