"""``volunteer-app``: contribute your computer to a collaborative training run.

The work happens in the agent service (``volunteer-app agent``), one per user, which keeps training in
the background; every other command attaches to it: ``join`` starts it when none runs and follows the
contribution, ``status``/``pause``/``resume``/``finish``/``snooze``/``leave``/``stop`` and ``settings``
steer it and print one line (or ``--json``). ``join --foreground`` runs everything in this one process
(containers, scripts that want Ctrl-C to end the contribution).

One module per command group, each adding its parsers (with the function that runs them) to the one
parser: :mod:`.agent` (and finding or starting an agent), :mod:`.join`, :mod:`.steer` (the one-shot
commands), :mod:`.app` (the terminal app and ``web``), :mod:`.demo`, :mod:`.profile`; :mod:`.common` holds
what they share. What only one command needs (the terminal app, the agent service, the demo) is imported
when that command runs, so that ``volunteer-app status`` does not load them.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from volunteer_app import __version__
from volunteer_app.cli import agent, app, demo, join, profile, steer
from volunteer_app.cli.agent import start_background_agent
from volunteer_app.cli.common import PROG
from volunteer_app.cli.demo import demo_options
from volunteer_app.cli.steer import describe_state
from volunteer_app.cliutil import ArgumentParser, UserError, run_main
from volunteer_app.control import validation_problems

__all__ = ["build_parser", "demo_options", "describe_state", "main", "start_background_agent"]


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Lend your computer to a research group's collaborative training run (peer to peer,\n"
        "with hivemind). A background agent does the work; these commands start, watch and steer it.\n"
        "Without a command, the terminal app opens (it starts the agent if none is running).",
        epilog="examples:\n"
        "  volunteer-app                                   open the terminal app\n"
        "  volunteer-app demo                              train a local swarm for about 5 minutes\n"
        "  volunteer-app join --coordinator URL --run RUN  contribute to a run (the agent keeps going)\n"
        "  volunteer-app status | pause | resume | leave   watch and steer the agent\n"
        "  volunteer-app web                               the same app in your browser",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--coordinator",
        dest="app_coordinator",
        default=None,
        metavar="URL",
        help="without a command: open the app with this coordinator preselected for joining a run",
    )
    parser.set_defaults(handler=app.run_app)
    commands = parser.add_subparsers(dest="command", metavar="[COMMAND]", parser_class=ArgumentParser)
    for group in (profile, agent, join, steer, app, demo):
        group.add_parsers(commands)
    return parser


USER_ERRORS = {
    "volunteer_app.agent.contribution": ("AgentError",),
    "volunteer_app.agentfiles": ("AgentAlreadyRunning",),
    "volunteer_app.client": ("CoordinatorRefused", "CredentialStoreError"),
    "volunteer_app.demo": ("DemoError",),
    "volunteer_app.identity": ("IdentityError",),
}
"""Errors a user can cause or fix (no such run, an agent already running, a damaged credential file...),
by the module that defines them: printed as one line, never a traceback."""


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except Exception as exc:
        # Only modules a command loaded can have raised their errors: look the classes up there, so that a
        # shell command never imports the agent service or the demo just to know what to catch.
        known = tuple(
            getattr(sys.modules[module], name)
            for module, names in USER_ERRORS.items()
            if module in sys.modules
            for name in names
        )
        if isinstance(exc, known):
            raise UserError(str(exc)) from exc
        raise


def main(argv: list[str] | None = None) -> int:
    """The ``volunteer-app`` command: what a user can get wrong is one line on stderr, never a traceback."""
    try:
        return run_main(_main, argv, prog=PROG, user_errors=(ValueError,))
    except ValidationError as exc:
        print(f"error: invalid setting: {validation_problems(exc)}", file=sys.stderr)
        return 2
