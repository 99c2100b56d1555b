"""The agent's file cache: the files a run needs, fetched from its coordinator and checked by SHA-256.

A run lists the files its peers need (``RunOut.files``: the SHA-256 and size of each, e.g. ``tiny-lm``'s
text). The agent, never the worker, fetches each into ``CACHE_DIR/files/<sha256>`` and gives the worker
the cached path; a path or a file name that the coordinator sends is never used. What a hostile
coordinator or mirror could try, and what stops it:

* write outside the cache: the file's name is its digest, checked to be 64 hex digits; the cache folder
  is the agent's own (mode 0700) and files are opened with ``O_NOFOLLOW``;
* send more than it listed, or fill the disk: the download stops at the listed size (and the listed size
  must fit the cache's budget, after evicting the least recently used files);
* feed the worker unchecked bytes: a file is moved into place only after its SHA-256 matched; a partial
  download (``<sha256>.part``) is resumed with a range request and checked as a whole at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from volunteer_app.client import CoordinatorClient
from volunteer_app.digests import file_sha256
from volunteer_app.protocol import RunFile

SHA256_HEX = re.compile(r"[0-9a-f]{64}")
CHUNK = 1 << 20
DISK_RESERVE_BYTES = 1 << 30
"""Free disk the cache always leaves to the rest of the computer (on top of its own budget)."""


class CacheError(Exception):
    """A file cannot be fetched into the cache; the message says why and what to do."""

    def __init__(self, message: str, *, code: str = "file_refused"):
        super().__init__(message)
        self.code = code


def _human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} bytes"


class FileCache:
    """Content-addressed files under ``root``, at most ``budget_bytes`` in all (least recently used out).

    :param root: the cache's folder (created with mode 0700).
    :param budget_bytes: the most the cache may hold.
    """

    def __init__(self, root: Path, *, budget_bytes: int):
        self.root = root
        self.budget_bytes = budget_bytes

    def path_of(self, sha256: str) -> Path:
        if not SHA256_HEX.fullmatch(sha256):
            raise CacheError(f"refusing a file named {sha256[:80]!r}: a run's files are named by SHA-256")
        return self.root / sha256

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every complete file, oldest use first."""
        entries = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                if entry.is_file(follow_symlinks=False) and SHA256_HEX.fullmatch(entry.name):
                    stat = entry.stat(follow_symlinks=False)
                    entries.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        return sorted(entries)

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def cached(self, sha256: str) -> Path | None:
        """The complete cached file with this digest (marked as just used), or None."""
        path = self.path_of(sha256)
        if path.is_file() and not path.is_symlink():
            with contextlib.suppress(OSError):
                os.utime(path)
            return path
        return None

    def _make_room(self, needed: int, *, keep: set[str]) -> None:
        """Evict least recently used files until ``needed`` more bytes fit the budget and the disk."""
        if needed > self.budget_bytes:
            raise CacheError(
                f"the run needs a file of {_human(needed)}, more than this computer's cache budget of "
                f"{_human(self.budget_bytes)}; raise it (VOLUNTEER_CACHE_MAX_GB) or choose another run",
                code="file_too_big",
            )
        entries = self._entries()
        used = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if used + needed <= self.budget_bytes:
                break
            if path.name in keep:
                continue
            with contextlib.suppress(OSError):
                path.unlink()
                used -= size
        if used + needed > self.budget_bytes:
            raise CacheError(
                f"the cache cannot hold {_human(needed)} more within its budget of {_human(self.budget_bytes)}",
                code="file_too_big",
            )
        free = shutil.disk_usage(self.root).free
        if needed > free - DISK_RESERVE_BYTES:
            raise CacheError(
                f"the run needs a file of {_human(needed)}, but the disk has {_human(free)} free (the cache "
                f"leaves {_human(DISK_RESERVE_BYTES)} to the rest of the computer)",
                code="disk_full",
            )

    async def fetch(
        self,
        client: CoordinatorClient,
        *,
        run: str,
        file: RunFile,
        keep: set[str] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Path:
        """The cached copy of ``file``, downloaded (or resumed) and checked first when needed.

        :param keep: digests that must not be evicted to make room (the run's other files).
        :param on_progress: called with (bytes so far, bytes in all) as the download goes.
        :raises CacheError: for a file that does not fit, or bytes that do not match their digest.
        :raises CoordinatorUnreachable, CoordinatorRefused: as the client's calls do.
        """
        path = self.path_of(file.sha256)
        found = self.cached(file.sha256)
        if found is not None:
            return found
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        partial = self.root / f"{file.sha256}.part"
        with contextlib.suppress(FileNotFoundError):
            if partial.is_symlink() or partial.stat().st_size > file.bytes:
                partial.unlink()
        have = partial.stat().st_size if partial.exists() else 0
        self._make_room(file.bytes - have, keep={file.sha256, *(keep or set())})
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "ab") as out:
            if have < file.bytes:
                await client.download_file(
                    run, file.sha256, out, offset=have, limit=file.bytes, on_progress=on_progress
                )
            out.flush()
            os.fsync(out.fileno())
        size = partial.stat().st_size
        if size != file.bytes:
            partial.unlink()
            raise CacheError(
                f"the coordinator sent {size} bytes of a file it listed at {file.bytes}; discarded",
                code="file_damaged",
            )
        if file_sha256(partial) != file.sha256:
            partial.unlink()
            raise CacheError(
                f"the file the coordinator sent does not match its SHA-256 {file.sha256[:16]}…; discarded "
                "(a damaged download or a dishonest server)",
                code="file_damaged",
            )
        os.replace(partial, path)
        os.utime(path, (time.time(), time.time()))
        return path
