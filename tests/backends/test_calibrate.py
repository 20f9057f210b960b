"""`tinypipe run`'s launch-time calibration: measured now on the CPU, cached on CUDA, off on request."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from conftest import (  # noqa: E402
    fixed_cpu_hardware,
    parse_run,
    plan_run,  # noqa: E402
)

from tinypipe.backends.launch import calibrate as cal  # noqa: E402
from tinypipe.backends.launch import prepare as plan_mod  # noqa: E402
from tinypipe.backends.launch.calibrate import calibrate_run, calibration_lines  # noqa: E402
from tinypipe.describe.hardware import load_hardware  # noqa: E402
from tinypipe.estimate import hostcal  # noqa: E402
from tinypipe.estimate.hostcal import FORMAT, cache_file, read_cached, write_cache  # noqa: E402

SEQ = 16




def _rates(adam: float, when_s: float) -> dict[str, object]:
    return {"format": FORMAT, "device": "fake", "when": "then", "threads": 3, "h2d_gbps": 10.0, "d2h_gbps": 10.0,
            "bidir_gbps": 15.0, "copy_latency_s": 1e-5, "adam_params_per_s": adam, "replicated_params_per_s": adam,
            "compact_params_per_s": adam / 2, "measured_unix_s": when_s}


def test_a_cpu_run_measures_now_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--calibrate now: the plan takes the host optimizer layouts' rates measured before planning and the
    summary says so; by default the CPU backend's start-up measurement stands and is named; --calibrate off
    plans with the hardware description's rates."""
    monkeypatch.setattr(plan_mod, "cpu_hardware", lambda workers, threads: fixed_cpu_hardware(workers))
    auto = plan_run(parse_run("--out", str(tmp_path / "c")))
    assert auto.hardware == fixed_cpu_hardware(2) and auto.calibration is not None
    assert auto.calibration.startswith("at start-up (the CPU backend's own measurement): fixed numbers")
    plan = plan_run(parse_run("--out", str(tmp_path / "a"), "--calibrate", "now"))
    assert plan.calibration is not None and plan.calibration.startswith("measured now: host optimizer")
    assert plan.hardware.host.compact_params_per_s is not None
    assert calibration_lines(plan)[0].startswith("calibrated measured now: host optimizer")
    off = plan_run(parse_run("--out", str(tmp_path / "b"), "--calibrate", "off"))
    assert off.calibration is None and off.hardware == fixed_cpu_hardware(2)
    assert "--calibrate off" in calibration_lines(off)[0]


def test_cuda_reuses_a_fresh_cache_and_measures_a_stale_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on CUDA: a cached calibration younger than MAX_AGE_S is planned with and nothing is measured; an
    older one is measured again and the cache rewritten; `now` always measures."""
    import time

    monkeypatch.setenv(hostcal.CACHE_ENV, str(tmp_path))
    measured: list[int] = []

    def fake(backend: str, *, threads: int, dtype: str) -> dict[str, object]:
        measured.append(threads)
        return _rates(2e9, time.time())

    monkeypatch.setattr(cal, "measure_now", fake)
    hw = load_hardware("h200x1")
    path = cache_file("cuda", 3, "bf16")
    write_cache(path, _rates(1e9, time.time() - 60))
    planned, _, line = calibrate_run("auto", "cuda", hw, (), threads=3, dtype="bf16")
    assert measured == [] and line is not None and line.startswith(f"cached {path}")
    assert planned.host.adam_params_per_s == 1e9
    write_cache(path, _rates(1e9, time.time() - hostcal.MAX_AGE_S - 1))
    planned, _, line = calibrate_run("auto", "cuda", hw, (), threads=3, dtype="bf16")
    assert measured == [3] and line is not None and line.startswith("measured now")
    assert planned.host.adam_params_per_s == 2e9 and read_cached(path) is not None
    calibrate_run("now", "cuda", hw, (), threads=3, dtype="bf16")
    assert measured == [3, 3]
    assert calibrate_run("off", "cuda", hw, (), threads=3, dtype="bf16") == (hw, (), None)


def test_measuring_now_on_the_cpu_gives_a_rates_file() -> None:
    """What the CPU backend measures (its small budget, `CPU_BUDGET`) is a complete rates.json object."""
    r = cal.measure_now("cpu", threads=1, dtype="fp32")
    assert hostcal.check_rates(r, "now") is r and r["threads"] == 1


def test_the_summary_says_what_steps_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's summary names the host step's code: the one-pass kernel, or the torch operators and why."""
    from tinypipe.backends.host import fused_host_adamw

    plan = type("P", (), {"calibration": None})()
    monkeypatch.setattr(fused_host_adamw, "_STATE", {"why": "no C compiler (cc, gcc or $CC) on the PATH"})
    assert "torch operators" in calibration_lines(plan)[1] and "no C compiler" in calibration_lines(plan)[1]
    monkeypatch.setattr(fused_host_adamw, "_STATE", {})
    if fused_host_adamw.kernel() is not None:
        assert calibration_lines(plan)[1].endswith("the one-pass kernel (backends/host/fused_host_adamw.c)")
