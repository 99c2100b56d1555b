"""This machine: CPU, memory, GPUs (memory, driver, temperature where readable), what the sensors see,
and the measured speed on the run's task, re-measured on demand."""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui.formatting import age, refusal
from tui.literal import plain
from tui.screens.base import AgentScreen
from tui.widgets.tables import pairs_table
from volunteer_app.control import AgentState, ProfileCommand
from volunteer_app.control_client import ControlError
from volunteer_app.protocol import HardwareProfile


def _celsius(value: float | None, readable: bool = True) -> str:
    if value is not None:
        return f"{value:.0f} °C"
    return "not readable on this machine" if readable else "no sensor readable"


def machine_rows(profile: HardwareProfile, state: AgentState, now: float) -> list[tuple[str, str | Text]]:
    sensors = state.sensors
    busy = ""
    if sensors.cpu_percent is not None:
        busy = f" · {sensors.cpu_percent:.0f} % busy"
        if sensors.volunteer_cpu_percent is not None:
            busy += f" ({sensors.volunteer_cpu_percent:.0f} % volunteer-app)"
    rows: list[tuple[str, str | Text]] = [
        ("CPU", f"{profile.cpu_model}"),
        ("Cores", f"{profile.cpu_cores} cores, {profile.cpu_threads} threads{busy}"),
        ("CPU temp", _celsius(sensors.cpu_temp_c)),
        ("Memory", f"{profile.ram_bytes / 2**30:.1f} GiB"),
        ("System", f"{profile.os} · Python {profile.python} · torch {profile.torch or 'not installed'}"),
    ]
    if not profile.gpus:
        rows.append(
            ("GPU", Text("No GPU found (no NVIDIA GPU or driver): training runs on the CPU.", style="bold"))
        )
    for index, gpu in enumerate(profile.gpus):
        temperature = sensors.gpu_temps_c[index] if index < len(sensors.gpu_temps_c) else None
        parts = [gpu.name, f"{gpu.memory_bytes / 2**30:.1f} GiB", f"driver {gpu.driver or 'unknown'}"]
        if gpu.cuda_capability:
            parts.append(f"compute {gpu.cuda_capability}")
        parts.append(_celsius(temperature, sensors.gpu_readable))
        rows.append((f"GPU {index}", " · ".join(parts)))
    if sensors.on_battery is None and sensors.battery_percent is None:
        power = "no battery reported (a desktop, or not readable)"
    else:
        power = ("on battery" if sensors.on_battery else "plugged in") + (
            f", {sensors.battery_percent:.0f} %" if sensors.battery_percent is not None else ""
        )
    rows.append(("Power", power))
    idle = {
        "input": "by keyboard and mouse input",
        "load": "by CPU load (input is not reported here)",
        "off": "not used (compute whenever allowed)",
    }[state.policy.idle_detection]
    rows.append(("Idle", idle))
    incoming = {True: "yes", False: "no (client mode)", None: "unknown"}[profile.accepts_connections]
    rows.append(("Incoming", f"other peers can connect: {incoming}"))
    b = profile.benchmark
    if b is None:
        rows.append(("Speed", "not measured yet: press m to measure (a few seconds of the run's task)"))
    else:
        preset = f" ({b.preset})" if b.preset else ""
        rows.append(
            (
                "Speed",
                Text.assemble(
                    (f"{b.samples_per_second:.1f} samples/s", "bold"),
                    f" on {b.task}{preset}, {b.device}, {b.threads} thread{'s' if b.threads != 1 else ''}, "
                    f"micro-batch {b.micro_batch_size}",
                ),
            )
        )
    if sensors.at:
        rows.append(("Sensors read", age(sensors.at, now)))
    return rows


class MachineScreen(AgentScreen):
    MODE = "machine"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("m", "measure", "Re-measure speed")]

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="machine", classes="panel"):
            yield Static(id="machine-info")
            yield Static(id="machine-notes")

    def on_mount(self) -> None:
        self.query_one("#machine").border_title = "This machine"
        self._asked_profile = False
        super().on_mount()

    def show_agent(self, fields: frozenset[str]) -> None:
        if not fields & {"attached", "profile", "sensors", "policy"}:
            return
        state = self.state
        info = self.query_one("#machine-info", Static)
        if state is None:
            info.update(Text("Waiting for the agent…", style="dim"))
            return
        if state.profile is None:
            info.update(Text("Reading this machine's hardware…", style="dim"))
            if not self._asked_profile:
                self._asked_profile = True
                self._profile(speed_test=False)
            return
        info.update(pairs_table(machine_rows(state.profile, state, self.vapp.clock()), label_width=12))
        notes = [n for n in state.policy.notes if n]
        self.query_one("#machine-notes", Static).update(
            Group(Text("\nWhat the agent cannot see here:", style="bold"), *(plain(f"· {n}") for n in notes))
            if notes
            else ""
        )

    def action_measure(self) -> None:
        self.notify("Measuring this machine's speed on the run's task (a few seconds)…", title="This machine")
        self._profile(speed_test=True)

    @work(exclusive=True, group="profile", exit_on_error=False)
    async def _profile(self, speed_test: bool) -> None:
        try:
            result = await self.vapp.link.call(ProfileCommand(speed_test=speed_test), timeout=600)
        except ControlError as exc:
            if speed_test:
                self.notify(refusal(exc.detail, exc.code), title="Could not measure", severity="error")
            return
        if speed_test:
            self.notify(result.message, title="Measured")
