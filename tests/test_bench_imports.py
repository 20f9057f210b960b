"""The benchmark scripts import what the package has: every `from tinypipe... import name` under bench/ names a
module and an attribute that exist (a device script that fails on its first import costs a GPU call)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports() -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) of each `from tinypipe... import name` in bench/'s Python files."""
    out = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tinypipe"):
                out += [(str(path.relative_to(ROOT)), node.lineno, node.module or "", a.name) for a in node.names]
    return out


def test_bench_scripts_import_what_the_package_has() -> None:
    found = _imports()
    assert len(found) > 50  # the scripts are there and were read
    torch = importlib.util.find_spec("torch") is not None  # the backend's modules need it
    missing = []
    for file, line, module, name in found:
        if module.startswith("tinypipe.backends") and not torch:
            continue
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{file}:{line}: from {module} import {name}")
    assert missing == []
