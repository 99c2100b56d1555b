"""Which of some files any process opened: Linux inotify (``IN_OPEN``), read through ctypes.

The hostile-coordinator suite puts a volunteer's "private" files where a coordinator would point the
agent (an SSH key, ``credentials.json``, a module in ``~/Downloads``) and asserts that nothing opened
them: not the agent, not its speed test, not its worker, whatever they were told.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import sys
from pathlib import Path

IN_OPEN = 0x00000020
IN_ACCESS = 0x00000001
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")


def available() -> bool:
    return sys.platform.startswith("linux") and ctypes.util.find_library("c") is not None


class OpenWatch:
    """Records every open (and read) of the watched files, by any process, from now until :meth:`close`."""

    def __init__(self, paths: list[Path]):
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._paths: dict[int, Path] = {}
        for path in paths:
            wd = self._libc.inotify_add_watch(self._fd, str(path).encode(), IN_OPEN | IN_ACCESS)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"cannot watch {path}")
            self._paths[wd] = path
        self._seen: list[Path] = []

    def opened(self) -> list[Path]:
        """The watched files opened or read so far (each once)."""
        seen = self._seen
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            offset = 0
            while offset < len(data):
                wd, _mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                path = self._paths.get(wd)
                if path is not None and path not in seen:
                    seen.append(path)
        return list(seen)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> OpenWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
