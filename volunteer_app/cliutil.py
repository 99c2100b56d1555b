"""What both command-line programs share: one-line errors, never a traceback for a user's mistake."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from volunteer_app.safetext import one_line


class UsageError(Exception):
    """A command-line mistake the user can fix; printed as one line, exit status 2."""


class UserError(Exception):
    """Something the user can fix (a missing file, a refused request); printed as one line, exit status 1."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr that points to ``--help``."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def run_main(
    main: Callable[[list[str] | None], int],
    argv: list[str] | None,
    *,
    prog: str,
    user_errors: tuple[type[BaseException], ...] = (),
) -> int:
    """Run ``main`` and turn expected failures into ``error: …`` on stderr with a non-zero status."""
    try:
        return main(argv)
    except UsageError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`| head`): not an error of ours; keep the interpreter's final flush quiet
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (UserError, *user_errors) as exc:  # type: ignore[misc]
        text = one_line(str(exc)) or type(exc).__name__  # it may quote a coordinator: text, not escapes
        print(f"error: {text}", file=sys.stderr)
        return 1
