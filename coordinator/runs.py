"""Training runs: create (with task-config validation), list, read, pause, resume, finish."""

from __future__ import annotations

import time

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from coordinator.accounts.authority import new_id
from coordinator.credit.ledger import run_stats
from coordinator.credit.work import add_shards, finish_run
from coordinator.errors import Conflict, Invalid, NotFound
from coordinator.files import RunFileStore, run_files, store_run_files
from coordinator.models import Run
from coordinator.settings import CoordinatorSettings
from volunteer_app.protocol import OptimizerSettings, RunConfigOut, RunCreate, RunOut
from volunteer_app.states import RunState
from volunteer_app.tokens import hash_secret, new_secret
from workers.tasks import TaskConfigError, UnknownTaskError, available_tasks, load_task

RUN_STATES = tuple(RunState)


def validate_task_config(
    task: str, task_config: dict[str, object], *, files: RunFileStore | None = None
) -> tuple[dict[str, object], int, int]:
    """Check a task config; return the full config and (num_shards, samples_per_shard).

    Only installed tasks (built in, or ``volunteer_app.tasks`` entry points) may be named: a task is never
    imported by module path, here or on a volunteer's computer. A config that names a file (the task's
    ``file_fields``) needs ``files``, the store the file is copied into: only the organizer's own shell
    (``volunteer-coordinator runs create``) passes one, never a request over HTTP, which could otherwise
    have the coordinator read and serve any file of its server.

    Raises :class:`Invalid` with one field error per problem, e.g. ``task_config.d_model``.
    """
    if task not in available_tasks():
        detail = (
            f"unknown task {task!r}; installed tasks: {', '.join(available_tasks())} (an organizer's own task "
            "is installed as a `volunteer_app.tasks` entry point)"
        )
        raise Invalid(detail, code="unknown_task", fields={"task": detail})
    try:
        spec = load_task(task)
    except UnknownTaskError as exc:
        raise Invalid(str(exc), code="unknown_task", fields={"task": str(exc)}) from exc
    named = [name for name in spec.file_fields if task_config.get(name) is not None]
    if named and files is None:
        detail = (
            "a run's files are given from the server's shell (`volunteer-coordinator runs create --config "
            f"{named[0]}=PATH`), not over HTTP"
        )
        raise Invalid(detail, code="files_not_allowed", fields={f"task_config.{named[0]}": detail})
    try:
        config = spec.make_config(task_config)
    except TaskConfigError as exc:
        fields = {f"task_config.{name}": why for name, why in exc.problems.items()}
        raise Invalid(str(exc), code="invalid_task_config", fields=fields) from exc
    values = spec.config_to_dict(config)
    if named and files is not None:
        values = store_run_files(spec, values, store=files)
    return values, spec.num_shards(config), spec.samples_per_shard(config)


def run_file_store(settings: CoordinatorSettings) -> RunFileStore:
    """Where the coordinator keeps its runs' files (``DATA_DIR/files``)."""
    return RunFileStore(settings.data_dir / "files")


def create_run(
    db: Session, *, settings: CoordinatorSettings, request: RunCreate, allow_local_files: bool = False
) -> tuple[Run, str | None]:
    """Create a run and its first data epoch's shard queue. Returns the run and, for an invite-only run
    created without a code, the generated invite code (shown once).

    ``allow_local_files``: the task config may name files of this server (the organizer's shell only)."""
    if db.scalars(select(Run).where(Run.name == request.name)).first() is not None:
        raise Conflict(f"a run named {request.name!r} already exists", code="run_exists")
    task_config, num_shards, samples_per_shard = validate_task_config(
        request.task,
        dict(request.task_config),
        files=run_file_store(settings) if allow_local_files else None,
    )
    invite_code = request.invite_code
    generated = None
    if request.visibility == "invite" and invite_code is None:
        invite_code = generated = new_secret("inv")[:24]
    if request.visibility == "open" and invite_code is not None:
        raise Invalid(
            "an invite code only makes sense with visibility 'invite'",
            fields={"invite_code": "needs visibility 'invite'"},
        )
    now = time.time()
    run_id = new_id()
    port = 0
    if settings.swarm.port_base:
        port = settings.swarm.port_base + (db.scalar(select(func.count()).select_from(Run)) or 0)
    run = Run(
        id=run_id,
        name=request.name,
        task=request.task,
        task_config=task_config,
        optimizer=run_optimizer_settings(request.optimizer).model_dump(),
        description=request.description,
        visibility=request.visibility,
        invite_code_hash=hash_secret(invite_code) if invite_code else None,
        state=RunState.ACTIVE,
        data_epochs=request.data_epochs,
        current_data_epoch=0,
        num_shards=num_shards,
        samples_per_shard=samples_per_shard,
        hivemind_run_id=f"va-{request.name}-{run_id[:8]}",
        swarm_port=port,
        swarm_maddrs=[],
        created_at=now,
        updated_at=now,
    )
    db.add(run)
    db.flush()
    add_shards(db, run=run, data_epoch=0)
    return run, generated


def get_run(db: Session, *, name: str) -> Run:
    run = db.scalars(select(Run).where(Run.name == name)).first()
    if run is None:
        raise NotFound(f"no run named {name!r}", code="run_not_found")
    return run


def list_runs(db: Session, *, include_finished: bool = True) -> list[Run]:
    query = select(Run).order_by(Run.created_at)
    if not include_finished:
        query = query.where(Run.state != RunState.FINISHED)
    return list(db.scalars(query))


def set_run_state(db: Session, *, name: str, state: str) -> Run:
    """Pause, resume or finish a run. Finishing is final; pausing a finished run is a conflict."""
    run = get_run(db, name=name)
    if run.state == state:
        return run
    if run.state == RunState.FINISHED:
        raise Conflict(f"run {name!r} is finished and cannot be {state}", code="run_finished")
    run.state = state
    run.updated_at = time.time()
    if state == RunState.FINISHED:
        finish_run(db, run=run)
    return run


def run_config_out(run: Run, *, settings: CoordinatorSettings) -> RunConfigOut:
    return RunConfigOut(
        name=run.name,
        task=run.task,
        task_config=run.task_config,
        optimizer=OptimizerSettings.model_validate(run.optimizer),
        hivemind_run_id=run.hivemind_run_id,
        files=run_files(run.task, run.task_config, store=run_file_store(settings)),
    )


def run_out(db: Session, *, run: Run, settings: CoordinatorSettings) -> RunOut:
    return RunOut(
        name=run.name,
        task=run.task,
        description=run.description,
        state=run.state,  # type: ignore[arg-type]
        visibility=run.visibility,  # type: ignore[arg-type]
        created_at=run.created_at,
        data_epochs=run.data_epochs,
        task_config=run.task_config,
        optimizer=OptimizerSettings.model_validate(run.optimizer),
        stats=run_stats(db, run=run, settings=settings),
        initial_peers=live_swarm_maddrs(run),
        files=run_files(run.task, run.task_config, store=run_file_store(settings)),
    )


SWARM_ADDRESS_TTL = 150.0
"""Seconds a published swarm address stays valid: its peer re-publishes it every minute while alive."""


def live_swarm_maddrs(run: Run, now: float | None = None) -> list[str]:
    """The run's swarm-peer addresses, or none while that peer is (re)starting or gone.

    Addresses left in the store by a peer that has stopped (``serve`` restarted, possibly on another
    port) would send workers to a dead address; an empty list tells the agent to wait for the new one.
    """
    now = time.time() if now is None else now
    if not run.swarm_maddrs or (run.swarm_updated_at or 0) < now - SWARM_ADDRESS_TTL:
        return []
    return list(run.swarm_maddrs)


GRADIENT_AVERAGING_DEFAULTS: dict[str, object] = {"target_batch_size": 4096, "average_state_every": 4}
"""Defaults for fields an organizer left unset in ``gradients`` mode, where a global epoch is one optimizer
step: a large target batch keeps the all-reduce rounds affordable, and parameters need averaging only now
and then (the defaults of OptimizerSettings are those of the local-update modes)."""


def run_optimizer_settings(settings: OptimizerSettings) -> OptimizerSettings:
    """The optimizer settings a new run gets: what the organizer set, and mode-fitting defaults for the rest."""
    if settings.update_mode != "gradients":
        return settings
    unset = {k: v for k, v in GRADIENT_AVERAGING_DEFAULTS.items() if k not in settings.model_fields_set}
    return settings.model_copy(update=unset) if unset else settings
