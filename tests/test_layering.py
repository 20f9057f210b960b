"""The house's import rules: the core never imports torch, simpy, sim/ or backends/ (tinypipe/cli/ lazily)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("torch", "simpy", "tinypipe.sim", "tinypipe.backends", "transformers", "safetensors")


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at_top_level) for every import in a file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, id(node) in top))
    return out


def test_core_never_imports_heavy_or_outer_packages() -> None:
    """No module of tinypipe/ imports torch, simpy, sim/ or backends/; tinypipe/cli/ may, inside functions only."""
    bad = []
    for path in sorted((ROOT / "tinypipe").rglob("*.py")):
        for mod, at_top in _imports(path):
            if mod.split(".")[0] in ("torch", "simpy", "transformers", "safetensors") or mod.startswith(FORBIDDEN):
                if path.parent.name == "cli" and not at_top:
                    continue
                bad.append(f"{path.relative_to(ROOT)}: {mod}")
    assert bad == []


def test_sim_never_imports_backends() -> None:
    """The simulator does not depend on the real backend (and so not on torch)."""
    bad = [f"{p.name}: {m}" for p in sorted((ROOT / "sim").rglob("*.py")) for m, _ in _imports(p)
           if m.startswith(("tinypipe.backends", "torch"))]
    assert bad == []


BLOCKER = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'simpy', 'transformers', 'safetensors'):
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, _Block())
"""


def test_core_imports_and_inspects_without_torch_or_simpy() -> None:
    """With torch and simpy unimportable, the core imports and `inspect model/hardware/schedule` work."""
    code = BLOCKER + """
import tinypipe.describe.model, tinypipe.describe.hardware, tinypipe.describe.trace, tinypipe.ir.schedule
import tinypipe.compiler, tinypipe.compiler.validate, tinypipe.policy
import tinypipe.estimate.hostmem, tinypipe.cli.inspect_tables, tinypipe.ir.timeline
from tinypipe.cli import main
assert main(['inspect', 'model', 'llama-3.1-8b']) == 0
assert main(['inspect', 'hardware', 'h200x2']) == 0
assert main(['inspect', 'schedule', '--model', 'tiny-llama', '--hardware', 'h200x2']) == 0
assert 'torch' not in sys.modules and 'simpy' not in sys.modules
print('OK')
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("OK")


def test_run_without_torch_is_a_one_line_error() -> None:
    """`tinypipe run` without torch says how to install the extra, in one line, exit code 2."""
    code = BLOCKER + """
from tinypipe.cli import main
raise SystemExit(main(['run']))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "tinypipe[torch]" in r.stderr


def test_profile_without_torch_is_a_one_line_error() -> None:
    """`tinypipe profile` without torch says how to install the extra, in one line, exit code 2 (its
    options register without torch, so `tinypipe profile --help` works there too)."""
    code = BLOCKER + """
from tinypipe.cli import main
raise SystemExit(main(['profile', '--model', 'tiny-llama', '--out', '/nonexistent/prof']))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "tinypipe[torch]" in r.stderr


def _module(path: Path) -> str:
    """The installed name of a source file: sim/engine.py -> tinypipe.sim.engine."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("sim", "backends"):
        parts.insert(0, "tinypipe")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_files() -> list[Path]:
    return sorted(p for d in ("tinypipe", "sim", "backends") for p in (ROOT / d).rglob("*.py"))


def test_no_import_cycle() -> None:
    """The package's modules import each other without a cycle, imports inside functions included."""
    files = _package_files()
    names = {_module(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - max(0, node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                deps |= {target, *(f"{target}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in names and d != name and not name.startswith(d + ".")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> bool:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle.extend(path[path.index(d):] + [m, d] if d in path else [m, d])
                return True
            if d not in state and visit(d, path + [m]):
                return True
        state[m] = 2
        return False

    assert not any(visit(m, []) for m in sorted(graph) if m not in state), " -> ".join(cycle)


def test_no_module_over_400_lines() -> None:
    """One idea per file (the house style, ../shared/STYLE.md beside the checkout): no module of the package is
    longer than 400 lines."""
    long = {str(p.relative_to(ROOT)): n for p in _package_files() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


# The core's subpackages from the bottom up: a module imports only from its own subpackage or one below.
CORE_LAYERS = (("common",), ("policy",), ("describe",), ("ir",), ("estimate",), ("partition",), ("compiler",),
               ("search", "replay"), ("cli",))


def _core_layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "tinypipe":
        return None
    return next((i for i, names in enumerate(CORE_LAYERS) if parts[1] in names), None)


def test_core_imports_run_down() -> None:
    """Every import between the core's subpackages goes to the same layer or a lower one (data below solvers:
    docs/architecture.md's picture); every core module lives in one of the layers."""
    up, homeless = [], []
    for path in sorted((ROOT / "tinypipe").rglob("*.py")):
        name = _module(path)
        if name in ("tinypipe", "tinypipe.traces") or name.startswith("tinypipe.traces."):
            continue
        own = _core_layer(name)
        if own is None:
            homeless.append(name)
            continue
        for mod, _ in _imports(path):
            target = _core_layer(mod)
            if target is not None and target > own:
                up.append(f"{name} -> {mod}")
    assert homeless == [] and up == []


def test_the_architecture_picture_is_the_code() -> None:
    """docs/architecture.md's picture lists the core's layers in CORE_LAYERS' order, and names every module
    of the core, the simulator and the backend."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = {int(m[1]): m[2] for m in re.finditer(r"^ {4}(\d) {2}(.*)$", text, flags=re.M)}
    assert sorted(rows) == list(range(1, len(CORE_LAYERS) + 1))
    for i, names in enumerate(CORE_LAYERS, start=1):
        assert all(re.search(rf"\b{n}\b", rows[i]) for n in names), (i, names, rows[i])
    missing = sorted(p.stem for p in _package_files() if p.stem not in ("__init__", "__main__") and p.stem not in text)
    assert missing == []


# The backend's rooms from the bottom up (docs/architecture.md): a module imports its own room or one below.
BACKEND_ROOMS = ("model", "host", "save", "data", "rank", "options", "profile", "launch")


def _targets(path: Path) -> list[str]:
    """Every module `path` imports, relative imports resolved, imports inside functions included."""
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - max(0, node.level - 1)] if node.level else []
            out.append(".".join(base + ([node.module] if node.module else [])) if node.level else node.module or "")
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_backend_rooms_import_down() -> None:
    """backends/ is rooms only (no module at its top), each a package whose docstring's first line says what
    it owns; every import between rooms goes to a lower room."""
    rooms = sorted(p.name for p in (ROOT / "backends").iterdir() if (p / "__init__.py").is_file())
    assert sorted(BACKEND_ROOMS) == rooms
    assert sorted(p.name for p in (ROOT / "backends").glob("*.py")) == ["__init__.py"]
    for room in rooms:
        doc = ast.get_docstring(ast.parse((ROOT / "backends" / room / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, room
    up = []
    for room in BACKEND_ROOMS:
        for path in sorted((ROOT / "backends" / room).rglob("*.py")):
            for mod in _targets(path):
                parts = mod.split(".")
                if parts[:2] == ["tinypipe", "backends"] and len(parts) > 2 and parts[2] in BACKEND_ROOMS:
                    if BACKEND_ROOMS.index(parts[2]) > BACKEND_ROOMS.index(room):
                        up.append(f"{_module(path)} -> {mod}")
    assert up == []


def test_no_two_modules_share_a_file_name() -> None:
    """A module's file name names one module of the package: `lora.py` or `options.py` in two rooms would
    make a reader ask which one a traceback or a doc means."""
    seen: dict[str, list[str]] = {}
    for p in _package_files():
        if p.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert {n: ps for n, ps in seen.items() if len(ps) > 1} == {}


def test_no_function_over_80_lines() -> None:
    """No function or method of the package is over 80 lines from its `def` to its last line (tinypipe/cli/
    aside, whose commands read their flags in one place): a longer one is split into named steps."""
    long = []
    for path in _package_files():
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("tinypipe", "cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_the_namespace_stops_at_the_cli_and_each_shared_flag_is_declared_once() -> None:
    """No function of the core outside `tinypipe/cli/` has a parameter annotated `argparse.Namespace` or named
    `args`: the CLI reads the parsed command line into typed records (`cli/edge.py`) and passes those down. Each
    flag several commands share (`cli.flags.SHARED`) is declared with `add_argument` in exactly one place,
    `cli/flags.py`, whichever parsers (the CLI's, run's, profile's) register it."""
    from tinypipe.cli.flags import SHARED

    takes = []
    for path in sorted((ROOT / "tinypipe").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] in ("cli", "sim", "backends", "traces"):  # the CLI, and the links to sim/, backends/
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]:
                    annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                    if arg.arg == "args" or "Namespace" in annotation:
                        takes.append(f"{rel}:{node.lineno} {node.name}({arg.arg}: {annotation})")
    assert takes == []
    declared: dict[str, list[str]] = {}
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                for flag in node.args:
                    if isinstance(flag, ast.Constant) and isinstance(flag.value, str) and flag.value.startswith("--"):
                        declared.setdefault(flag.value, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert {f: declared.get(f, []) for f in SHARED if len(declared.get(f, [])) != 1} == {}
    assert {f: declared[f][0] for f in SHARED if not declared[f][0].startswith("tinypipe/cli/flags.py:")} == {}
