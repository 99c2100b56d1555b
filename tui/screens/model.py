"""What the shared model can do now: its drawings of fixed prompts (or its text, for text tasks),
refreshed after each evaluation, the prompt accuracy over time, and a prompt box to ask for a drawing.

Everything comes from the agent's ``evaluate`` command (the worker's copy of the model); the TUI holds
no model of its own.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.events import Resize
from textual.widgets import Input, Static

from tui.formatting import age, is_contributing, refusal
from tui.history import metric_series
from tui.literal import literal, one_line, plain
from tui.screens.base import AgentScreen
from tui.widgets.chart import LineChart
from tui.widgets.chrome import Words
from tui.widgets.picture import PictureTile, tile_factor, tiles_per_row
from volunteer_app.control import EvaluateCommand, Evaluation, EvaluationSample, format_duration
from volunteer_app.control_client import ControlError

PROMPT_HELP = "a caption, e.g. a big red circle in the center"


def main_metric(evaluation: Evaluation | None) -> str | None:
    if evaluation is None or not evaluation.metrics:
        return None
    return "prompt_accuracy" if "prompt_accuracy" in evaluation.metrics else next(iter(evaluation.metrics))


class ModelScreen(AgentScreen):
    MODE = "model"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("e", "evaluate", "Draw again")]

    def __init__(self) -> None:
        super().__init__()
        self._shown_evaluation: tuple[float, int] | None = None
        self._layout: tuple[int, int] = (0, 0)

    def compose_body(self) -> ComposeResult:
        yield Words(id="model-summary")
        with Horizontal(id="model-body"):
            yield VerticalScroll(Grid(id="gallery-grid"), id="gallery", classes="panel")
            with VerticalScroll(id="model-side"):
                yield LineChart(
                    "prompt accuracy",
                    digits=2,
                    ylim=(0.0, 1.0),
                    empty="after the first evaluations",
                    id="accuracy-chart",
                )
                yield Input(placeholder=PROMPT_HELP, id="prompt")
                yield Static("Type a caption and press Enter: the model draws it.", id="drawing-note")
                yield Vertical(id="drawing")

    def on_mount(self) -> None:
        self.query_one("#gallery").border_title = "The model draws"
        super().on_mount()

    # ------------------------------------------------------------------ the agent's evaluations
    def show_agent(self, fields: frozenset[str]) -> None:
        state = self.state
        evaluation = state.evaluation if state is not None else None
        self.query_one("#model-summary", Words).say(self._summary(evaluation))
        metric = main_metric(evaluation)
        chart = self.query_one("#accuracy-chart", LineChart)
        if metric is not None and state is not None:
            title = one_line(metric.replace("_", " "), limit=40)
            if chart.title != title:
                chart.title = title
                chart.ylim = (0.0, 1.0) if "accuracy" in metric else None
                chart.show(metric_series(state.metric_history, metric), force=True)
            else:
                chart.show(metric_series(state.metric_history, metric))
        key = (evaluation.at, len(evaluation.samples)) if evaluation is not None else None
        if key != self._shown_evaluation:
            self._shown_evaluation = key
            self._fill_gallery(force=True)

    def _summary(self, evaluation: Evaluation | None) -> Text:
        state = self.state
        if state is None:
            return Text("Waiting for the agent…", style="dim")
        every = state.settings.evaluate_every_minutes
        schedule = f"every {format_duration(every * 60)}" if every else "on request only"
        if evaluation is None:
            if not is_contributing(state):
                return Text("Join a run to see its model (press j).")
            return Text(
                f"No drawings yet: the agent draws a minute into training, then {schedule}. Press e to draw now."
            )
        text = Text()
        text.append(f"Epoch {evaluation.epoch}", style="bold")
        for name, value in evaluation.metrics.items():
            text.append(f" · {name.replace('_', ' ')} {value:.3f}")
        text.append(
            f" · drawn {age(evaluation.at, self.vapp.clock())}, then {schedule} · e draws again", style="dim"
        )
        return text

    def on_resize(self, _event: Resize) -> None:
        if self.is_mounted:
            self._fill_gallery()

    def _fill_gallery(self, *, force: bool = False) -> None:
        state = self.state
        evaluation = state.evaluation if state is not None else None
        grid = self.query_one("#gallery-grid", Grid)
        samples = evaluation.samples if evaluation is not None else []
        width = max(10, self.query_one("#gallery").content_size.width)
        factor = tile_factor(samples, width)
        images = any(s.kind == "image" for s in samples)
        columns = tiles_per_row(width, 32 // factor) if images else 1
        if (columns, factor) == self._layout and not force:
            return
        self._layout = (columns, factor)
        grid.remove_children()
        grid.styles.grid_size_columns = columns
        grid.set_class(images, "-pictures")
        if not samples:
            return
        if images:
            grid.mount_all(PictureTile(sample, factor=factor) for sample in samples)
        else:
            grid.mount_all(Static(_text_sample(sample), classes="text-sample") for sample in samples)

    # ------------------------------------------------------------------ asking for a drawing
    def action_evaluate(self) -> None:
        self.query_one("#drawing-note", Static).update("Drawing the fixed prompts…")
        self._evaluate(None)

    @on(Input.Submitted, "#prompt")
    def _prompt(self, event: Input.Submitted) -> None:
        caption = event.value.strip()
        if not caption:
            self.query_one("#drawing-note", Static).update(f"Type {PROMPT_HELP}.")
            return
        # what was typed, as typed: brackets in a caption are not markup
        self.query_one("#drawing-note", Static).update(
            literal(f"Drawing “{caption}”… (between training steps)")
        )
        self._evaluate([caption])

    @work(exclusive=True, group="evaluate", exit_on_error=False)
    async def _evaluate(self, prompts: list[str] | None) -> None:
        note = self.query_one("#drawing-note", Static)
        try:
            result = await self.vapp.link.call(EvaluateCommand(prompts=prompts), timeout=300)
        except ControlError as exc:
            note.update(plain(refusal(exc.detail, exc.code), style="bold"))
            return
        try:
            evaluation = Evaluation.model_validate(result.data)
        except ValueError:
            note.update("The agent answered without drawings.")
            return
        if prompts is None:
            note.update(f"Drew {len(evaluation.samples)} prompts at epoch {evaluation.epoch}.")
            return
        drawing = self.query_one("#drawing", Vertical)
        await drawing.remove_children()
        sample = evaluation.samples[0] if evaluation.samples else None
        if sample is None:
            note.update("The model drew nothing for this caption.")
        elif sample.error:
            note.update(
                plain(f"The model cannot draw that: {sample.error}. Try {PROMPT_HELP}.", style="bold")
            )
        elif sample.kind == "image":
            note.update(f"Epoch {evaluation.epoch}:")
            await drawing.mount(
                PictureTile(sample, factor=1 if self.size.height >= 44 else 2, caption_lines=3)
            )
            drawing.scroll_visible()
        else:
            note.update(f"Epoch {evaluation.epoch}:")
            await drawing.mount(Static(_text_sample(sample)))
            drawing.scroll_visible()


def _text_sample(sample: EvaluationSample) -> Text:
    """A text task's sample: the prompt and what the model wrote (or why it could not), as text."""
    text = Text()
    text.append(plain(sample.prompt, style="bold"))
    text.append(" → ")
    if sample.error:
        text.append(plain(sample.error, style="italic"))
    else:
        text.append(plain(sample.text or ""))
    return text
