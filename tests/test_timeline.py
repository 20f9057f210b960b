"""Timeline: iteration times, Chrome trace export, JSON round trip, diff, PNG plot (tinypipe/ir/timeline.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tinypipe.common.errors import InputError
from tinypipe.ir.timeline import KindError, Record, Timeline, diff


def rec(i: int, res: str, kind: str, label: str, it: int, s: float, e: float,
        layer: int | None = 0, mb: int | None = None) -> Record:
    return Record(i, res, kind, label, layer, mb, it, s, e)


def sample() -> Timeline:
    return Timeline(
        records=(rec(0, "g0.h2d", "LOAD", "LD0", 0, 0.0, 0.5),
                 rec(1, "g0.compute", "FWD", "F0.0", 0, 0.5, 1.5, mb=0),
                 rec(2, "host.optim", "OPT_STEP", "OPT0", 0, 1.5, 2.0),
                 rec(3, "g0.compute", "FWD", "F0.0", 1, 2.0, 3.0, mb=0),
                 rec(4, "g0.compute", "FWD", "F0.0", 2, 3.0, 4.5, mb=0)),
        memory={"g0": ((0.0, 0), (0.5, 2**20)), "host": ((0.0, 3 * 2**20),)},
        source="sim", meta={"model": "tiny"})


def test_iteration_times_and_steady_state() -> None:
    """Iteration i ends with its last FWD/BWD (the optimizer step of iteration 0 at 2.0 s does not
    count); it lasts from the end of i-1 to its own end; steady = mean of those after the first."""
    t = sample()
    assert t.iteration_ends_s() == [1.5, 3.0, 4.5]
    assert t.iteration_times_s() == [1.5, 1.5, 1.5]
    assert t.steady_iteration_s() == 1.5
    assert (t.makespan_s, t.busy_s()["g0.compute"], t.peak_bytes()) == (4.5, 3.5, {"g0": 2**20, "host": 3 * 2**20})
    assert Timeline((rec(0, "g0.compute", "FWD", "F0.0", 0, 1.0, 3.0),)).steady_iteration_s() == 2.0


def test_chrome_trace_literal() -> None:
    """One process per device, one thread per stream, X events in µs, memory as C counters in MiB."""
    t = Timeline(records=(rec(1, "g0.compute", "FWD", "F0.0", 0, 0.5, 1.5, mb=0),
                          rec(0, "g0.h2d", "LOAD", "LD0", 0, 0.0, 0.5)),
                 memory={"g0": ((0.5, 2**21),)})
    assert t.to_chrome_trace() == {
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "g0"}},
            {"ph": "M", "name": "process_sort_index", "pid": 0, "tid": 0, "args": {"sort_index": 0}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "g0.compute"}},
            {"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": 1, "args": {"sort_index": 1}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 2, "args": {"name": "g0.h2d"}},
            {"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": 2, "args": {"sort_index": 2}},
            {"ph": "X", "name": "LD0", "cat": "LOAD", "pid": 0, "tid": 2, "ts": 0.0, "dur": 500000.0,
             "args": {"id": 0, "iteration": 0, "layer": 0}},
            {"ph": "X", "name": "F0.0", "cat": "FWD", "pid": 0, "tid": 1, "ts": 500000.0, "dur": 1000000.0,
             "args": {"id": 1, "iteration": 0, "layer": 0, "microbatch": 0}},
            {"ph": "C", "name": "memory", "pid": 0, "tid": 0, "ts": 500000.0, "args": {"MiB": 2.0}},
        ],
        "displayTimeUnit": "ms",
        "otherData": {"source": "sim"},
    }


def test_json_round_trip(tmp_path: Path) -> None:
    t = sample()
    t.save(tmp_path / "t.json")
    assert Timeline.load(tmp_path / "t.json") == t
    t.save_chrome_trace(tmp_path / "trace.json")
    assert (tmp_path / "trace.json").read_text().startswith('{"traceEvents"')


def test_bad_json_names_the_field(tmp_path: Path) -> None:
    p = tmp_path / "t.json"
    p.write_text('{"format": "tinypipe.ir.timeline/1", "records": [[0, "g0.compute"]]}')
    with pytest.raises(InputError, match=r"t.json: records\[0\]: expected \[id, resource"):
        Timeline.load(p)
    p.write_text('{"format": "other"}')
    with pytest.raises(InputError, match="format: expected 'tinypipe.ir.timeline/1'"):
        Timeline.load(p)


def test_diff_per_kind_iteration_and_order() -> None:
    """a vs reference b: FWD of iteration 1 takes 1.5 s instead of 1 s; the LOAD matches; and on
    g0.compute two actions swap order in a."""
    b = sample()
    a = Timeline(records=(rec(0, "g0.h2d", "LOAD", "LD0", 0, 0.0, 0.5),
                          rec(1, "g0.compute", "FWD", "F0.0", 0, 0.5, 1.5, mb=0),
                          rec(2, "host.optim", "OPT_STEP", "OPT0", 0, 1.5, 2.0),
                          rec(3, "g0.compute", "FWD", "F0.0", 1, 4.5, 6.0, mb=0),
                          rec(4, "g0.compute", "FWD", "F0.0", 2, 3.0, 4.5, mb=0)))
    d = diff(a, b)
    assert d.per_kind == {"FWD": KindError(3, 0.5 / 3, 0.5 / 3), "LOAD": KindError(1, 0.0, 0.0),
                          "OPT_STEP": KindError(1, 0.0, 0.0)}
    assert (a.iteration_times_s(), d.iteration_s_a, d.iteration_s_b) == ([1.5, 4.5, 0.0], 2.25, 1.5)
    assert (d.iteration_rel_error, d.orders_equal, d.order_mismatches) == (0.5, False, ("g0.compute",))
    assert diff(b, b).orders_equal and diff(b, b).iteration_rel_error == 0.0
    assert "per-resource order: differs on g0.compute" in d.table()
    assert d.to_json()["order_mismatches"] == ["g0.compute"]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from tinypipe.cli.plot import plot_timeline

    out = plot_timeline(sample(), tmp_path / "t.png", title="sample")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tinypipe.cli import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(InputError, match=r"pip install tinypipe\[plot\]"):
        plot.plot_timeline(sample(), tmp_path / "t.png")


def test_core_modules_import_neither_simpy_nor_torch() -> None:
    code = ("import sys, tinypipe.ir.timeline, tinypipe.cli.plot; "
            "bad = [m for m in ('simpy', 'torch', 'matplotlib') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
