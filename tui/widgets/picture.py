"""The model's drawings in the terminal: two pixel rows per cell with the upper half block ``▀`` (upper
pixel as foreground colour, lower pixel as background), via :func:`volunteer_app.pictures.half_block_cells`.

Colours are 24-bit; Textual converts them to the nearest of 256 (or 16) colours on terminals without
true colour, so the same widget serves every terminal and the browser.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

from rich.color import Color as RichColor
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

from tui.literal import clean
from volunteer_app.control import EvaluationSample
from volunteer_app.pictures import UPPER_HALF_BLOCK, Picture, half_block_cells

MAX_SIDE = 256


def picture_of(image: dict[str, object] | None) -> Picture | None:
    """An evaluation sample's ``image`` ({width, height, pixels: base64 RGB}) as a :class:`Picture`;
    None when it is missing or malformed (the agent forwards what its worker drew)."""
    if not image:
        return None
    try:
        width, height = int(image["width"]), int(image["height"])  # type: ignore[call-overload]
        if not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE):
            return None
        return Picture(width, height, base64.b64decode(str(image["pixels"]), validate=True))
    except (KeyError, TypeError, ValueError, binascii.Error):
        return None


def shrink(picture: Picture, factor: int) -> Picture:
    """Average ``factor`` x ``factor`` blocks of pixels (a 32x32 drawing at half size is 16x16)."""
    if factor <= 1:
        return picture
    width, height = max(1, picture.width // factor), max(1, picture.height // factor)
    out = bytearray()
    for y in range(height):
        for x in range(width):
            total = [0, 0, 0]
            for dy in range(factor):
                for dx in range(factor):
                    pixel = picture.pixel(
                        min(x * factor + dx, picture.width - 1), min(y * factor + dy, picture.height - 1)
                    )
                    for c in range(3):
                        total[c] += pixel[c]
            out.extend(t // (factor * factor) for t in total)
    return Picture(width, height, bytes(out))


class PictureView(Widget):
    """One picture drawn with half blocks: ``width`` columns by ``height / 2`` lines."""

    DEFAULT_CSS = """
    PictureView { width: auto; height: auto; }
    """

    def __init__(self, picture: Picture | None = None, *, factor: int = 1, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._strips: list[Strip] = []
        self._width = 0
        self.set_picture(picture, factor=factor)

    def set_picture(self, picture: Picture | None, *, factor: int = 1) -> None:
        if picture is None:
            self._strips, self._width = [], 0
        else:
            shown = shrink(picture, factor)
            self._width = shown.width
            self._strips = [
                Strip(
                    [
                        Segment(
                            UPPER_HALF_BLOCK,
                            Style(color=RichColor.from_rgb(*up), bgcolor=RichColor.from_rgb(*low)),
                        )
                        for up, low in row
                    ],
                    shown.width,
                )
                for row in half_block_cells(shown)
            ]
        self.refresh(layout=True)

    @property
    def rows(self) -> int:
        """Terminal lines the picture takes (two pixel rows each)."""
        return len(self._strips)

    def get_content_width(self, container: Size, viewport: Size) -> int:
        return self._width

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._strips)

    def render_line(self, y: int) -> Strip:
        if 0 <= y < len(self._strips):
            return self._strips[y].crop(0, self.size.width)
        return Strip.blank(self.size.width, self.rich_style)


def verdict(sample: EvaluationSample) -> Text:
    """✓ / ✗ / ? and the caption, as the gallery shows it under a drawing (the caption and the error as
    text: a run's prompts come from its coordinator)."""
    if sample.error:
        return Text.assemble(
            ("! ", "bold"), (clean(sample.prompt), ""), ("\n" + clean(sample.error), "italic")
        )
    mark = {True: ("✓ ", "bold green"), False: ("✗ ", "bold red")}.get(sample.correct, ("· ", ""))  # type: ignore[arg-type]
    return Text.assemble(mark, clean(sample.prompt))


class PictureTile(Vertical):
    """A drawing with its caption and whether a program judged it right."""

    DEFAULT_CSS = """
    PictureTile { width: auto; height: auto; }
    PictureTile > Static { width: 100%; height: auto; }
    """

    def __init__(
        self, sample: EvaluationSample, *, factor: int = 1, caption_lines: int = 2, **kwargs: object
    ):
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.sample = sample
        self.factor = factor
        self.caption_lines = caption_lines

    def compose(self) -> ComposeResult:
        picture = picture_of(self.sample.image)
        rows = 0
        if picture is not None:
            view = PictureView(picture, factor=self.factor)
            rows = view.rows
            yield view
            width = max(1, picture.width // self.factor)
        else:
            width = 32 // self.factor
        lines = self.caption_lines if self.sample.error is None else self.caption_lines + 2
        caption = Static(verdict(self.sample), classes="caption")
        caption.styles.width = width
        caption.styles.height = lines
        self.styles.width = width
        self.styles.height = rows + lines
        yield caption


def tiles_per_row(width: int, tile: int, gap: int = 2) -> int:
    return max(1, (width + gap) // (tile + gap))


def tile_factor(samples: Sequence[EvaluationSample], width: int) -> int:
    """Full size when two drawings fit side by side, else half size (small terminals)."""
    sizes = [p.width for p in (picture_of(s.image) for s in samples) if p is not None]
    side = max(sizes, default=32)
    return 1 if width >= 2 * (side + 2) else 2
