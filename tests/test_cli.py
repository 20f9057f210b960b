"""The command line: tables for people, --json for programs, one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from tinypipe.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name, params", [("llama-3.1-8b", "8,030,261,248"), ("llama-3.1-70b", "70,553,706,496")])
def test_inspect_model_prints_exact_counts(capsys: pytest.CaptureFixture[str], name: str, params: str) -> None:
    """`inspect model` names the exact published parameter count in its first line."""
    code, out, _ = _run(capsys, "inspect", "model", name)
    assert code == 0
    assert out.splitlines()[0].startswith(f"{name} (llama): {params} parameters")
    assert "bytes/param" in out and "Can it be trained at all?" in out


def test_inspect_model_json(capsys: pytest.CaptureFixture[str]) -> None:
    """`--json` gives the same facts as data: exact count, both layouts, fit per preset."""
    code, out, _ = _run(capsys, "inspect", "model", "llama-3.1-8b", "--json", "--hardware", "rtx4090x1")
    rep = json.loads(out)
    assert code == 0 and rep["params"] == 8_030_261_248
    assert set(rep["host"]) == {"replicated", "compact"}
    assert rep["host"]["compact"]["bytes_per_param"] < rep["host"]["replicated"]["bytes_per_param"]
    assert [f["hardware"] for f in rep["fit"]] == ["rtx4090x1"]


def test_inspect_lists(capsys: pytest.CaptureFixture[str]) -> None:
    """With no name, `inspect model` and `inspect hardware` list what is shipped."""
    code, out, _ = _run(capsys, "inspect", "model")
    assert code == 0 and "llama-3.1-70b" in out and "tiny-llama" in out
    code, out, _ = _run(capsys, "inspect", "hardware")
    assert code == 0 and "rtx4090x8-pcie4" in out and "measured" in out and "spec" in out


def test_inspect_hardware(capsys: pytest.CaptureFixture[str]) -> None:
    """`inspect hardware h200x2` shows the measured link rates and the NVLink between the GPUs."""
    code, out, _ = _run(capsys, "inspect", "hardware", "h200x2")
    assert code == 0 and "measured" in out and "nvlink" in out


@pytest.mark.parametrize("argv, fragment", [
    (["inspect", "model", "llama-9"], "unknown model 'llama-9'"),
    (["inspect", "model", "/nonexistent/config.json"], "not a file or directory"),
    (["inspect", "hardware", "dgx-a100"], "dgx-a100"),
    (["inspect", "model", "llama-3.1-8b", "--seq-len", "0"], "--seq-len: must be >= 1"),
    (["inspect", "model", "llama-3.1-8b", "--seq-len", "many"], "invalid int value"),
    (["simulate", "--policy", "fastest"], "unknown policy 'fastest'"),
    (["simulate", "--gpu-mem", "lots"], "--gpu-mem"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    """A user mistake prints exactly one line `error: ...` naming the problem, exit code 2."""
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert fragment in err


def test_malformed_model_file(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """A malformed config file is named with the problem; nothing else is printed."""
    f = tmp_path / "config.json"
    f.write_text('{"model_type": "llama", "hidden_size": -4}')
    code, _, err = _run(capsys, "inspect", "model", str(f))
    assert code == 2 and str(f) in err and err.count("\n") == 1
