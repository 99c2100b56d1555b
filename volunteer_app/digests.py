"""The SHA-256 of a file, read a block at a time: how run files, downloads, checkpoints and exports are checked."""

from __future__ import annotations

import hashlib
import os

BLOCK = 1 << 20


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The hex SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()
