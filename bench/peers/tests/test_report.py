"""The runner's outputs: the Markdown table (literal) and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path

from peers.execute import Outcome
from peers.report import row, table, write_json
from peers.runs import RUNS, Config

COMMON = {"model": "m", "layers": 2, "tokens_per_step": 65536, "seq_len": 2048, "microbatch_size": 4,
          "params": 3_668_021_248}
GIB = 2**30


def _rows() -> list[dict[str, object]]:
    ok = row(Config(RUNS["roundpipe"], 1, 24.0), ranks=1, common=COMMON, outcome=Outcome(False, 0, 60.0, []),
             records=[{"done": True, "warmup_steps": 2, "iteration_s_each": [30.0, 9.0, 4.0, 4.0],
                       "peak_gpu_bytes": [int(10.5 * GIB)], "peak_gpu_reserved_bytes": [12 * GIB],
                       "peak_host_rss_bytes": 80 * GIB, "pinned_host_bytes": 40 * GIB}])
    two = row(Config(RUNS["fsdp2"], 2, None), ranks=2, common=COMMON, outcome=Outcome(True, -15, 150.0, ["step 2"]),
              records=[{"warmup_steps": 1, "iteration_s_each": [80.0], "peak_gpu_bytes": [],
                        "peak_host_rss_bytes": GIB},
                       {"warmup_steps": 1, "iteration_s_each": [80.0], "peak_host_rss_bytes": GIB}])
    skipped = row(Config(RUNS["mobius"], 1, 24.0), ranks=1, common=COMMON, outcome=None, records=[],
                  skipped="20 s of the runner's deadline left, a run starts with at least 45 s")
    return [ok, two, skipped]


def test_table_is_literal() -> None:
    """One line per configuration; GiB and B/param from bytes; a row that did not finish says how; the
    host RSS of a multi-process run is the sum over its processes; a run with only warm-up steps says so."""
    assert table(_rows()).splitlines() == [
        "| system | mode | GPUs | cap | status | tokens/s | s/step (timed) | peak GPU GiB (reserved) | host RSS GiB "
        "| RSS B/param | pinned GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        "| roundpipe | async | 1 | 24 GiB | ok | 16,384 | 4.00 (2) | 10.5 (12.0) | 80.0 | 23.4 | 40.0 |",
        "| fsdp2 | sync | 2 | none | timeout: killed after the 150 s time limit: step 2 | - | warm-up only: 80.0 "
        "| - | 2.0 | 0.6 | - |",
        "| tinypipe (mobius) | sync | 1 | 24 GiB | skipped: 20 s of the runner's deadline left, a run starts with at "
        "least 45 s | - | - | - | - | - | - |",
    ]


def test_json_holds_every_field_and_is_rewritten_whole(tmp_path: Path) -> None:
    """The file is the payload as given, rewritten atomically (no temporary file left)."""
    out = tmp_path / "sub" / "peers.json"
    write_json(out, {"results": _rows()[:1]})
    write_json(out, {"results": _rows()})
    got = json.loads(out.read_text())["results"]
    assert [r["status"] for r in got] == ["ok", "timeout", "skipped"]
    keys = {"system", "mode", "gpus", "gpu_mem_cap_gib", "model", "params", "tokens_per_step", "tokens_per_s",
            "iteration_s_each", "peak_gpu_bytes", "peak_gpu_reserved_bytes", "peak_host_rss_bytes",
            "pinned_host_bytes", "status", "error", "device", "versions", "date"}
    assert keys <= set(got[0]) and got[0]["tokens_per_s"] == 16384.0 and got[1]["peak_host_rss_bytes"] == 2 * GIB
    assert [p.name for p in out.parent.iterdir()] == ["peers.json"]
