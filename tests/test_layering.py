"""The house's import rules: the core never imports torch, simpy, sim/ or backends/ (cli.py lazily)."""

from __future__ import annotations

import ast
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
    """No module of tinypipe/ imports torch, simpy, sim/ or backends/; cli.py may, inside functions only."""
    bad = []
    for path in sorted((ROOT / "tinypipe").rglob("*.py")):
        for mod, at_top in _imports(path):
            if mod.split(".")[0] in ("torch", "simpy", "transformers", "safetensors") or mod.startswith(FORBIDDEN):
                if path.name == "cli.py" and not at_top:
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
import tinypipe.model, tinypipe.hardware, tinypipe.trace, tinypipe.schedule, tinypipe.compile
import tinypipe.validate, tinypipe.policy, tinypipe.hostmem, tinypipe.inspection, tinypipe.timeline
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
