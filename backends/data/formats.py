"""Reading a training-data file into `Example`s, its format told from its content, never from its name.

Formats:
- JSON Lines, one record per line (a file of one JSON object counts too), each record one of
  `{"text": ...}` (loss on all of it), `{"prompt": ..., "completion": ...}` (loss on the completion)
  or `{"messages": [{"role": ..., "content": ...}, ...]}` (rendered with the tokenizer's chat
  template, loss on the assistant turns only);
- plain UTF-8 text: one example, loss on all of it.

Anything else is an InputError naming the file (and line): bytes that are not UTF-8 text, a JSON
document that is not records (`[...]`), CSV or TSV (a `.csv`/`.tsv` name, or lines that all hold the
same number of commas or tabs), a file named `.json`/`.jsonl`/`.ndjson` whose content is not JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError

JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
TABLE_SUFFIXES = (".csv", ".tsv")
ROLES = ("system", "user", "assistant", "tool")
RECORD_HELP = ('each line is one {"text": ...}, {"prompt": ..., "completion": ...} or '
               '{"messages": [{"role": ..., "content": ...}, ...]}')


@dataclass(frozen=True)
class DataFile:
    """A data file read: its format in words (`JSON Lines (prompt/completion)`, `plain text`) and its examples."""

    format: str
    examples: list[Example]


@dataclass(frozen=True)
class Example:
    """One training example: loss on `completion` only (a plain text has no prompt); or, with
    `messages` ((role, content) pairs), a conversation with loss on the assistant turns."""

    prompt: str
    completion: str
    messages: tuple[tuple[str, str], ...] | None = None


def read_examples(path: str | Path) -> list[Example]:
    """The examples of a data file (see the module docstring); InputError naming the file and line."""
    return read_data(path).examples


def read_data(path: str | Path) -> DataFile:
    """A data file's examples and its format (see the module docstring); InputError naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such data file" + (" (it is a directory)" if p.is_dir() else ""))
    raw = p.read_bytes()
    if b"\0" in raw[:65536]:
        raise InputError(f"{p}: a binary file, not text or JSON Lines ({RECORD_HELP})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise InputError(f"{p}:{line}: not UTF-8 text (byte {exc.start})") from exc
    if not text.strip():
        raise InputError(f"{p}: empty file: no training examples")
    if text.lstrip()[0] in "{[":
        return _read_json(p, text)
    if p.suffix.lower() in JSON_SUFFIXES:
        line = next(n for n, x in enumerate(text.splitlines(), 1) if x.strip())
        raise InputError(f"{p}:{line}: not a JSON object; a {p.suffix} data file is JSON Lines: {RECORD_HELP}")
    table = _table_delimiter(p, text)
    if table is not None:
        raise InputError(f"{p}: looks like {table} (a table), which tinypipe does not read; convert it to JSON Lines "
                         f"({RECORD_HELP}) or plain text")
    return DataFile("plain text", [Example("", text)])


def _read_json(p: Path, text: str) -> DataFile:
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None  # JSON Lines (or broken JSON: the lines say where)
    if isinstance(whole, list):
        raise InputError(f"{p}: a JSON array; write one record per line (JSON Lines): {RECORD_HELP}")
    if isinstance(whole, dict):
        return _records("a JSON object", [_record(whole, f"{p}:1")])
    if whole is not None:
        raise InputError(f"{p}:1: expected a JSON object, got {type(whole).__name__}")
    return _records("JSON Lines", [_parse_line(line, f"{p}:{n}") for n, line in enumerate(text.splitlines(), 1)
                                   if line.strip()])


def _records(container: str, records: list[tuple[str, Example]]) -> DataFile:
    """The examples of (kind, example) records, and the format: `JSON Lines (text)`, or with a count of each kind
    where they are mixed: `JSON Lines (390 prompt/completion, 10 text)`."""
    counts: dict[str, int] = {}
    for kind, _ in records:
        counts[kind] = counts.get(kind, 0) + 1
    kinds = next(iter(counts)) if len(counts) == 1 else ", ".join(f"{n:,} {k}" for k, n in counts.items())
    return DataFile(f"{container} ({kinds})", [ex for _, ex in records])


def _table_delimiter(p: Path, text: str) -> str | None:
    """'CSV' or 'TSV' when the file is a table: so named, or its first lines (3 or more) all hold the
    same number of commas (tabs), at least one."""
    if p.suffix.lower() in TABLE_SUFFIXES:
        return p.suffix[1:].upper()
    lines = [x for x in text.splitlines() if x.strip()][:20]
    for sep, name in (("\t", "TSV"), (",", "CSV")):
        counts = {x.count(sep) for x in lines}
        if len(lines) >= 3 and len(counts) == 1 and counts.pop() >= 1:
            return name
    return None


def _parse_line(line: str, where: str) -> tuple[str, Example]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not a JSON object ({exc.msg} at column {exc.colno}); {RECORD_HELP}") from exc
    return _record(record, where)


def _record(record: Any, where: str) -> tuple[str, Example]:
    """A record's kind (`text`, `prompt/completion`, `messages`) and its example."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    kinds = [k for k in ("text", "messages") if k in record] + (["prompt/completion"] if "prompt" in record
                                                                 or "completion" in record else [])
    if len(kinds) > 1:
        raise InputError(f"{where}: give one of \"text\", \"prompt\" and \"completion\", or \"messages\", not "
                         f"{' and '.join(kinds)}")
    if "text" in record:
        return "text", Example("", _string(record, "text", where))
    if "messages" in record:
        return "messages", Example("", "", _messages(record["messages"], where))
    if "prompt" in record and "completion" in record:
        return "prompt/completion", Example(_string(record, "prompt", where), _string(record, "completion", where))
    found = ", ".join(sorted(map(str, record))) or "none"
    raise InputError(f"{where}: needs a \"text\" field, \"prompt\" and \"completion\" fields, or \"messages\" "
                     f"(found: {found})")


def _messages(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}}")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"{where}: message {k + 1} must be an object with string \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise InputError(f"{where}: message {k + 1} has role {m['role']!r}; roles are {', '.join(ROLES)}")
        out.append((m["role"], m["content"]))
    if not any(role == "assistant" for role, _ in out):
        raise InputError(f"{where}: no \"assistant\" message: the loss falls on assistant turns only")
    return tuple(out)


def _string(record: dict[str, Any], key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise InputError(f"{where}: \"{key}\" must be a string, got {type(value).__name__}")
    return value
