"""How the CLI prints: tables that fit the terminal, and the JSON shapes of the ledger's records.

The ledger holds no customer data, and only the fields chosen one by one below are printed, so a column added to the
ledger later is not shown until someone decides it should be."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import sys
import textwrap
from collections.abc import Sequence

from export_ledger.calendar import utc_iso
from export_ledger.ledger import AttemptRecord, ExportRecord, ExportState, Restatement, Revision

#: Table width when stdout is not a terminal (a pipe, a file) and ``COLUMNS`` says nothing.
DEFAULT_WIDTH = 100
#: A column is never wrapped narrower than this (or its header's longest word, or its widest cell if narrower).
_MIN_COLUMN = 8
#: Cell words up to this long are never split across lines of a table (``completed``, ``2026-03-10``, a zone).
_WHOLE_WORD = 20
#: The narrowest a table's last column of prose may be; narrower, it goes under each row instead.
_NOTE_WIDTH = 40


# -- values ----------------------------------------------------------------------------------------------------------


def dump(items: list[dict]) -> str:
    return json.dumps(items, indent=2)


def iso(value: dt.datetime | None) -> str | None:
    return None if value is None else utc_iso(value)


def short_time(value: dt.datetime | None) -> str | None:
    # Whole seconds in tables; --json keeps full precision.
    return None if value is None else utc_iso(value.replace(microsecond=0))


def date(value: dt.date | None) -> str | None:
    return None if value is None else value.isoformat()


def printable(text: str) -> str:
    # Stored error messages come from exceptions; escape newlines and terminal control sequences before printing.
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


# -- the ledger's records as JSON ------------------------------------------------------------------------------------


def lease(record: ExportRecord) -> tuple[str | None, dt.datetime | None]:
    if record.state is ExportState.IN_PROGRESS:
        return record.lease_owner, record.lease_expires_at
    return None, None


def record_json(record: ExportRecord) -> dict:
    owner, expires = lease(record)
    return {
        "logical_key": record.logical_key,
        "export": record.export,
        "tenant": record.tenant,
        "business_date": record.business_date.isoformat(),
        "timezone": record.timezone,
        "window_start_utc": iso(record.window_start_utc),
        "window_end_utc": iso(record.window_end_utc),
        "state": record.state.value,
        "row_count": record.row_count,
        "committed_attempt": record.committed_attempt,
        "location": record.location,
        "sha256": record.sha256,
        "fencing_token": record.fencing_token,
        "lease_owner": owner,
        "lease_expires_at": iso(expires),
        "created_at": iso(record.created_at),
        "updated_at": iso(record.updated_at),
    }


def attempt_json(attempt: AttemptRecord) -> dict:
    return {
        "attempt_id": attempt.attempt_id,
        "fencing_token": attempt.fencing_token,
        "started_at": iso(attempt.started_at),
        "finished_at": iso(attempt.finished_at),
        "outcome": attempt.outcome.value,
        "error_class": attempt.error_class,
        "error_message": attempt.error_message,
    }


def request_json(request: Restatement) -> dict:
    return {
        "logical_key": request.logical_key,
        "export": request.export,
        "tenant": request.tenant,
        "business_date": request.business_date.isoformat(),
        "revision": request.revision,
        "reason": request.reason,
        "requested_by": request.requested_by,
        "requested_at": iso(request.requested_at),
    }


def revision_json(revision: Revision) -> dict:
    return {
        "logical_key": revision.logical_key,
        "revision": revision.revision,
        "sha256": revision.sha256,
        "row_count": revision.row_count,
        "supersedes_revision": revision.supersedes_revision,
        "supersedes_sha256": revision.supersedes_sha256,
        "reason": revision.reason,
        "requested_by": revision.requested_by,
        "requested_at": iso(revision.requested_at),
        "published_by": revision.published_by,
        "recorded_at": iso(revision.recorded_at),
        "location": revision.location,
    }


# -- tables ----------------------------------------------------------------------------------------------------------


def terminal_width() -> int:
    """``COLUMNS``, else the terminal's width, else :data:`DEFAULT_WIDTH` (stdout is not a terminal)."""
    with contextlib.suppress(ValueError):
        if int(os.environ.get("COLUMNS", "")) > 0:
            return int(os.environ["COLUMNS"])
    if sys.stdout.isatty():
        return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    return DEFAULT_WIDTH


def _floors(headers: Sequence[str], cells: Sequence[Sequence[str]], keep_first: bool = True
            ) -> tuple[list[int], list[int]]:  # fmt: skip
    natural = [max(len(row[i]) for row in [headers, *cells]) for i in range(len(headers))]
    # A column never splits a word of its header, nor a short word of its cells (a state, a date, a zone): those
    # wrap whole or the droppable columns go first; only long values (attempt ids, messages) are cut across lines.
    words = [
        max(_MIN_COLUMN, *(len(word) for word in header.split()),
            *(len(word) for row in cells for word in row[i].split() if len(word) <= _WHOLE_WORD))
        for i, header in enumerate(headers)
    ]  # fmt: skip
    floor = [natural[i] if i == 0 and keep_first else min(natural[i], words[i]) for i in range(len(headers))]
    return natural, floor


def _fitted(headers: Sequence[str], cells: Sequence[Sequence[str]], width: int, keep_first: bool = True) -> list[int]:
    """Column widths that fit ``width``: the widest columns give way first; the first (the logical key, which
    operators copy) never does. A table that cannot fit keeps every column at its minimum."""
    natural, floor = _floors(headers, cells, keep_first)
    widths = list(natural)
    excess = sum(widths) + 2 * (len(widths) - 1) - width
    while excess > 0:
        shrinkable = [i for i in range(len(widths)) if widths[i] > floor[i]]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1
    return widths


def _wrapped(text: str, width: int) -> list[str]:
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=True) or [""]


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    droppable: Sequence[str] = (),
    *,
    keep_first: bool = True,
    under: Sequence[Sequence[str]] = (),
) -> str:
    """A table that fits the terminal: long cells wrap onto lines of their own column, and where even wrapped
    columns cannot fit, the ``droppable`` ones go, in that order, said so below it (``--json`` is never cut). The first
    column (a logical key, which operators copy) is never wrapped unless ``keep_first`` is False. ``under``: lines to
    print under each row, after all of its own (however many its cells wrapped to)."""
    headers = list(headers)
    cells = _cells(rows)
    width, dropped = terminal_width(), []
    for name in droppable:
        if sum(_floors(headers, cells, keep_first)[1]) + 2 * (len(headers) - 1) <= width:
            break
        index = headers.index(name)
        headers.pop(index)
        cells = [row[:index] + row[index + 1 :] for row in cells]
        dropped.append(name)
    widths = _fitted(headers, cells, width, keep_first)
    lines = []
    for index, row in enumerate([list(headers), *cells]):
        parts = [_wrapped(cell, width) for cell, width in zip(row, widths, strict=True)]
        for depth in range(max(len(part) for part in parts)):
            line = (part[depth] if depth < len(part) else "" for part in parts)
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
        if index > 0 and under:
            lines.extend(under[index - 1])
    if dropped:
        note = f"({', '.join(dropped)} left out to fit {width} columns; --json or a wider terminal shows them)"
        lines.extend(textwrap.wrap(note, width))
    return "\n".join(lines)


def _cells(rows: Sequence[Sequence[object]]) -> list[list[str]]:
    """A table's cells as printed: ``-`` for nothing, control characters made visible."""
    return [["-" if value is None else printable(str(value)) for value in row] for row in rows]


def with_notes(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str, notes: Sequence[str]) -> str:
    """:func:`table` of ``rows`` with ``notes`` (prose, one per row) as a last column ``title`` where that column
    gets at least :data:`_NOTE_WIDTH` characters; in a narrower terminal each note goes under its row (after every line
    the row wrapped to), indented and wrapped to the terminal's width (a column of a few characters buried what an
    operator reads first). A note is never broken inside a word or at a hyphen (a command in it stays whole words)."""
    width = terminal_width()
    headers = list(headers)
    cells = _cells(rows)
    shown = [printable(note) for note in notes]
    widths = _fitted([*headers, title], [[*row, note] for row, note in zip(cells, shown, strict=True)], width)
    if widths[-1] >= _NOTE_WIDTH:
        return table([*headers, title], [[*row, note] for row, note in zip(rows, notes, strict=True)])
    under = [
        textwrap.wrap(note, width, initial_indent="    ", subsequent_indent="    ", break_long_words=False,
                      break_on_hyphens=False)
        for note in shown
    ]  # fmt: skip
    lines = table(headers, rows, under=under).splitlines()
    return "\n".join([lines[0], f"    {title.lower()}, under each key", *lines[1:]])


def wrapped_notes(notes: Sequence[str]) -> list[str]:
    """Notes to print among commands to paste: each a ``#`` comment to the shell, wrapped to the terminal's width
    without breaking a word or a hyphenated option."""
    width = terminal_width()
    return [
        line
        for note in notes
        for line in textwrap.wrap(note, width, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)
    ]
