"""`tinypipe replay`: traces read back, records checked against the recompiled schedule, the replay's
fidelity on the committed 2x H200 traces, and one-line errors for traces of another schedule.

The replay's bound: every action starts in the replay as soon as its lane predecessor and its
dependencies have ended, and in the run never earlier, so the replayed window is never longer than
the measured one; and the measured critical path, run without its waits, is a chain the replay
must also run, so it is never shorter than measured minus those waits (tinypipe/replay/report.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from tinypipe.sim import simulate

from tinypipe.cli import main
from tinypipe.compiler import compile_schedule
from tinypipe.describe.hardware import load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.trace import trace_for
from tinypipe.policy import load_policy
from tinypipe.replay.report import ReplayReport
from tinypipe.replay.runner import add_replay_arguments, replay, settle
from tinypipe.replay.trace_match import RunTrace, issue_durations, load_run_trace

ROOT = Path(__file__).resolve().parents[1]
RESULTS, POLICIES = ROOT / "bench" / "results", ROOT / "bench" / "policies"
H200 = ["--seq-len", "2048", "--batch-tokens", "65536", "--gpu-mem", "24GiB"]
# committed trace -> policy the run used (bench/cuda_bench.py CASES); these traces predate otherData.run
COMMITTED = {"2gpu-sync-compact": "h200x2-24g-sync-compact.json", "2gpu-async": "h200x2-24g-async.json",
             "1gpu-async": "h200x1-24g-async.json", "1gpu-sync-compact": "h200x1-24g-sync-compact.json"}


# the sync runs were compiled before the head's step moved after the others (tinypipe/compiler/optimizer.py),
# the 1-GPU async one while the head's inputs were still offloaded (tinypipe/compiler/passes.py transfer_pass):
# their schedules, as the compiler of then wrote them, travel beside the traces
OLD_SCHEDULES = ("2gpu-sync-compact", "1gpu-sync-compact", "1gpu-async")


def committed(case: str) -> list[str]:
    old = ["--schedule", str(RESULTS / f"cuda_h200_{case}.schedule.txt")] if case in OLD_SCHEDULES else []
    return [str(RESULTS / f"cuda_h200_{case}.trace.json"), "--policy", str(POLICIES / COMMITTED[case]), *H200, *old]


def replay_of(argv: list[str]) -> ReplayReport:
    ap = argparse.ArgumentParser()
    add_replay_arguments(ap)
    args = ap.parse_args(argv)
    trace = load_run_trace(args.trace)
    return replay(trace, settle(trace, args), simulate=simulate, warmup=args.warmup, which=args.window)


def assert_within_bound(rep: ReplayReport, slack_s: float) -> None:
    measured, replayed = sum(rep.measured_s), sum(rep.replayed_s)
    assert measured - sum(rep.gap_s) - slack_s <= replayed <= measured + slack_s


@pytest.mark.parametrize("case", sorted(COMMITTED))
def test_committed_h200_traces_replay_within_half_a_percent(case: str) -> None:
    """With the run's own durations the steady iteration (iterations 1..3 of the first window) comes
    back within 0.5% (measured 0.05-0.23%), and every iteration within the replay's bound."""
    rep = replay_of(committed(case))
    assert rep.header["records"] == {"1gpu-sync-compact": 4832}.get(case, 1.5 * rep.header["actions"])
    assert abs(rep.replay_error) < 0.005, rep.table()
    assert_within_bound(rep, slack_s=1e-3)
    assert rep.steady(rep.predicted_s) < rep.steady(rep.measured_s)  # the profile's costs are optimistic
    top = rep.kinds[0]
    assert (top.kind, top.ratio is not None and top.ratio > 1.5) == ("OPT_STEP block", True)


def test_table_and_json_of_a_committed_trace(capsys: pytest.CaptureFixture[str]) -> None:
    """The command prints the iteration, resource, kind and gap tables; --json carries the same numbers."""
    assert main(["replay", *committed("2gpu-sync-compact")]) == 0
    out = capsys.readouterr().out
    for text in ("measured s", "replayed s", "predicted s", "steady", "per resource", "g1.recv", "host.optim",
                 "per action kind", "OPT_STEP block", "what the replay cannot explain", "LD4 i0"):
        assert text in out, text
    assert main(["replay", *committed("2gpu-sync-compact"), "--json", "--warmup", "2"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["warmup"] == 2 and js["actions"] == 4128 and js["iterations"] == 4
    assert js["steady_s"]["measured"] == pytest.approx(4.988, abs=1e-3)
    assert abs(js["replay_error"]) < 0.002


def doctored(tmp_path: Path, change: dict[int, dict[str, Any]], drop: tuple[int, ...] = ()) -> str:
    """The 2-GPU sync trace with the events of some ids changed (top-level or args fields) or dropped."""
    obj = json.loads((RESULTS / "cuda_h200_2gpu-sync-compact.trace.json").read_text())
    events = []
    for e in obj["traceEvents"]:
        rid = e.get("args", {}).get("id") if e["ph"] == "X" else None
        if rid in drop:
            continue
        for k, v in change.get(rid, {}).items():
            (e["args"] if k in ("layer", "microbatch", "iteration") else e)[k] = v
        events.append(e)
    path = tmp_path / "doctored.json"
    path.write_text(json.dumps({**obj, "traceEvents": events}))
    return str(path)


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_a_wrong_kind_is_a_one_line_error_naming_the_first_bad_id(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Record 16600 (second window) claims BWD, record 1234 another layer: the error names id 1234, exit 2."""
    opts = committed("2gpu-sync-compact")[1:]
    err = one_line_error(capsys, ["replay", doctored(tmp_path, {16600: {"cat": "BWD"}, 1234: {"layer": 7}}), *opts])
    assert ("record id 1234 is `g0.compute FWD L7 m5 (iteration 1)` but the schedule's action 1234 is "
            "`g0.compute FWD L14 m5 (iteration 1)`: layer 7 (schedule: 14); the trace is not of this schedule") in err
    err = one_line_error(capsys, ["replay", doctored(tmp_path, {16600: {"cat": "BWD"}}), *opts])
    assert "record id 16600 is `g0.h2d BWD L7 (iteration 4)` but the schedule's action 88 is `g0.h2d LOAD L7 " \
        "(iteration 4)`: kind BWD (schedule: LOAD)" in err


def test_traces_of_another_schedule_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Another microbatch count shifts the ids; the sync schedule read against the async run's trace
    has the same actions but not the same dependencies (an upload ran 3.5 s before the optimizer step
    it waits for under sync); a first window with an action missing cannot be replayed; a trace
    that does not record its policy asks for --policy."""
    sync = str(POLICIES / "h200x2-24g-sync-compact.json")
    trace = str(RESULTS / "cuda_h200_2gpu-async.trace.json")
    err = one_line_error(capsys, ["replay", trace, "--policy", sync, "--seq-len", "2048", "--batch-tokens", "32768"])
    assert "the trace is not of this schedule (2336 actions, 4 iterations" in err
    old_sync = ["--schedule", str(RESULTS / "cuda_h200_2gpu-sync-compact.schedule.txt")]
    err = one_line_error(capsys, ["replay", trace, "--policy", sync, *H200, *old_sync])
    assert "record id 1032 (`g0.h2d LOAD L0 (iteration 1)`) started 3.534 s before its dependency" in err
    err = one_line_error(capsys, ["replay", doctored(tmp_path, {}, drop=(77,)), "--policy", sync, *H200, *old_sync])
    assert "no window of the run executed all 4128 actions" in err and "first missing: action 77" in err
    err = one_line_error(capsys, ["replay", trace])
    assert "does not record its policy (only its name, 'searched-compact-async'); give --policy FILE" in err
    err = one_line_error(capsys, ["replay", str(ROOT / "README.md")])
    assert "malformed JSON" in err


def test_a_simulated_timeline_replays_exactly(tmp_path: Path) -> None:
    """A simulator timeline exported with the run record (Chrome trace and Timeline JSON alike) reads
    back with every field, and replays to the same iteration times: its durations are the model's."""
    model, hw = load_model("tiny-llama"), load_hardware("h200x1")
    policy = load_policy("tinypipe").replace(microbatch_size=2, microbatches=3)
    prof = trace_for(model, hw.gpus[0], 2, 64)
    sched = compile_schedule(policy, model, hw, prof, iterations=3)
    tl = simulate(sched, model, hw, prof).timeline
    run = {"model": "tiny-llama", "hardware": hw.to_json(), "policy": policy.to_json(), "seq_len": 64,
           "iterations": 3, "id_stride": len(sched.actions)}
    chrome, plain = tmp_path / "t.trace.json", tmp_path / "t.timeline.json"
    tl.save_chrome_trace(chrome, other_data={"run": run})
    tl.save(plain)
    back = load_run_trace(chrome)
    assert back.run == run and back.source == "sim" and back.meta["model"] == "tiny-llama"
    mine = sorted(tl.records, key=lambda r: r.id)
    assert [(r.id, r.resource, r.kind, r.layer, r.microbatch, r.iteration) for r in sorted(back.records)] == \
        [(r.id, r.resource, r.kind, r.layer, r.microbatch, r.iteration) for r in mine]
    assert max(abs(a.end_s - b.end_s) for a, b in zip(sorted(back.records), mine)) < 1e-9
    rep = replay_of([str(chrome)])
    assert rep.replayed_s == pytest.approx(rep.measured_s, abs=1e-9)
    assert rep.predicted_s == pytest.approx(rep.measured_s, abs=1e-9)
    assert load_run_trace(plain).records == tl.records
    assert back.issue == () and rep.issue_busy_s == {}
    # with the main thread's issue spans (a real run's gN.issue): the same actions; each steady iteration's
    # issue time summed per device (here: 1 ms before each g0 compute action's start)
    spans = [(r.id, r.start_s - 1e-3, r.start_s) for r in mine if r.resource == "g0.compute"]
    # and the rank's other host spans (gN.host: between windows, garbage collections), which are no actions
    host = [("between windows", mine[-1].end_s, mine[-1].end_s + 0.01), ("gc gen2", mine[0].start_s, mine[0].end_s)]
    tl.save_chrome_trace(chrome, other_data={"run": run}, issue={"g0": spans}, host={"g0": host})
    threads = {e["args"]["name"] for e in json.loads(chrome.read_text())["traceEvents"] if e["name"] == "thread_name"}
    assert {"g0.issue", "g0.host"} <= threads
    back = load_run_trace(chrome)
    assert [(r.id, r.kind) for r in sorted(back.records)] == [(r.id, r.kind) for r in mine]
    assert len(back.issue) == len(spans) and {d for d, *_ in back.issue} == {"g0"}
    rep = replay_of([str(chrome), "--warmup", "1"])
    per_iteration = sum(1 for r in mine if r.resource == "g0.compute" and r.iteration == 1) * 1e-3
    assert rep.issue_busy_s["g0"] == pytest.approx(per_iteration, rel=1e-6)
    assert "main thread issuing the device's work" in rep.table() and rep.to_json()["issue_busy_s"]
    (tmp_path / "p.json").write_text(policy.dumps())
    rep = replay_of([str(plain), "--policy", str(tmp_path / "p.json"), "--seq-len", "64"])  # names only: flags
    assert rep.replayed_s == pytest.approx(rep.measured_s, abs=1e-9)


def test_window_picks_which_whole_window_to_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run of two windows (a simulated one, repeated three steps on: ids, iterations and times shifted, the
    second twice as slow): `--window 1` and `-1` replay the second (first step 3), the default the first;
    a window the run did not execute whole is a one-line error, exit 2."""
    model, hw = load_model("tiny-llama"), load_hardware("h200x1")
    policy = load_policy("tinypipe").replace(microbatch_size=2, microbatches=3)
    prof = trace_for(model, hw.gpus[0], 2, 64)
    sched = compile_schedule(policy, model, hw, prof, iterations=3)
    tl = simulate(sched, model, hw, prof).timeline
    stride, end = len(sched.actions), max(r.end_s for r in tl.records)
    second = [r._replace(id=r.id + 3 * stride, iteration=r.iteration + 3, start_s=end + 2 * r.start_s,
                         end_s=end + 2 * r.end_s) for r in tl.records]
    run = {"model": "tiny-llama", "hardware": hw.to_json(), "policy": policy.to_json(), "seq_len": 64,
           "iterations": 3, "id_stride": stride}
    path = tmp_path / "two.trace.json"
    type(tl)(tuple(tl.records) + tuple(second), source="sim", meta=tl.meta).save_chrome_trace(
        path, other_data={"run": run})
    first, last = replay_of([str(path)]), replay_of([str(path), "--window", "-1"])
    assert first.header["first_step"] == 0 and last.header["first_step"] == 3
    assert sum(last.measured_s) == pytest.approx(2 * sum(first.measured_s), rel=1e-6)
    assert replay_of([str(path), "--window", "1"]).measured_s == last.measured_s
    assert main(["replay", str(path), "--window", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "2 whole window(s)" in err and "window 2" in err


def test_issue_spans_give_each_action_the_loops_pass_and_its_handler() -> None:
    """`issue_durations` renumbers a CUDA run's issue spans to the window (ids from `first_id`) and gives each
    action its handler's time and the loop's pass before it: the gap since the previous issue ended, or,
    where the loop paused (a gap of IDLE_SLEEP_S or more) or nothing came before, the device's mean pass.
    A CPU run (its thread lane is the host's order already) or a trace without spans: None."""
    spans = (("g0", 10, 1.000, 1.002), ("g0", 11, 1.00204, 1.003), ("g0", 12, 1.010, 1.011),
             ("g0", 13, 1.01106, 1.012), ("g0", 99, 1.01205, 1.013))
    trace = RunTrace((), "cuda", issue=spans)
    got = issue_durations(trace, first_id=10, n=4)
    assert got is not None and sorted(got) == [0, 1, 2, 3]
    usual = (40e-6 + 60e-6 + 50e-6) / 3  # the passes of every window's spans, 99 of the next one's too
    want = {0: (usual, 2e-3), 1: (40e-6, 0.96e-3), 2: (usual, 1e-3), 3: (60e-6, 0.94e-3)}
    for aid, (pass_s, handler_s) in want.items():
        assert got[aid] == pytest.approx((pass_s, handler_s), abs=1e-9), aid
    assert issue_durations(RunTrace((), "cpu", issue=spans), 10, 4) is None
    assert issue_durations(RunTrace((), "cuda"), 10, 4) is None


def test_a_run_of_the_current_compiler_replays_without_its_schedule() -> None:
    """An eager Qwen3-1.7B run of 2026-12-01's fourth session (2 x 2048 per microbatch, sync; call 3)
    records its settings and its main thread's issue spans, and matches the schedule recompiled now:
    every record matched, and with the host's issue loop iterations 2..3 within 0.5% (-0.02% measured;
    1.8-2.1% short without the loop)."""
    rep = replay_of([str(RESULTS / "cuda_h200_1gpu-qwen3-mb2-eager-issue.trace.json"), "--warmup", "2"])
    assert rep.header["records"] == 2 * rep.header["actions"]
    assert rep.issue_busy_s and all(abs(r / m - 1) < 0.005 for r, m in zip(rep.replayed_s[2:], rep.measured_s[2:]))


def test_a_run_of_an_older_compiler_replays_with_its_schedule() -> None:
    """The 1-GPU sync run with the head's step after the others (2026-12-01, second session) was compiled
    while the head's inputs were still offloaded: with the schedule it ran (`--schedule`), every record
    matched, iterations 2..3 within 0.5%."""
    case = RESULTS / "cuda_h200_1gpu-sync-compact-compiled-defer"
    rep = replay_of([f"{case}.trace.json", "--schedule", f"{case}.schedule.txt"])
    assert rep.header["records"] == 7248 and rep.header["actions"] == 4832
    assert all(abs(r / m - 1) < 0.005 for r, m in zip(rep.replayed_s[2:], rep.measured_s[2:]))


def test_a_bad_schedule_file_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    """--schedule that cannot be read, or is for another GPU count: one line naming the file, exit 2."""
    trace = str(RESULTS / "cuda_h200_1gpu-sync-compact-compiled-defer.trace.json")
    err = one_line_error(capsys, ["replay", trace, "--schedule", "/nonexistent/s.txt"])
    assert "--schedule /nonexistent/s.txt: cannot read it" in err
    two = str(RESULTS / "cuda_h200_2gpu-sync-compact.schedule.txt")
    assert "a schedule for 2 GPU(s), but the run used 1" in one_line_error(capsys, ["replay", trace, "--schedule", two])
