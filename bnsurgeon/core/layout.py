"""Plain aligned tables that fit a width: no box drawing, no wrapped cells.

Logs and CI read piped output, where a boxed table squeezed to 80 columns is
unreadable. A table here is columns of left- or right-aligned text separated by two
spaces. When it is wider than the width, cells marked ``shrink`` are shortened with
``...`` down to their minimum, then optional columns are dropped (lowest priority
first), then any cell is shortened; a cell is never wrapped onto a second line.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Sequence

ELLIPSIS = "..."
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on or hide written as an escape.

    Names, keys, metadata and paths come from files: an ESC sequence in a state-dict key
    would recolour or clear the user's terminal, ``\\r`` or ``\\n`` would forge a line, a bidi
    override (U+202E) would show a name reversed. Everything ``str.isprintable`` refuses (C0
    and C1 controls, DEL, bidi and zero-width format characters, line and paragraph separators,
    spaces other than ' ', lone surrogates of undecodable file names) becomes ``\\n``,
    ``\\x1b`` or ``\\u202e``, as Python writes them. Idempotent: its output is all printable.
    """
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _NAMED_ESCAPES.get(ch) or _escape(ord(ch)) for ch in text)


def _escape(code: int) -> str:
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


GAP = "  "
INDENT = "  "


@dataclass(frozen=True)
class Column:
    header: str
    align: str = "left"  # "left" | "right"
    priority: int = 0  # 0: never dropped; higher numbers are dropped first
    shrink: bool = False  # free text (paths, details): shortened before columns are dropped; names are not
    min_width: int = 12
    short_header: str | None = None  # used when the header is wider than the cells


def shown(value: object, width: int = 80) -> str:
    """A repr of ``value`` (from a file or a user) in at most ``width`` printable characters, and for a
    string cut this way its length after them (`` (1,000,000 characters)``).

    ``reprlib`` abbreviates long strings and big or deep containers while it writes, so a
    megabyte of metadata is never turned into a megabyte of text to be cut.
    """
    import reprlib

    class Writer(reprlib.Repr):
        def repr_int(self, number: int, level: int) -> str:  # 10**5000 would not even convert
            return f"<int of {number.bit_length():,} bits>" if number.bit_length() > 128 else repr(number)

    writer = Writer()
    writer.maxstring = writer.maxother = width
    text = shorten(printable(writer.repr(value)), width)
    return text + (f" ({len(value):,} characters)" if isinstance(value, str) and len(value) > width else "")


def clipped(text: object, width: int = 120) -> str:
    """A name from a file (an entry, a key) as printable text of at most ``width`` characters, then its
    length when cut (`` ... (1,000,000 characters)``): a listing shows the name, never a megabyte of it."""
    text = str(text)
    if len(text) <= width:
        return printable(text)
    return printable(text[:width]) + f"... ({len(text):,} characters)"


def describe_kwargs(kwargs: dict) -> str:
    """``key=value, ...`` for messages and descriptions, each value a bounded repr."""
    return ", ".join(f"{shorten(printable(key), 80)}={shown(value, 200)}" for key, value in kwargs.items())


def counted(number: int, noun: str) -> str:
    """``1 tensor``, ``2 tensors``, ``10 batches``: a count with its noun in the right number."""
    if number == 1:
        return f"{number} {noun}"
    return f"{number} {noun}{'es' if noun.endswith(('s', 'x', 'z', 'ch', 'sh')) else 's'}"


def shorten(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, ending in ``...`` when cut."""
    if len(text) <= width:
        return text
    if width <= len(ELLIPSIS):
        return text[:width]
    return text[: width - len(ELLIPSIS)].rstrip() + ELLIPSIS


def _natural_widths(headers: list[str], rows: list[list[str]]) -> list[int]:
    return [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]


def fit_table(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int, *, header: bool = True
) -> tuple[list[int], list[int], list[str]]:
    """Which columns to keep, their widths, and their headers, so that a line fits ``width``."""
    keep = list(range(len(columns)))
    headers = [c.header for c in columns]
    cells = [[printable(v) for v in row] for row in rows]

    def widths_of(indices: list[int]) -> list[int]:
        shown_headers = [headers[i] if header else "" for i in indices]
        return _natural_widths(shown_headers, [[row[i] for i in indices] for row in cells])

    def total(ws: list[int]) -> int:
        return len(INDENT) + sum(ws) + len(GAP) * (len(ws) - 1)

    if total(widths_of(keep)) > width:  # abbreviate long headers before touching any cell
        headers = [c.short_header or c.header for c in columns]

    def shrunk(indices: list[int]) -> list[int]:
        """Natural widths, free-text columns shortened (widest first) towards their minimum."""
        ws = widths_of(indices)
        while total(ws) > width:
            floors = {k: max(columns[i].min_width, len(headers[i]) if header else 0) for k, i in enumerate(indices)}
            candidates = [(ws[k], k) for k, i in enumerate(indices) if columns[i].shrink and ws[k] > floors[k]]
            if not candidates:
                break
            _, k = max(candidates)
            ws[k] = max(floors[k], ws[k] - (total(ws) - width))
        return ws

    widths = shrunk(keep)
    # drop optional columns, lowest priority (highest number) first
    while total(widths) > width:
        optional = [(columns[i].priority, k) for k, i in enumerate(keep) if columns[i].priority > 0]
        if not optional:
            break
        del keep[max(optional)[1]]
        widths = shrunk(keep)
    # last resort (very narrow widths): shorten whatever is widest
    while total(widths) > width and max(widths) > len(ELLIPSIS) + 1:
        k = widths.index(max(widths))
        widths[k] = max(len(ELLIPSIS) + 1, widths[k] - (total(widths) - width))
    return keep, widths, [headers[i] for i in keep]


def format_row(cells: Sequence[str], widths: Sequence[int], aligns: Sequence[str]) -> str:
    parts = []
    for text, cell_width, align in zip(cells, widths, aligns, strict=True):
        text = shorten(str(text), cell_width)
        parts.append(text.rjust(cell_width) if align == "right" else text.ljust(cell_width))
    return (INDENT + GAP.join(parts)).rstrip()


def table_lines(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int, *, header: bool = True
) -> list[str]:
    """The table as lines of at most ``width`` characters."""
    rows = [[printable(v) for v in row] for row in rows]  # escapes are measured and shortened like any text
    keep, widths, headers = fit_table(columns, rows, width, header=header)
    aligns = [columns[i].align for i in keep]
    lines = [format_row(headers, widths, aligns)] if header else []
    lines += [format_row([row[i] for i in keep], widths, aligns) for row in rows]
    return lines


def wrap(text: str, width: int, indent: str = "  ") -> list[str]:
    """Prose (summaries, notes) wrapped at word boundaries, continuation lines indented."""
    return textwrap.wrap(
        printable(text), width=max(width, 20), subsequent_indent=indent, break_on_hyphens=False, break_long_words=True
    ) or [""]
