"""The runner's orchestration with stand-in peers (small Python programs writing records the way the real
ones do): one that succeeds, one that fails, one that outlives its time limit; what each row says."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

from peers.execute import execute
from peers.report import read_records, row
from peers.runs import RUNS, Config

BENCH = Path(__file__).resolve().parents[2]  # bench/
COMMON = {"model": "m", "layers": 2, "tokens_per_step": 1000, "seq_len": 100, "microbatch_size": 1, "params": 500}
CFG = Config(RUNS["fsdp2"], 1, 24.0)


def _peer(tmp_path: Path, body: str) -> list[str]:
    """A stand-in peer: a record (rank 0, 1 warm-up step of 3) through peers.measure.Recorder, then `body`."""
    script = tmp_path / "peer.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time, subprocess
        from peers.measure import Recorder
        rec = Recorder(sys.argv[1], 0, steps=3, warmup_steps=1, params=500, peak_gpu_bytes=[7],
                       peak_gpu_reserved_bytes=[9], device="stand-in")
        """) + textwrap.dedent(body))
    return [sys.executable, str(script), str(tmp_path / "cfg")]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(BENCH)}


def test_a_peer_that_succeeds_is_ok_with_its_steps(tmp_path: Path) -> None:
    """Exit 0 with a complete record: ok; tokens/s from the steps after warm-up only; memory from the record."""
    argv = _peer(tmp_path, """
        for s in (5.0, 2.0, 2.0):
            rec.step(s, 1.5)
        rec.set(peak_host_rss_bytes=1000, pinned_host_bytes=None, done=True)
        """)
    outcome = execute(argv, _env(), timeout_s=30, log=tmp_path / "log")
    r = row(CFG, records=read_records(tmp_path / "cfg", 1), ranks=1, outcome=outcome, common=COMMON)
    assert (r["status"], r["error"], r["returncode"]) == ("ok", None, 0)
    assert (r["iteration_s_each"], r["iteration_s"], r["tokens_per_s"], r["timed_steps"]) == ([5.0, 2.0, 2.0], 2.0,
                                                                                             500.0, 2)
    assert (r["peak_gpu_bytes"], r["peak_gpu_reserved_bytes"], r["peak_host_rss_bytes"], r["host_rss_bytes_per_param"],
            r["pinned_host_bytes"]) == (7, 9, 1000, 2.0, None)


def test_a_peer_that_fails_is_recorded_with_its_exit_code_and_last_lines(tmp_path: Path) -> None:
    """A non-zero exit: failed, with the exit code and the log's last lines (the error itself)."""
    argv = _peer(tmp_path, """
        rec.step(5.0, 1.5)
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB", file=sys.stderr)
        sys.exit(3)
        """)
    outcome = execute(argv, _env(), timeout_s=30, log=tmp_path / "log")
    r = row(CFG, records=read_records(tmp_path / "cfg", 1), ranks=1, outcome=outcome, common=COMMON)
    assert (r["status"], r["returncode"], r["tokens_per_s"]) == ("failed", 3, None)
    assert r["error"].splitlines()[0] == "exit code 3"
    assert r["error_summary"] == "exit code 3: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB"
    assert r["iteration_s_each"] == [5.0]


def test_exit_zero_without_a_complete_record_is_a_failure(tmp_path: Path) -> None:
    """A peer that exits 0 but never marks its record done did not finish: failed, and says so."""
    outcome = execute(_peer(tmp_path, "print('bye')\n"), _env(), timeout_s=30, log=tmp_path / "log")
    r = row(CFG, records=read_records(tmp_path / "cfg", 1), ranks=1, outcome=outcome, common=COMMON)
    assert r["status"] == "failed" and r["error"].startswith("exit code 0 without a complete record")


def test_a_peer_past_its_time_limit_is_killed_with_what_it_started_and_keeps_its_steps(tmp_path: Path) -> None:
    """Past the limit the peer's whole process group is ended (its child too); the row is `timeout` and
    keeps the steps that finished: tokens/s from the one timed step."""
    child_pid = tmp_path / "child.pid"
    argv = _peer(tmp_path, f"""
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(child_pid)!r}, "w").write(str(child.pid))
        rec.step(5.0, 1.5)
        rec.step(4.0, 1.4)
        print("step 3 of 3 ...", flush=True)
        time.sleep(60)
        """)
    t0 = time.monotonic()
    outcome = execute(argv, _env(), timeout_s=2.0, log=tmp_path / "log")
    assert time.monotonic() - t0 < 15
    r = row(CFG, records=read_records(tmp_path / "cfg", 1), ranks=1, outcome=outcome, common=COMMON)
    assert (r["status"], r["iteration_s_each"], r["tokens_per_s"]) == ("timeout", [5.0, 4.0], 250.0)
    assert r["error_summary"].startswith("killed after the 2 s time limit: step 3 of 3 ...")
    pid = int(child_pid.read_text())
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), "the peer's child outlived the time limit"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_a_program_that_cannot_start_is_a_failure(tmp_path: Path) -> None:
    """A missing interpreter: failed, `could not be started`, the reason in the log."""
    outcome = execute([str(tmp_path / "no-python")], _env(), timeout_s=5, log=tmp_path / "log")
    r = row(CFG, records=[], ranks=1, outcome=outcome, common=COMMON)
    assert r["status"] == "failed" and r["error_summary"].startswith("could not be started: could not start")
