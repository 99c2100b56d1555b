"""``volunteer-app``: contribute your computer to a collaborative training run."""

from __future__ import annotations

import argparse
import json
import sys

from volunteer_app import __version__
from volunteer_app.cliutil import ArgumentParser, run_main
from volunteer_app.profile import describe, profile_machine

PROG = "volunteer-app"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Lend your computer to a research group's collaborative training run (peer to peer, with hivemind).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    profile = commands.add_parser("profile", help="show this machine's hardware profile (CPU, memory, GPUs)")
    profile.add_argument("--json", action="store_true", help="print the profile as JSON")
    return parser


def _cmd_profile(args: argparse.Namespace) -> int:
    profile = profile_machine()
    if args.json:
        print(json.dumps(profile.model_dump(mode="json"), indent=2))
    else:
        print("\n".join(describe(profile)))
    return 0


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    handlers = {"profile": _cmd_profile}
    return handlers[args.command](args)


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    from volunteer_app.identity import IdentityError

    try:
        return run_main(
            _main,
            argv,
            prog=PROG,
            user_errors=(
                IdentityError,
                ValueError,
            ),
        )
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
        print(f"error: invalid setting: {problems}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
