"""Every setting of the agent's resource policy, grouped, validated while typing and applied live (with a
note where a change restarts the worker)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from textual import on, work
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui.formatting import refusal
from tui.screens.base import AgentScreen
from tui.widgets.setting import SettingRow
from volunteer_app.control import RESTART_FIELDS, PolicySettings, SettingsCommand, validation_problems
from volunteer_app.control_client import ControlError

GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Processor",
        ("max_threads", "pause_when_cpu_busy_percent", "only_when_idle", "idle_minutes", "idle_cpu_percent"),
    ),
    ("Graphics card", ("device", "gpu_suspended", "gpu_exclusive_apps", "max_gpu_temp_c")),
    ("Memory", ("max_memory_gb",)),
    ("Battery", ("pause_on_battery", "battery_pause_below", "battery_resume_above")),
    ("Schedule", ("schedule", "start_paused")),
    ("Temperature", ("max_cpu_temp_c", "temp_resume_margin_c")),
    ("This app", ("evaluate_every_minutes", "remember_quit_choice")),
)


def grouped_fields() -> list[tuple[str, list[str]]]:
    """The groups above, plus "Other" for any setting a newer agent protocol adds."""
    fields = list(PolicySettings.model_fields)
    groups = [(title, [k for k in keys if k in fields]) for title, keys in GROUPS]
    placed = {k for _, keys in groups for k in keys}
    rest = [k for k in fields if k not in placed]
    if rest:
        groups.append(("Other", rest))
    return [(title, keys) for title, keys in groups if keys]


def check_setting(current: PolicySettings, key: str, value: Any) -> tuple[Any, str | None]:
    """``value`` for ``key`` as the agent would take it (typed: ``"4"`` -> 4), or the problem with it
    given the other settings."""
    try:
        checked = PolicySettings.model_validate({**current.model_dump(), key: value})
    except ValidationError as exc:
        return None, validation_problems(exc)
    return getattr(checked, key), None


class SettingsScreen(AgentScreen):
    MODE = "settings"

    def compose_body(self) -> ComposeResult:
        current = self.state.settings if self.state is not None else PolicySettings()
        with VerticalScroll(id="settings"):
            yield Static(
                "Changes apply at once: press Enter or leave a field (Tab) to apply it, Esc to leave it. "
                "Empty or 'none' clears an optional value.",
                id="settings-help",
            )
            for title, keys in grouped_fields():
                yield Static(title, classes="settings-group")
                for key in keys:
                    yield SettingRow(
                        key,
                        PolicySettings.model_fields[key],
                        getattr(current, key),
                        check=self._check,
                        restart=RESTART_FIELDS.get(key),
                    )

    def _check(self, key: str, value: Any) -> tuple[Any, str | None]:
        current = self.state.settings if self.state is not None else PolicySettings()
        return check_setting(current, key, value)

    def show_agent(self, fields: frozenset[str]) -> None:
        if not fields & {"settings", "attached"} or self.state is None:
            return
        settings = self.state.settings
        for row in self.query(SettingRow):
            value = getattr(settings, row.key)
            if value != row.value:
                row.set_value(value)

    @on(SettingRow.Commit)
    def _commit(self, event: SettingRow.Commit) -> None:
        event.row.show_note("Applying…")
        self._apply(event.row, event.key, event.value)

    @work(group="settings", exit_on_error=False)
    async def _apply(self, row: SettingRow, key: str, value: Any) -> None:
        try:
            result = await self.vapp.link.call(SettingsCommand(values={key: value}), timeout=60)
        except ControlError as exc:
            row.show_problem(refusal(exc.detail, exc.code))
            return
        restart = key in ((result.data or {}).get("restart") or [])
        row.value = getattr(
            PolicySettings.model_validate((result.data or {}).get("settings", {})), key, value
        )
        row.show_note(f"Applied: {result.message}")
        if restart:
            self.notify(result.message, title="The worker restarts", severity="warning")
