"""Text from a coordinator or a peer, made safe to show: no terminal escapes, no control characters.

Everything a coordinator says (run names and descriptions, error details, organizers' messages), what
peers say (volunteer names) and what the model writes (a language model's continuation) is shown to the
volunteer as *text*. A terminal interprets escape sequences: OSC 0 retitles the window, OSC 52 writes the
clipboard, ``ESC [2K`` erases the line so that a forged "joined: everything is fine" can take its place.
So before any such text reaches a terminal, it goes through :func:`clean` (or :func:`one_line`):

* C0 controls (``\\x00``-``\\x1f`` but tab and newline), DEL and the C1 controls (``\\x80``-``\\x9f``,
  which some terminals take as 8-bit escape introducers) are replaced by ``�`` (so that a reader sees that
  something was there; the escape sequence's printable tail stays visible and harmless);
* the Unicode bidirectional overrides and isolates (``U+202A``-``U+202E``, ``U+2066``-``U+2069``), which
  reorder what is shown ("Trojan Source"), are replaced the same way.

Markup is the other half: Textual and rich read ``[@click=...]`` and ``[link=...]`` in plain strings. The
app shows coordinator text as ``rich.text.Text`` or ``textual.content.Content`` objects, never as markup
(``tui`` does this); the CLI prints plain strings. This module is stdlib only.
"""

from __future__ import annotations

import re
from typing import Any

REPLACEMENT = "\ufffd"

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_ONE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def clean(text: Any) -> str:
    """``text`` (``str()`` of it) with every control character and bidi override replaced by ``�``;
    newlines and tabs are kept."""
    return _UNSAFE.sub(REPLACEMENT, text if isinstance(text, str) else str(text))


def one_line(text: Any, *, limit: int | None = None) -> str:
    """``text`` cleaned and on one line: newlines and tabs become spaces, runs of spaces collapse, and
    with ``limit`` it is cut to that many characters (ending in ``…``)."""
    raw = text if isinstance(text, str) else str(text)
    flat = " ".join(raw.replace("\t", " ").replace("\r", " ").replace("\n", " ").split())
    flat = _UNSAFE_ONE_LINE.sub(REPLACEMENT, flat)
    if limit is not None and len(flat) > limit:
        flat = flat[: max(0, limit - 1)] + "…"
    return flat


def is_clean(text: str) -> bool:
    """Whether ``text`` holds nothing :func:`clean` would replace."""
    return _UNSAFE.search(text) is None


def clean_data(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings, numbers) with every string, keys included, cleaned."""
    if isinstance(value, str):
        return clean(value)
    if isinstance(value, dict):
        return {clean_data(k): clean_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(clean_data(v) for v in value)
    return value
