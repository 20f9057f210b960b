"""The workers' host-memory guard: what it reads, when it trips, and a run it stops (a checkpoint, one
`error:` line naming what was left, the floor and the RSS, exit code 2, `--resume` continuing); under
normal conditions it never trips."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch")

from conftest import (  # noqa: E402
    fixed_cpu_hardware,
    parse_run,
    plan_run,  # noqa: E402
)

from tinypipe.backends.launch import prepare as plan_mod  # noqa: E402
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.rank.rss_guard import (  # noqa: E402
    FLOOR_ENV,
    SAMPLE_ENV,
    GuardSettings,
    RssGuard,
    default_floor_bytes,
)
from tinypipe.backends.save import checkpoint  # noqa: E402
from tinypipe.cli import main  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402
from tinypipe.describe.thismachine import HostMemoryHere, host_available_now, host_total_here  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

GIB = 2**30
SEQ = 16
HUGE = "1024TiB"  # a floor over any host's memory: the guard trips at its first sample


def _write(d: Path, **files: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text)
    return d


@pytest.fixture
def fixed_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fixed CPU hardware (no start-up measurement) and the guard's settings unset."""
    monkeypatch.setattr(plan_mod, "cpu_hardware", lambda workers, threads: fixed_cpu_hardware(workers))
    monkeypatch.delenv(FLOOR_ENV, raising=False)
    monkeypatch.delenv(SAMPLE_ENV, raising=False)


def test_what_is_left_is_the_smaller_of_memavailable_and_the_cgroups_room(tmp_path: Path) -> None:
    """MemAvailable alone; a cgroup's limit less what it holds, its inactive page cache not counted (v2 and v1
    names); a cgroup whose usage cannot be read, its limit. The host's size: MemTotal or the limit."""
    mem = tmp_path / "meminfo"
    mem.write_text(f"MemTotal: {64 * 2**20} kB\nMemAvailable: {40 * 2**20} kB\n")
    assert host_available_now(mem, ()) == HostMemoryHere(40 * GIB, "MemAvailable")
    assert host_total_here(mem, ()) == 64 * GIB
    v2 = _write(tmp_path / "v2", memory_max=f"{32 * GIB}\n", memory_current=f"{30 * GIB}\n",
                memory_stat=f"anon {26 * GIB}\ninactive_file {4 * GIB}\nactive_file 0\n")
    assert host_available_now(mem, (v2 / "memory.max",)) == HostMemoryHere(6 * GIB, f"cgroup {v2} below its limit")
    assert host_total_here(mem, (v2 / "memory.max",)) == 32 * GIB
    v1 = _write(tmp_path / "v1", memory_limit_in_bytes=f"{16 * GIB}\n", memory_usage_in_bytes=f"{2 * GIB}\n",
                memory_stat="total_inactive_file 0\n")
    assert host_available_now(mem, (v1 / "memory.limit_in_bytes",)).bytes == 14 * GIB  # type: ignore[union-attr]
    blind = _write(tmp_path / "blind", memory_max=f"{8 * GIB}\n")
    limit = blind / "memory.max"
    assert host_available_now(mem, (limit,)) == HostMemoryHere(8 * GIB, f"cgroup limit {limit}")
    assert host_available_now(tmp_path / "missing", ()) is None


def test_the_floor_and_the_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """2% of the host's memory, at least 1 GiB; the environment sets the floor (a size) and the period, and
    a bad value is a one-line InputError naming the variable."""
    assert default_floor_bytes(135_128_870_912) == 2_702_577_419  # the 1-GPU H200 machine: 2.52 GiB
    assert default_floor_bytes(16 * GIB) == default_floor_bytes(None) == GIB
    monkeypatch.delenv(FLOOR_ENV, raising=False)
    monkeypatch.delenv(SAMPLE_ENV, raising=False)
    assert GuardSettings.from_env() == GuardSettings(None, 0.5)
    monkeypatch.setenv(FLOOR_ENV, "2GiB")
    monkeypatch.setenv(SAMPLE_ENV, "0.1")
    assert GuardSettings.from_env() == GuardSettings(2 * GIB, 0.1)
    monkeypatch.setenv(SAMPLE_ENV, "0")
    with pytest.raises(InputError, match=f"^{SAMPLE_ENV}=0: expected a positive number of seconds$"):
        GuardSettings.from_env()
    monkeypatch.setenv(SAMPLE_ENV, "1")
    monkeypatch.setenv(FLOOR_ENV, "lots")
    with pytest.raises(InputError, match=FLOOR_ENV):
        GuardSettings.from_env()


def test_the_guard_sets_the_stop_event_under_the_floor_and_only_then() -> None:
    """Under the floor at entry: stop set before the block runs, with what was left, the floor and this process's
    RSS. Above it at entry and later under it: the thread sets stop. Always above it, or a floor of 0: never."""
    stop = threading.Event()
    with RssGuard(stop, GuardSettings(GIB), rank=3, read=lambda: HostMemoryHere(GIB // 2, "MemAvailable")) as g:
        assert stop.is_set()
    low = g.tripped
    assert low is not None and (low.rank, low.available_bytes, low.source, low.floor_bytes) == (
        3, GIB // 2, "MemAvailable", GIB) and low.rss_bytes > 0
    assert low.what().startswith("host memory ran low: 0.50 GiB left (MemAvailable), under the guard's floor of "
                                 "1.00 GiB, with rank 3's worker at ")

    reads: list[int] = []
    later = threading.Event()

    def falling() -> HostMemoryHere:
        reads.append(1)
        if len(reads) > 1:
            later.wait(10)
        return HostMemoryHere(2 * GIB if len(reads) == 1 else GIB // 2, "MemAvailable")

    stop = threading.Event()
    with RssGuard(stop, GuardSettings(GIB, sample_s=0.001), read=falling) as g:
        assert not stop.is_set()  # the entry sample was above the floor; the thread waits in its next read
        later.set()
        assert stop.wait(10)
    assert g.tripped is not None and g.tripped.available_bytes == GIB // 2

    for floor, left in ((GIB, 2 * GIB), (0, 0)):
        stop = threading.Event()
        with RssGuard(stop, GuardSettings(floor, sample_s=0.001), read=lambda n=left: HostMemoryHere(n, "x")) as g:
            pass
        assert not stop.is_set() and g.tripped is None


def test_a_run_stopped_by_the_guard_checkpoints_says_so_and_resumes(tmp_path: Path, fixed_cpu: None,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`tinypipe run` on one CPU worker with the floor over what the host has: the guard trips at once, the
    worker stops at its first window's end as Ctrl-C stops it, writes a checkpoint and no model, and the
    command exits 2 with one `error:` line (what was left, the floor, the RSS, `--resume --out DIR`).
    `--resume --out DIR` with the default floor continues to the end and saves the model."""
    out = tmp_path / "out"
    monkeypatch.setenv(FLOOR_ENV, HUGE)
    argv = ["run", "--gpus", "1", "--steps", "4", "--checkpoint-every", "2", "--seq-len", str(SEQ),
            "--batch-tokens", str(4 * SEQ), "--out", str(out)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, captured.err
    assert errors[0].startswith("error: host memory ran low: ") and "under the guard's floor of 1,048,576.00 GiB" in \
        errors[0] and "rank 0's worker at" in errors[0]
    assert errors[0].endswith(f"with a checkpoint at step 2: free host memory (or take a policy with a smaller host "
                              f"peak), then continue with --resume --out {out}")
    assert f"stopped   after step 2; checkpoint in {out}; continue with --resume --out {out}" in captured.out
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == 2
    assert not (out / "step-2").exists() and not list(out.glob("*.safetensors*"))  # no model at the stop
    monkeypatch.delenv(FLOOR_ENV)
    assert main(["run", "--resume", "--out", str(out)]) == 0
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == 4
    assert (out / "model.safetensors.index.json").exists()


def test_ranks_stop_together_when_any_guard_trips(tmp_path: Path, fixed_cpu: None) -> None:
    """Two ranks (threads): under the floor both stop after the first window with one checkpoint and no model at
    the stop; under normal conditions (the default floor) neither guard trips and the run ends."""
    out = tmp_path / "out"
    plan = plan_run(parse_run("--gpus", "2", "--out", str(out), "--checkpoint-every", "2",
                                   "--steps", "4", seq_len=SEQ))
    job = dataclasses.replace(plan.job, progress=False)
    low = run_threads(dataclasses.replace(job, rss_guard=GuardSettings(1 << 50)), 2)
    assert all(r.interrupted for r in low) and all(r.low_memory is not None for r in low)
    assert checkpoint.find(out) == out / checkpoint.DIR
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == 2
    assert not (out / "step-2").exists()
    fine = run_threads(dataclasses.replace(job, out=str(tmp_path / "fine")), 2)
    assert not any(r.interrupted for r in fine) and all(r.low_memory is None for r in fine)
    assert sorted({k for r in fine for k in r.losses}) == [0, 1, 2, 3]
