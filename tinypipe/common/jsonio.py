"""Reading JSON input with errors that name the file and the field (`file.json: layers[3].params: ...`)."""

from __future__ import annotations

import builtins
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError


def load_json(path: str | Path) -> Any:
    """Parse a JSON file; a missing file or malformed JSON is an InputError naming the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{p}: file not found") from None
    except IsADirectoryError:
        raise InputError(f"{p}: is a directory, expected a JSON file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: cannot read: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{p}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise InputError(f"{p}: JSON nested too deeply") from None


class Fields:
    """Typed access to one JSON object; every error names `where` (file and path) and the field.

    `Fields(obj, "hw.json")` then `.int("memory_bytes", minimum=0)`, `.obj("host")` for a nested
    object (its `where` becomes `hw.json: host`), `.list("links")` for a list of raw values.
    """

    def __init__(self, obj: Any, where: str) -> None:
        if not isinstance(obj, Mapping):
            raise InputError(f"{where}: expected a JSON object, got {_kind(obj)}")
        self.obj = obj
        self.where = where

    def _at(self, key: str) -> str:
        sep = "" if self.where.endswith(":") else ": " if ":" not in self.where else "."
        return f"{self.where}{sep}{key}"

    def only(self, *known: str) -> Fields:
        """InputError on a field that is not one of `known` (names starting with `_` are comments)."""
        extra = sorted(k for k in self.obj if k not in known and not str(k).startswith("_"))
        if extra:
            raise InputError(f"{self.where}: unknown field {str(extra[0])!r} (known: {', '.join(known)})")
        return self

    def has(self, key: str) -> bool:
        return key in self.obj and self.obj[key] is not None

    def raw(self, key: str, default: Any = ..., /) -> Any:
        if key not in self.obj or self.obj[key] is None:
            if default is ...:
                raise InputError(f"{self._at(key)}: missing required field")
            return default
        return self.obj[key]

    def int(self, key: builtins.str, default: Any = ..., *, minimum: builtins.int | None = None) -> builtins.int:
        v = self.raw(key, default)
        if v is default and default is not ...:
            return v  # type: ignore[no-any-return]
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer() and math.isfinite(v):
                v = int(v)
            else:
                raise InputError(f"{self._at(key)}: expected an integer, got {_kind(v)}")
        if minimum is not None and v < minimum:
            raise InputError(f"{self._at(key)}: must be >= {minimum}, got {v}")
        return v

    def float(self, key: builtins.str, default: Any = ..., *, minimum: builtins.float | None = None,
              positive: builtins.bool = False) -> builtins.float:
        v = self.raw(key, default)
        if v is default and default is not ...:
            return v  # type: ignore[no-any-return]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InputError(f"{self._at(key)}: expected a number, got {_kind(v)}")
        try:
            v = float(v)
        except OverflowError:
            raise InputError(f"{self._at(key)}: number too large") from None
        if not math.isfinite(v):
            raise InputError(f"{self._at(key)}: must be finite, got {v}")
        if positive and v <= 0:
            raise InputError(f"{self._at(key)}: must be > 0, got {v}")
        if minimum is not None and v < minimum:
            raise InputError(f"{self._at(key)}: must be >= {minimum}, got {v}")
        return v

    def str(self, key: builtins.str, default: Any = ..., *,
            choices: tuple[builtins.str, ...] | None = None) -> builtins.str:
        v = self.raw(key, default)
        if v is default and default is not ...:
            return v  # type: ignore[no-any-return]
        if not isinstance(v, str):
            raise InputError(f"{self._at(key)}: expected a string, got {_kind(v)}")
        if choices is not None and v not in choices:
            raise InputError(f"{self._at(key)}: must be one of {', '.join(choices)}; got {v!r}")
        return v

    def bool(self, key: builtins.str, default: Any = ...) -> builtins.bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise InputError(f"{self._at(key)}: expected true or false, got {_kind(v)}")
        return v

    def obj_(self, key: builtins.str, default: Any = ...) -> Fields:
        v = self.raw(key, default)
        return Fields(v, self._at(key))

    def list(self, key: builtins.str, default: Any = ..., *, nonempty: builtins.bool = False) -> builtins.list[Any]:
        v = self.raw(key, default)
        if not isinstance(v, list):
            raise InputError(f"{self._at(key)}: expected a list, got {_kind(v)}")
        if nonempty and not v:
            raise InputError(f"{self._at(key)}: must not be empty")
        return v

    def items(self, key: builtins.str, *, nonempty: builtins.bool = False) -> builtins.list[Fields]:
        """A list of JSON objects, each wrapped as Fields named `key[i]`."""
        return [Fields(x, f"{self._at(key)}[{i}]") for i, x in enumerate(self.list(key, nonempty=nonempty))]


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return f"the number {v!r}"
    if isinstance(v, str):
        return f"the string {v[:40]!r}"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, Mapping):
        return "an object"
    return type(v).__name__
