"""The volunteer agent service: the supervisor's parts and the local control API.

:func:`serve_agent` runs the service in the current process: it takes the one-agent-per-user lock,
starts the control API, writes where it listens, and runs until stopped (SIGINT/SIGTERM, or the
``stop`` command). The parts work alone and are tested alone: :mod:`.clock`, :mod:`.outbox`,
:mod:`.worker`, :mod:`.leases`, :mod:`.speedtest`, :mod:`.link`, :mod:`.policy`, :mod:`.sensors`,
:mod:`.contribution` (one run), :mod:`.service` (the agent) and :mod:`.server` (its control API).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from volunteer_app.settings import AgentSettings

LOOPBACK = ("127.0.0.1", "localhost", "::1")


async def serve_agent(
    settings: AgentSettings,
    *,
    allow_remote: bool = False,
    on_ready: Callable[[str], None] | None = None,
    after_start: Callable[[Any], Awaitable[None]] | None = None,
    handle_signals: bool = True,
) -> None:
    """Run the agent service until it is stopped.

    :param allow_remote: listen on ``settings.control_host`` even when it is not loopback.
    :param on_ready: called with the control URL once the API answers.
    :param after_start: awaited with the service once it runs (``join --foreground`` joins from here).
    :raises AgentAlreadyRunning: another agent holds this user's lock.
    """
    from volunteer_app.agent.server import ControlServer
    from volunteer_app.agent.service import AgentService
    from volunteer_app.agentfiles import control_token

    host = settings.control_host
    if host not in LOOPBACK and not allow_remote:
        raise ValueError(
            f"the control API would listen on {host}, beyond this computer; pass --allow-remote to mean it"
        )
    service = AgentService(settings=settings)
    service.acquire()
    try:
        token = control_token(settings, create=True)
        assert token is not None
        server = ControlServer(
            service, host=host, port=settings.control_port, token=token, allow_remote=allow_remote
        )
        url = await server.start()
        service.write_location(url=url, host=host, port=server.port)
        if handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, service.request_stop)
        if on_ready is not None:
            on_ready(url)
        runner = asyncio.create_task(service.run())
        if after_start is not None:
            try:
                await after_start(service)
            except BaseException:
                service.request_stop()
                with contextlib.suppress(Exception):
                    await runner
                raise
        await runner
        await server.close()
    finally:
        service.release()
