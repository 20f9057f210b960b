"""Launch-time calibration in the core: rates into hardware and traces, the cache and its age, the CLI option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinypipe.cli import main
from tinypipe.common.errors import InputError
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.trace import trace_for
from tinypipe.estimate import hostcal
from tinypipe.estimate.hostcal import FORMAT, cache_file, calibrate, load_rates, read_cached, with_rates, write_cache

H200 = load_hardware("h200x1")


def rates(slow: float = 1.0, **change: float) -> dict[str, object]:
    """h200x1's own rates (its host optimizer `slow` times slower), as a rates.json object."""
    h = H200.host
    return {"format": FORMAT, "device": "cuda:0 (test)", "when": "now", "threads": 15, "h2d_gbps": 54.0,
            "d2h_gbps": 53.0, "bidir_gbps": 97.0, "copy_latency_s": 4e-5, "copy_bytes": 1 << 26,
            "adam_params_per_s": h.adam_params_per_s / slow,
            "replicated_params_per_s": (h.replicated_params_per_s or 1.0) / slow,
            "compact_params_per_s": (h.compact_params_per_s or 1.0) / slow, "measured_unix_s": 1000.0, **change}


def test_rates_go_into_links_and_the_host() -> None:
    hw = with_rates(H200, rates())
    assert hw.name == "h200x1-measured" and hw.host.dma_gbps == 97.0 and hw.host.memory_bytes == H200.host.memory_bytes
    assert hw.route("host", "gpu0").bottleneck_gbps == 53.0
    assert hw.host.compact_params_per_s == H200.host.compact_params_per_s


def test_a_slower_host_slows_every_optimizer_step() -> None:
    """Rates 3.8x slower than h200x1's (machine A's AdamW block step, 238.8 ms against 62.5): an OPT_STEP
    costed at the host's rate (the shipped 8B traces) and one measured in a trace (a profile's per-kind
    step) are both 3.8x as long; compute times are unchanged; the host's own rates change nothing."""
    from dataclasses import replace

    from tinypipe.describe.layershape import model_shapes
    from tinypipe.describe.optimprofile import OptimizerProfile
    from tinypipe.estimate.hostmem import optimizer_step_s

    model = load_model("llama-3.1-8b")
    block = model.layers[1]
    shipped = trace_for(model, H200.gpus[0], 4, 2048, "bf16")
    step = OptimizerProfile(params=block.params, threads=15, in_run_s={"compact": 0.0625, "replicated": 0.05})
    kinds = {**shipped.kinds, "block": replace(shipped.kinds["block"], optimizer=step)}
    mine = replace(shipped, model="mine", layers=model_shapes(model), kinds=kinds)
    hw, profiles, line = calibrate(H200, rates(3.8), (mine,))
    t = trace_for(model, hw.gpus[0], 4, 2048, "bf16", profiles=profiles)
    assert t.model == "mine" and t.kinds["block"].fwd_s == shipped.kinds["block"].fwd_s and "x3.80 compact" in line
    assert optimizer_step_s(block, "compact", hw.host, t) == pytest.approx(3.8 * 0.0625)
    plain = trace_for(model, hw.gpus[0], 4, 2048, "bf16", profiles=profiles[1:])
    assert plain.model == "llama-3.1-8b" and plain.kinds["block"].optimizer is None
    assert optimizer_step_s(block, "compact", hw.host, plain) == pytest.approx(
        3.8 * optimizer_step_s(block, "compact", H200.host, shipped))
    same_hw, same, _ = calibrate(H200, rates(), (mine,))
    assert optimizer_step_s(block, "compact", same_hw.host, same[0]) == pytest.approx(0.0625)


def test_the_cache_is_per_machine_and_ages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written under $TINYPIPE_CACHE/<fingerprint>; read back while younger than MAX_AGE_S; an older, a
    malformed or a missing file is None."""
    monkeypatch.setenv(hostcal.CACHE_ENV, str(tmp_path))
    path = cache_file("cuda", 15, "bf16")
    assert path.parent.parent == tmp_path and path.name == "rates-cuda-t15-bf16.json"
    write_cache(path, rates())
    assert read_cached(path, now_s=1000.0 + 3600) == rates()
    assert read_cached(path, now_s=1000.0 + hostcal.MAX_AGE_S + 1) is None
    path.write_text("{}")
    assert read_cached(path, now_s=1001.0) is None
    assert read_cached(tmp_path / "none.json") is None


def test_load_rates_here_or_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hostcal.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(InputError, match="--calibration here: no calibration of this machine younger than 6 h"):
        load_rates("here")
    write_cache(cache_file("cuda", 15, "bf16"), rates(measured_unix_s=__import__("time").time()))
    assert load_rates("here")["h2d_gbps"] == 54.0
    f = tmp_path / "rates.json"
    f.write_text(json.dumps(rates(2.0)))
    assert load_rates(str(tmp_path))["adam_params_per_s"] == H200.host.adam_params_per_s / 2.0
    f.write_text(json.dumps({**rates(), "h2d_gbps": -1}))
    with pytest.raises(InputError, match="h2d_gbps: expected a positive number"):
        load_rates(str(f))


def test_simulate_and_search_plan_with_a_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`simulate --calibration FILE` with a host 4x slower predicts a slower iteration of the 8B on one H200
    and says so; search takes the same option."""
    f = tmp_path / "rates.json"
    f.write_text(json.dumps(rates(4.0)))
    argv = ["simulate", "--model", "llama-3.1-8b", "--hardware", "h200x1", "--policy", "tinypipe", "--json",
            "--host-mem", "1TiB"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["results"][0]["iteration_s"]
    assert main([*argv, "--calibration", str(f)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["results"][0]["iteration_s"] > 1.2 * plain
    assert f"note: calibrated to {f}: host optimizer" in out.err
    assert main(["search", "--model", "tiny-llama", "--hardware", "h200x1", "--workers", "1", "--seq-len", "512",
                 "--batch-tokens", "4096", "--top", "2", "--calibration", str(f)]) == 0
    assert main([*argv, "--calibration", str(tmp_path / "missing.json")]) == 2


def test_the_step_beside_copies_shares_dram_max_min_fairly() -> None:
    """The compact step (26 B a parameter) beside copies: as fast as alone while both fit in DRAM's bandwidth;
    else the copies take what they need down to half of it, and the step the rest (at most its own rate)."""
    from tinypipe.estimate.hostcal import step_beside_copies

    assert step_beside_copies(1e9, 100.0, 50.0) == 1e9  # 26 + 50 <= 100 GB/s
    assert step_beside_copies(2e9, 70.0, 50.0) == pytest.approx(35e9 / 26)  # half each: 52 + 50 > 70
    assert step_beside_copies(2e9, 90.0, 30.0) == pytest.approx(52e9 / 26)  # 90 - 30 = 60 >= its own 52
    assert step_beside_copies(3e9, 90.0, 30.0) == pytest.approx(60e9 / 26)
