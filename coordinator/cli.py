"""``volunteer-coordinator``: set up, serve and administer a coordinator.

Administrative commands (``runs``, ``volunteers``, ``keys``) work directly on the data directory's store,
so they work whether or not ``serve`` is running; a running server picks the changes up within seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from coordinator.bootstrap import Opened, open_data_dir
from coordinator.errors import CoordinatorError
from coordinator.settings import CoordinatorSettings
from coordinator.store import StoreError
from volunteer_app import __version__
from volunteer_app.cliutil import ArgumentParser, UsageError, run_main
from volunteer_app.protocol import OptimizerSettings, RunCreate
from volunteer_app.states import RunState
from volunteer_app.tokens import TokenError

PROG = "volunteer-coordinator"


def _add_store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="coordinator data directory (store, keys, admin token); env VOLUNTEER_COORDINATOR_DATA_DIR",
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help="SQLAlchemy database URL (default: SQLite in the data dir; e.g. postgresql+psycopg://user@host/db)",
    )


OPTIMIZER_FLAGS = {"grad_compression": "--compression", "use_local_updates": "--local-updates"}
"""``runs create``'s flags whose names are not their :class:`OptimizerSettings` field's (scripts use them)."""
OPTIMIZER_HELP = {"use_local_updates": "same as --update-mode local (kept for old scripts)"}
"""Help that says what a flag does where the field's description says what the wire field means."""


def _add_optimizer_options(parser: argparse.ArgumentParser) -> None:
    """``runs create``'s options, one per :class:`OptimizerSettings` field: ``--kebab-name``, the field's type
    (choices for a ``Literal``, a switch for a ``bool``), its description and its default, all from the model,
    so that a new field gets its option here without being typed twice."""
    from coordinator.runs import GRADIENT_AVERAGING_DEFAULTS

    group = parser.add_argument_group(
        "optimizer settings",
        f"{OptimizerSettings.__doc__} Options left out take the defaults of the chosen --update-mode.",
    )
    defaults = OptimizerSettings()
    fields = OptimizerSettings.model_fields
    flags = {name: OPTIMIZER_FLAGS.get(name, "--" + name.replace("_", "-")) for name in fields}
    # descriptions name other fields; the help names their flags
    field_names = re.compile(r"\b(" + "|".join(flags) + r")\b")
    for name, field in fields.items():
        text = OPTIMIZER_HELP.get(name) or field.description or name.replace("_", " ")
        text = field_names.sub(lambda found: flags[found.group(1)], text)
        kind = field.annotation
        if kind is bool:
            help_text = text.replace("%", "%%")
            group.add_argument(flags[name], dest=name, action="store_true", default=None, help=help_text)
            continue
        options: dict[str, Any] = {}
        if get_origin(kind) is Literal:
            options["choices"] = list(get_args(kind))
        elif kind in (int, float, str):
            options["type"] = kind
        else:
            raise TypeError(f"OptimizerSettings.{name}: no command-line form for {kind!r}")
        default = f"default {getattr(defaults, name)}"
        if name in GRADIENT_AVERAGING_DEFAULTS:
            default += f"; gradients mode {GRADIENT_AVERAGING_DEFAULTS[name]}"
        help_text = f"{text} ({default})".replace("%", "%%")
        group.add_argument(flags[name], dest=name, default=None, help=help_text, **options)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="The organizers' server for collaborative training: admits volunteers, hands out work, "
        "keeps the ledger and serves the dashboard.",
        epilog="Start with `volunteer-coordinator init --data-dir DIR`, then `serve` and `runs create`.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    commands.required = True

    init = commands.add_parser("init", help="create the store, signing key and organizer token (idempotent)")
    _add_store_args(init)
    init.add_argument(
        "--rotate-admin-token", action="store_true", help="revoke the organizer token and make a new one"
    )

    serve = commands.add_parser(
        "serve", help="run the HTTP API, dashboard and swarm peers (inits first if needed)"
    )
    _add_store_args(serve)
    serve.add_argument(
        "--host", default=None, help="listen address (default 127.0.0.1; 0.0.0.0 for all interfaces)"
    )
    serve.add_argument("--port", type=int, default=None, help="HTTP port (default 8470; 0 picks a free port)")
    serve.add_argument(
        "--swarm-host", default=None, help="address the runs' swarm peers listen on (default: --host)"
    )
    serve.add_argument(
        "--swarm-announce-host", default=None, help="public address announced to volunteers (behind NAT)"
    )
    serve.add_argument(
        "--swarm-port-base",
        type=int,
        default=None,
        help="first TCP port of the swarm peers (default: any free)",
    )
    serve.add_argument("--no-swarm", action="store_true", help="do not start swarm peers (bookkeeping only)")
    serve.add_argument(
        "--trusted-proxy",
        action="append",
        default=None,
        metavar="ADDRESS",
        help="address of a reverse proxy whose X-Forwarded-For names the client (repeatable; default: "
        "none, the header is ignored); env VOLUNTEER_COORDINATOR_LIMITS__TRUSTED_PROXIES='[\"ADDR\"]'",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    runs = commands.add_parser("runs", help="create and manage training runs")
    run_commands = runs.add_subparsers(dest="runs_command", metavar="ACTION", parser_class=ArgumentParser)
    run_commands.required = True
    create = run_commands.add_parser("create", help="create a run (its task config is validated)")
    _add_store_args(create)
    create.add_argument("--name", required=True, help="run name: letters, digits, _ . - (at most 40)")
    create.add_argument(
        "--task",
        required=True,
        help="an installed task: shapes-dalle, tiny-lm, or a `volunteer_app.tasks` entry point",
    )
    create.add_argument("--preset", default=None, help="task preset (e.g. tiny, base)")
    create.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="task config field (repeatable); VALUE is parsed as JSON when it can be",
    )
    create.add_argument("--config-file", type=Path, default=None, help="JSON file with task config fields")
    create.add_argument("--visibility", choices=["open", "invite"], default="open")
    create.add_argument(
        "--invite-code",
        default=None,
        help="invite code for an invite-only run, at least 12 characters (generated if omitted: 120 random bits)",
    )
    create.add_argument("--data-epochs", type=int, default=1, help="passes over the data set (default 1)")
    create.add_argument("--description", default="")
    create.add_argument("--json", action="store_true", help="print the run as JSON")
    _add_optimizer_options(create)

    listing = run_commands.add_parser("list", help="list runs with their progress")
    _add_store_args(listing)
    listing.add_argument("--json", action="store_true")
    flagged = run_commands.add_parser(
        "flags", help="claims the coordinator capped or refused in a run, and failed spot checks"
    )
    flagged.add_argument("name", help="run name")
    flagged.add_argument("--volunteer", default=None, help="only this volunteer's flags")
    _add_store_args(flagged)
    flagged.add_argument("--json", action="store_true")
    for action, help_text in (
        ("pause", "pause a run (peers stop computing)"),
        ("resume", "resume a paused run"),
        ("finish", "finish a run for good"),
    ):
        sub = run_commands.add_parser(action, help=help_text)
        sub.add_argument("name", help="run name")
        _add_store_args(sub)

    vols = commands.add_parser("volunteers", help="list, ban and unban volunteers")
    vol_commands = vols.add_subparsers(
        dest="volunteers_command", metavar="ACTION", parser_class=ArgumentParser
    )
    vol_commands.required = True
    vlist = vol_commands.add_parser("list", help="list volunteers")
    _add_store_args(vlist)
    vlist.add_argument("--json", action="store_true")
    ban = vol_commands.add_parser(
        "ban", help="ban a volunteer: credentials revoked now, peer tokens revoked in the swarm"
    )
    ban.add_argument("name", help="volunteer name")
    ban.add_argument("--reason", default="banned by the organizers")
    _add_store_args(ban)
    unban = vol_commands.add_parser(
        "unban", help="lift a ban: the credentials and peer keys the ban took work again"
    )
    unban.add_argument("name", help="volunteer name")
    _add_store_args(unban)

    keys = commands.add_parser("keys", help="manage the token signing key")
    key_commands = keys.add_subparsers(dest="keys_command", metavar="ACTION", parser_class=ArgumentParser)
    key_commands.required = True
    rotate = key_commands.add_parser(
        "rotate", help="make a new signing key; tokens signed by the old one stay valid until they expire"
    )
    _add_store_args(rotate)

    from coordinator.checkpoint_cli import add_checkpoints_commands

    add_checkpoints_commands(commands)
    return parser


def _settings(args: argparse.Namespace, **overrides: Any) -> CoordinatorSettings:
    values: dict[str, Any] = {}
    if args.data_dir is not None:
        values["data_dir"] = args.data_dir
    elif not os.environ.get("VOLUNTEER_COORDINATOR_DATA_DIR"):
        raise UsageError(
            f"{PROG} {args.command}: --data-dir is required (or set VOLUNTEER_COORDINATOR_DATA_DIR)"
        )
    if args.database_url:
        values["database_url"] = args.database_url
    values.update({k: v for k, v in overrides.items() if v is not None})
    return CoordinatorSettings(**values)


def _open(args: argparse.Namespace) -> Opened:
    return open_data_dir(_settings(args))


def _parse_config(args: argparse.Namespace) -> dict[str, object]:
    config: dict[str, object] = {}
    if args.config_file is not None:
        try:
            loaded = json.loads(args.config_file.read_text())
        except OSError as exc:
            raise UsageError(f"cannot read --config-file {args.config_file}: {exc.strerror}") from exc
        except json.JSONDecodeError as exc:
            raise UsageError(f"--config-file {args.config_file} is not valid JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise UsageError(f"--config-file {args.config_file} must hold a JSON object")
        config.update(loaded)
    for item in args.config:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--config expects KEY=VALUE, got {item!r}")
        try:
            value: object = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        config[key.strip()] = value
    if args.preset is not None:
        config["preset"] = args.preset
    return config


def _token_note(settings: CoordinatorSettings, created: bool) -> str:
    """Where the organizer token is. The token itself is never printed: service managers and container
    runtimes keep a program's output in their logs (journald, `podman logs`)."""
    path = settings.admin_token_path.resolve()
    what = "created the organizer token" if created else "the organizer token is"
    return f"{what} in {path} (mode 0600; read it with `cat {path}`)"


def _cmd_init(args: argparse.Namespace) -> int:
    settings = _settings(args)
    opened = open_data_dir(settings, rotate_admin_token=args.rotate_admin_token)
    opened.store.close()
    print(f"data directory: {settings.data_dir.resolve()}")
    if opened.init.created_key:
        print(f"created signing key {opened.authority.signing_key.kid}")
    if opened.init.admin_token:
        print(_token_note(settings, created=True))
    else:
        print(f"already initialized; {_token_note(settings, created=False)}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from coordinator.api import create_app

    settings = _settings(args, host=args.host, port=args.port)
    swarm = settings.swarm.model_copy(
        update={
            k: v
            for k, v in {
                "host": args.swarm_host,
                "announce_host": args.swarm_announce_host,
                "port_base": args.swarm_port_base,
            }.items()
            if v is not None
        }
    )
    if args.no_swarm:
        swarm.enabled = False
    update: dict[str, Any] = {"swarm": swarm}
    if args.trusted_proxy:
        update["limits"] = settings.limits.model_copy(update={"trusted_proxies": list(args.trusted_proxy)})
    settings = settings.model_copy(update=update)
    opened = open_data_dir(settings)
    opened.store.close()
    if opened.init.admin_token:
        print(_token_note(settings, created=True), flush=True)
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        raise CoordinatorError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}") from exc
    sock.listen(2048)
    port = sock.getsockname()[1]
    shown_host = settings.host if settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
    url = f"http://{shown_host}:{port}"
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(
        f"volunteer-coordinator {__version__} serving at {url}  (dashboard {url}/dashboard/, API {url}/api/v1)",
        flush=True,
    )
    proxies = settings.limits.trusted_proxies
    config = uvicorn.Config(
        create_app(settings),
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=10,
        ws="websockets-sansio" if _has_sansio() else "auto",
        # X-Forwarded-For only from the proxies the organizer named: uvicorn trusts loopback by default,
        # which let any local client pick its address (and dodge the per-address limits) with the header.
        proxy_headers=bool(proxies),
        forwarded_allow_ips=",".join(proxies) if proxies else "",
        # The live feed's clients only ever send "ping": a large frame is an attack, not a message.
        ws_max_size=settings.limits.live_message_bytes,
    )
    server = _server_class()(config)
    logging.getLogger("uvicorn.error").addFilter(_ClientFaultFilter())
    server.run(sockets=[sock])
    print("volunteer-coordinator stopped", flush=True)
    return 0


class _ClientFaultFilter(logging.Filter):
    """uvicorn logs a client's malformed websocket frame (text that is not UTF-8) with a traceback, although
    it answers it correctly (close code 1007): keep the line, drop the traceback, so that the log shows
    only real faults with tracebacks."""

    CLIENT_FAULTS = ("Invalid UTF-8 sequence received from client",)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and any(fault in str(record.msg) for fault in self.CLIENT_FAULTS):
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but Ctrl-C or SIGTERM is a clean stop (exit status 0), not a re-raised signal."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return Server


def _has_sansio() -> bool:
    try:
        import uvicorn.protocols.websockets.websockets_sansio_impl  # noqa: F401
    except ImportError:
        return False
    return True


def _optimizer_settings(args: argparse.Namespace) -> OptimizerSettings:
    """``runs create``'s optimizer options; those left out keep the defaults that fit the update mode."""
    given = {name: getattr(args, name) for name in OptimizerSettings.model_fields}
    return OptimizerSettings(**{key: value for key, value in given.items() if value is not None})


def _cmd_runs(args: argparse.Namespace) -> int:
    from coordinator import runs

    opened = _open(args)
    settings = opened.authority.settings
    try:
        if args.runs_command == "create":
            request = RunCreate(
                name=args.name,
                task=args.task,
                task_config=_parse_config(args),
                optimizer=_optimizer_settings(args),
                visibility=args.visibility,
                invite_code=args.invite_code,
                data_epochs=args.data_epochs,
                description=args.description,
            )
            with opened.store.write() as db:  # the organizer's own shell may name files of this server
                run, invite_code = runs.create_run(
                    db, settings=settings, request=request, allow_local_files=True
                )
                out = runs.run_out(db, run=run, settings=settings)
            if args.json:
                print(json.dumps({**out.model_dump(mode="json"), "invite_code": invite_code}, indent=2))
            else:
                preset = out.task_config.get("preset")
                print(
                    f"created run {out.name}: task {out.task}{f' ({preset})' if preset else ''}, "
                    f"{run.num_shards} shards x {run.samples_per_shard} samples, {out.visibility}"
                )
                if invite_code:
                    print(f"invite code (shown once): {invite_code}")
        elif args.runs_command == "list":
            with opened.store.read() as db:
                outs = [runs.run_out(db, run=r, settings=settings) for r in runs.list_runs(db)]
            if args.json:
                print(json.dumps([o.model_dump(mode="json") for o in outs], indent=2))
            elif not outs:
                print("no runs yet; create one with `volunteer-coordinator runs create`")
            else:
                print(f"{'NAME':<20} {'TASK':<14} {'STATE':<9} {'PEERS':>5} {'SAMPLES':>10} {'SHARDS':>12}")
                for o in outs:
                    s = o.stats
                    print(
                        f"{o.name:<20} {o.task:<14} {o.state:<9} {s.active_peers:>5} {s.samples_credited:>10} "
                        f"{f'{s.shards_done}/{s.shards_total}':>12}"
                    )
        elif args.runs_command == "flags":
            _print_flags(opened, args)
        else:
            state = {"pause": RunState.PAUSED, "resume": RunState.ACTIVE, "finish": RunState.FINISHED}[
                args.runs_command
            ]
            with opened.store.write() as db:
                run = runs.set_run_state(db, name=args.name, state=state)
                print(f"run {run.name} is {run.state}")
    finally:
        opened.store.close()
    return 0


def _print_flags(opened: Opened, args: argparse.Namespace) -> None:
    from coordinator import runs
    from coordinator.accounts import volunteers
    from coordinator.credit import flags

    with opened.store.read() as db:
        run = runs.get_run(db, name=args.name)
        volunteer_id = None
        if args.volunteer is not None:
            volunteer_id = volunteers.get_volunteer(db, name=args.volunteer).id
        found = flags.list_flags(db, run_id=run.id, volunteer_id=volunteer_id)
        outs = [flags.flag_out(flag, name) for flag, name in found]
    if args.json:
        print(json.dumps([o.model_dump(mode="json") for o in outs], indent=2))
    elif not outs:
        print(f"no flags in run {args.name}")
    else:
        for o in outs:
            times = f" x{o.count}" if o.count > 1 else ""
            print(f"{o.volunteer:<20} {o.kind:<18}{times} {o.detail}")


def _cmd_volunteers(args: argparse.Namespace) -> int:
    from coordinator.accounts import volunteers

    opened = _open(args)
    try:
        if args.volunteers_command == "list":
            with opened.store.read() as db:
                outs = [volunteers.volunteer_out(v) for v in volunteers.list_volunteers(db)]
            if args.json:
                print(json.dumps([o.model_dump(mode="json") for o in outs], indent=2))
            elif not outs:
                print("no volunteers yet")
            else:
                for o in outs:
                    print(f"{o.name:<40} {'banned' if o.banned else 'active'}")
        elif args.volunteers_command == "unban":
            with opened.store.write() as db:
                volunteer = volunteers.unban(db, name=args.name)
            print(f"{volunteer.name} is not banned: its credentials and peer keys work again")
        else:
            with opened.store.write() as db:
                volunteer, revoked = volunteers.ban(db, name=args.name, reason=args.reason)
            print(f"banned {volunteer.name}: credentials revoked, {revoked} peer session(s) revoked")
    finally:
        opened.store.close()
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    opened = _open(args)
    try:
        kid = opened.authority.rotate_signing_key()
    finally:
        opened.store.close()
    print(f"new signing key {kid}; tokens signed by earlier keys stay valid until they expire")
    return 0


def _cmd_checkpoints(args: argparse.Namespace) -> int:
    from coordinator.checkpoint_cli import cmd_checkpoints

    if args.data_dir is None and not os.environ.get("VOLUNTEER_COORDINATOR_DATA_DIR"):
        raise UsageError(
            f"{PROG} checkpoints: --data-dir is required (or set VOLUNTEER_COORDINATOR_DATA_DIR)"
        )
    return cmd_checkpoints(args)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "init": _cmd_init,
        "serve": _cmd_serve,
        "runs": _cmd_runs,
        "volunteers": _cmd_volunteers,
        "keys": _cmd_keys,
        "checkpoints": _cmd_checkpoints,
    }
    return handlers[args.command](args)


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    try:
        return run_main(_main, argv, prog=PROG, user_errors=(CoordinatorError, StoreError, TokenError))
    except ValidationError as exc:
        problems = "; ".join(
            f"{where}: {message}" if (where := ".".join(map(str, e["loc"]))) else message
            for e in exc.errors()
            # pydantic prefixes the message of a ValueError raised by a validator
            for message in [e["msg"].removeprefix("Value error, ")]
        )
        print(f"error: invalid value: {problems}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
