"""Reading training data into `Example`s, its format told from its content, never from its name.

Formats (each record is one of `records.py`'s kinds: text, prompt/completion, messages, ShareGPT, Alpaca):
- JSON Lines, one record per line (a file of one JSON object counts too), or a JSON array of records;
- a table, CSV or TSV (named `.csv`/`.tsv`, or lines that all hold the same number of commas or tabs): a header
  row naming at least one record field, then one record per row, every cell a string;
- Parquet (a file that starts with `PAR1`): one record per row, read with pyarrow (which the `datasets` package,
  tinypipe's `data` extra, brings);
- plain UTF-8 text: one example, loss on all of it;
- a Hugging Face dataset id (`org/name`, where no such file exists), one split of it: `hubdata.py`.

Anything else is an InputError naming the file (and line, record or row): bytes that are not UTF-8 text nor
Parquet, a table without a record field among its columns, a file named `.json`/`.jsonl`/`.ndjson` whose content
is not JSON.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from tinypipe.common.errors import InputError
from tinypipe.describe.hubcache import is_hub_id

from .records import FIELDS, RECORD_HELP, DataFile, Example, collect, record

__all__ = ["DataFile", "Example", "read_examples", "read_data", "read_source"]

JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
TABLE_SUFFIXES = (".csv", ".tsv")
PARQUET_MAGIC = b"PAR1"
DEFAULT_SPLIT = "train"  # a Hub dataset's split when none is given


def read_examples(path: str | Path) -> list[Example]:
    """The examples of a data file (see the module docstring); InputError naming the file and line."""
    return read_data(path).examples


def read_source(data: str | Path, *, split: str | None = None, config: str | None = None) -> DataFile:
    """The examples of a data file, or of split `split` (default `train`) of a Hugging Face dataset id in
    configuration `config` (`hubdata.read_hub_dataset`)."""
    text = str(data)
    if is_hub_id(text):
        from .hubdata import read_hub_dataset

        return read_hub_dataset(text, split=split or DEFAULT_SPLIT, config=config)
    if split is not None or config is not None:
        raise InputError(f"{text}: a split or configuration (--data-split, --data-config) is chosen within a Hugging "
                         "Face dataset id (org/name); a local file has neither")
    return read_data(text)


def read_data(path: str | Path) -> DataFile:
    """A data file's examples and its format (see the module docstring); InputError naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such data file" + (" (it is a directory)" if p.is_dir() else ""))
    raw = p.read_bytes()
    if raw.startswith(PARQUET_MAGIC):
        return _read_parquet(p)
    if b"\0" in raw[:65536]:
        raise InputError(f"{p}: a binary file, not text, JSON Lines or Parquet ({RECORD_HELP})")
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (as spreadsheets write CSV) is not text
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
        return _read_table(p, text, table)
    return DataFile("plain text", [Example("", text)])


def _read_json(p: Path, text: str) -> DataFile:
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None  # JSON Lines (or broken JSON: the lines say where)
    if isinstance(whole, list):
        if not whole:
            raise InputError(f"{p}: an empty JSON array: no training examples")
        return collect("a JSON array", (record(r, f"{p}: record {k}") for k, r in enumerate(whole, 1)))
    if isinstance(whole, dict):
        return collect("a JSON object", [record(whole, f"{p}:1")])
    if whole is not None:
        raise InputError(f"{p}:1: expected a JSON object, got {type(whole).__name__}")
    return collect("JSON Lines", (_parse_line(line, f"{p}:{n}") for n, line in enumerate(text.splitlines(), 1)
                                  if line.strip()))


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


def _read_table(p: Path, text: str, name: str) -> DataFile:
    """A CSV or TSV file's rows as records, by its header's column names."""
    reader = csv.DictReader(io.StringIO(text), delimiter="\t" if name == "TSV" else ",")
    columns = [c.strip() for c in reader.fieldnames or ()]
    if not set(columns) & set(FIELDS):
        raise InputError(f"{p}: looks like {name} (a table) with columns {', '.join(columns) or 'none'}, none of them "
                         f"a record field ({', '.join(FIELDS)}); {RECORD_HELP}")
    rows = []
    try:
        for row in reader:
            rows.append(record({k.strip(): v for k, v in row.items() if k is not None}, f"{p}:{reader.line_num}"))
    except csv.Error as exc:
        raise InputError(f"{p}:{reader.line_num}: not {name} ({exc})") from None
    if not rows:
        raise InputError(f"{p}: a {name} header without rows: no training examples")
    return collect(name, rows)


def _read_parquet(p: Path) -> DataFile:
    """A Parquet file's rows as records."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{p}: a Parquet file, which needs pyarrow: pip install datasets (tinypipe's [data] "
                         "extra), which brings it") from None
    try:
        rows = pq.read_table(p).to_pylist()
    except Exception as exc:  # pyarrow raises its own error kinds for a damaged file
        raise InputError(f"{p}: not a readable Parquet file ({type(exc).__name__}: {' '.join(str(exc).split())})"
                         ) from None
    if not rows:
        raise InputError(f"{p}: a Parquet file without rows: no training examples")
    return collect("Parquet", (record(r, f"{p}: row {k}") for k, r in enumerate(rows, 1)))


def _parse_line(line: str, where: str) -> tuple[str, Example]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not a JSON object ({exc.msg} at column {exc.colno}); {RECORD_HELP}") from exc
    return record(value, where)
