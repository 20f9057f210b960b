"""This machine's host memory (MemAvailable vs the cgroup limit) and GPU models, read from faked files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinypipe.cli import main
from tinypipe.describe import thismachine
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.thismachine import HostMemoryHere, gpu_models_here, host_limit_here, host_memory_here, is_here

GIB = 2**30


def _meminfo(tmp_path: Path, avail_kib: int) -> Path:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       263921344 kB\nMemFree:         1000000 kB\nMemAvailable:   {avail_kib} kB\n")
    return p


def _file(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_the_smaller_of_memavailable_and_the_cgroup_limit(tmp_path: Path) -> None:
    """MemAvailable alone; a cgroup limit below it wins and is named; `max` and v1's 2^63 mean no limit;
    nothing readable is None."""
    tmp = tmp_path
    mem = _meminfo(tmp, 100 * 2**20)  # 100 GiB in kB
    assert host_memory_here(mem, ()) == HostMemoryHere(100 * GIB, "MemAvailable")
    v2 = _file(tmp, "memory.max", f"{64 * GIB}\n")
    got = host_memory_here(mem, (v2,))
    assert got is not None and got.bytes == 64 * GIB and got.source == f"cgroup limit {v2}"
    assert host_memory_here(mem, (_file(tmp, "big", f"{200 * GIB}\n"),)).bytes == 100 * GIB  # type: ignore[union-attr]
    assert host_memory_here(mem, (_file(tmp, "max", "max\n"),)).bytes == 100 * GIB  # type: ignore[union-attr]
    v1 = _file(tmp, "limit_in_bytes", "9223372036854771712\n")
    assert host_memory_here(mem, (tmp / "missing", v1)).bytes == 100 * GIB  # type: ignore[union-attr]
    assert host_memory_here(tmp / "missing", (v2,)) == HostMemoryHere(64 * GIB, f"cgroup limit {v2}")
    assert host_memory_here(tmp / "missing", ()) is None


def test_gpu_models_and_whether_a_preset_is_here(tmp_path: Path) -> None:
    """The driver's Model lines; a preset is here when as many of its GPU model are."""
    for i, model in enumerate(("NVIDIA H200", "NVIDIA H200")):
        d = tmp_path / f"0000:0{i}:00.0"
        d.mkdir()
        (d / "information").write_text(f"Model: \t\t {model}\nIRQ:   42\n")
    assert gpu_models_here(tmp_path) == ["NVIDIA H200", "NVIDIA H200"]
    assert gpu_models_here(tmp_path / "none") == []
    h1, h2, rtx = load_hardware("h200x1"), load_hardware("h200x2"), load_hardware("rtx4090x1")
    assert is_here(h1, ["NVIDIA H200"]) and not is_here(h2, ["NVIDIA H200"]) and is_here(h2, ["NVIDIA H200"] * 2)
    assert not is_here(rtx, ["NVIDIA H200"]) and not is_here(h1, [])


def test_h200x1_is_the_one_gpu_machine() -> None:
    """The 1-GPU H200 machine: 125.8 GiB of host memory and 16 cores (not the 2-GPU host's 251.8 GiB)."""
    h = load_hardware("h200x1")
    assert (h.host.memory_bytes, h.host.cpu_cores) == (135_128_870_912, 16)


def test_the_limit_is_the_smaller_of_the_description_and_this_machine() -> None:
    hw = load_hardware("h200x1")
    assert host_limit_here(hw, None) == (hw.host.memory_bytes, "125.8 GiB (h200x1's host memory)")
    assert host_limit_here(hw, HostMemoryHere(500 * GIB, "MemAvailable"))[0] == hw.host.memory_bytes
    assert host_limit_here(hw, HostMemoryHere(90 * GIB, "MemAvailable")) == (90 * GIB, "90.0 GiB (MemAvailable)")


def test_search_for_this_machine_takes_its_host_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """With an H200 here, `search --hardware h200x1` plans for this machine's MemAvailable and says so; with
    too little of it nothing fits; `--host-mem` overrides; without the GPU here the preset's figure stands."""
    d = tmp_path / "gpus" / "0000:01:00.0"
    d.mkdir(parents=True)
    (d / "information").write_text("Model: NVIDIA H200\n")
    monkeypatch.setattr(thismachine, "NVIDIA_GPUS", tmp_path / "gpus")
    monkeypatch.setattr(thismachine, "CGROUP_LIMITS", ())
    monkeypatch.setattr(thismachine, "MEMINFO", _meminfo(tmp_path, 1024))  # 1 MiB available
    argv = ["search", "--model", "tiny-llama", "--hardware", "h200x1", "--workers", "1", "--seq-len", "512",
            "--batch-tokens", "4096", "--top", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "note: host memory limit 0.0 GiB (MemAvailable): h200x1 is this machine" in err
    assert "host memory falls short" in err or "nothing fits" in err
    assert main(argv + ["--host-mem", "1GiB"]) == 0
    assert "note: host memory limit" not in capsys.readouterr().err
    monkeypatch.setattr(thismachine, "NVIDIA_GPUS", tmp_path / "none")
    assert main(argv) == 0
    assert "note: host memory limit" not in capsys.readouterr().err
