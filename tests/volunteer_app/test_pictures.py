"""Pictures: PNG files (Pillow), grids and half-block terminal rendering."""

from __future__ import annotations

import io
import re
import struct

import pytest

from volunteer_app.pictures import (
    RESET,
    UPPER_HALF_BLOCK,
    Picture,
    ansi_lines,
    gallery_lines,
    grid,
    half_block_cells,
    png_bytes,
    read_png,
    xterm_256,
)

RED, BLUE, WHITE = (230, 40, 40), (50, 90, 235), (255, 255, 255)


def _picture(width: int, height: int, colour_of: object) -> Picture:
    rows = b"".join(bytes(colour_of(x, y)) for y in range(height) for x in range(width))  # type: ignore[operator]
    return Picture(width, height, rows)


def test_png_round_trips_and_is_a_valid_file() -> None:
    picture = _picture(5, 3, lambda x, y: (x * 50, y * 100, 7))
    data = png_bytes(picture)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    (length,) = struct.unpack(">I", data[8:12])
    width, height, depth, colour = struct.unpack(">IIBB", data[16:26])
    assert (length, width, height, depth, colour) == (13, 5, 3, 8, 2)
    assert read_png(data) == picture
    big = read_png(png_bytes(picture, scale=3))
    assert (big.width, big.height) == (15, 9) and big.pixel(14, 8) == picture.pixel(4, 2)
    assert read_png(png_bytes(picture, scale=3)) == picture.scaled(3)  # nearest neighbour, no blending
    corrupted = bytearray(data)
    corrupted[-20] ^= 0xFF  # in the image data: its chunk's CRC no longer matches
    with pytest.raises(ValueError, match="not an intact PNG"):
        read_png(bytes(corrupted))
    with pytest.raises(ValueError, match="not an intact PNG"):
        read_png(b"GIF89a" + data[6:])


def test_read_png_refuses_what_is_not_8_bit_rgb() -> None:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGBA", (2, 2), (1, 2, 3, 4)).save(out, format="PNG")
    with pytest.raises(ValueError, match="only 8-bit RGB"):
        read_png(out.getvalue())


def test_a_picture_must_hold_exactly_its_pixels() -> None:
    with pytest.raises(ValueError, match="needs 12 bytes"):
        Picture(2, 2, b"\x00" * 11)


def test_grid_tiles_pictures_in_rows_with_padding() -> None:
    red, blue = _picture(2, 2, lambda x, y: RED), _picture(2, 2, lambda x, y: BLUE)
    tiled = grid([red, blue, red], columns=2, pad=1, background=WHITE)
    assert (tiled.width, tiled.height) == (7, 7)
    assert tiled.pixel(0, 0) == WHITE and tiled.pixel(1, 1) == RED and tiled.pixel(4, 1) == BLUE
    assert tiled.pixel(1, 4) == RED and tiled.pixel(4, 4) == WHITE  # the empty fourth cell
    with pytest.raises(ValueError):
        grid([red, _picture(3, 2, lambda x, y: RED)])


def test_half_blocks_put_two_pixel_rows_in_one_line() -> None:
    picture = _picture(2, 3, lambda x, y: RED if y == 0 else BLUE)
    cells = half_block_cells(picture, background=(0, 0, 0))
    assert cells == [[(RED, BLUE), (RED, BLUE)], [(BLUE, (0, 0, 0)), (BLUE, (0, 0, 0))]]
    lines = ansi_lines(picture)
    assert len(lines) == 2 and all(line.endswith(RESET) for line in lines)
    assert lines[0].count(UPPER_HALF_BLOCK) == 2
    assert "38;2;230;40;40;48;2;50;90;235m" in lines[0]  # upper pixel as foreground, lower as background
    assert lines[0].count("\x1b[38;2") == 1, "a run of equal cells needs one colour change"
    assert "38;5;" in ansi_lines(picture, truecolor=False)[0]


def test_xterm_palette_picks_cube_colours_and_greys() -> None:
    assert xterm_256((255, 0, 0)) == 196
    assert xterm_256((0, 0, 0)) == 16
    assert xterm_256((128, 128, 128)) in range(232, 256)


def test_gallery_lays_pictures_side_by_side_with_wrapped_captions() -> None:
    pictures = [_picture(8, 4, lambda x, y: RED) for _ in range(3)]
    captions = ["✓ a big red circle in the center", "✗ short", "· x"]
    lines = gallery_lines(pictures, captions, width=20, caption_lines=2)  # two 8-wide tiles fit in 20 columns
    visible = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in lines]
    assert visible[0] == UPPER_HALF_BLOCK * 8 + "  " + UPPER_HALF_BLOCK * 8
    assert visible[2].startswith("✓ a big") and "✗ short" in visible[2]
    assert visible[3].endswith("…") or len(visible[3]) <= 18
    assert visible[5] == UPPER_HALF_BLOCK * 8  # the third picture starts the next row
