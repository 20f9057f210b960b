"""README.md: its two commands come first (CI runs them), and every number of its results comes from the
result file it cites, written by the benchmark that measured it (bench/README.md), never by hand."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "bench" / "results"
GIB = 2**30
COMMANDS = ["pip install torch==2.13.0 && pip install -e '.[torch]' && tinypipe run",
            "pip install -e '.[torch,dev]' && pytest -q"]


def section(heading: str) -> str:
    """The README's text under `heading` (a Markdown heading line), up to the next heading."""
    start = README.index(f"\n{heading}\n") + len(heading) + 2
    end = README.find("\n#", start)
    return README[start:] if end < 0 else README[start:end]


def table(text: str) -> list[list[str]]:
    """The body rows of the first Markdown table in `text`, as stripped cells."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in rows[2:]]


def cites(text: str, name: str) -> Any:
    """The result file `text` cites (`bench/results/<name>`), read."""
    assert f"`bench/results/{name}`" in text, f"the section does not cite bench/results/{name}"
    path = RESULTS / name
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in path.read_text().splitlines()]
    return json.loads(path.read_text())


def test_the_readme_starts_with_the_two_commands_ci_runs() -> None:
    """The first lines are the install-and-run command and the test command, in a bash block, and
    .ci/run runs exactly those two lines."""
    assert README.startswith("# tinypipe\n\n```bash\n" + "\n".join(COMMANDS) + "\n```\n")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert [c for c in ci if c in COMMANDS] == COMMANDS


def test_the_default_jobs_numbers_are_what_the_command_printed() -> None:
    """Loss, accuracy, tokens/s, wall time, machine and date of the default job's paragraph equal
    bench/results/default_run.json, which `python -m bench cpu` writes from `tinypipe run`'s output."""
    text = README[:README.index("\n## ")]
    r = cites(text, "default_run.json")
    m = re.search(r"On a (\d+)-core ([\w ]+) VM \((\d{4}-\d\d-\d\d)\): loss ([\d.]+) -> ([\d.]+), held-out\s+addition "
                  r"accuracy ([\d.]+)% -> ([\d.]+)%, ([\d,]+) tokens/s, (\d+) s wall", text)
    assert m is not None
    assert (int(m[1]), m[2], m[3]) == (r["machine"]["cpus"], r["cpu"], r["machine"]["date"][:10])
    assert (float(m[4]), float(m[5])) == (round(r["loss_first"], 2), round(r["loss_last"], 2))
    assert (float(m[6]), float(m[7])) == (r["accuracy_before_pct"], r["accuracy_after_pct"])
    assert int(m[8].replace(",", "")) == r["steady_tokens_per_s"] and int(m[9]) == round(r["wall_s"])
    assert f"loss      {r['loss_first']:.4f}" in r["summary"] and f"{r['loss_last']:.4f}" in r["summary"]


PEER_RUNS = {("tinypipe, searched policy", "sync"): "tinypipe",
             ("tinypipe, searched policy", "async"): "tinypipe-async",
             "RoundPipe": "roundpipe", "DeepSpeed": "deepspeed"}


def peer_run(system: str, optimizer: str) -> str:
    return PEER_RUNS.get((system, optimizer)) or next(v for k, v in PEER_RUNS.items()
                                                       if isinstance(k, str) and system.startswith(k))


def test_speed_beside_the_peers_is_the_peers_json() -> None:
    """Every row of the speed table: tokens/s and the ratio to RoundPipe from bench/results/peers_h200.json
    (`bash bench/device/peers.sh`), whose runs are all of the date the section gives."""
    text = section("### Speed beside the peers")
    runs = {r["run"]: r for r in cites(text, "peers_h200.json")["results"]}
    assert {r["date"][:10] for r in runs.values()} == {re.search(r"\((\d{4}-\d\d-\d\d)\)", text)[1]}  # type: ignore[index]
    rows = table(text)
    assert len(rows) == 4
    for system, optimizer, tokens, ratio in rows:
        r = runs[peer_run(system, optimizer)]
        assert tokens == f"{round(r['tokens_per_s']):,}", system
        assert ratio == f"{r['tokens_per_s'] / runs['roundpipe']['tokens_per_s']:.2f}x", system
        assert r["status"] in ("ok", "timeout") and r["gpu_mem_cap_gib"] == 24.0 and r["mode"] in optimizer


def test_memory_is_the_peers_json() -> None:
    """Every row of the memory table: host RSS per parameter, pinned host bytes and peak GPU bytes
    (allocated and reserved) of the same runs."""
    text = section("### Memory")
    runs = {r["run"]: r for r in cites(text, "peers_h200.json")["results"]}
    rows = table(text)
    assert len(rows) == 4
    for system, optimizer, rss, pinned, gpu in rows:
        r = runs[peer_run(system, optimizer)]
        assert rss == f"{r['host_rss_bytes_per_param']:.1f} B/param", system
        assert pinned == f"{r['pinned_host_bytes'] / GIB:.1f} GiB", system
        assert gpu == f"{r['peak_gpu_bytes'] / GIB:.1f} GiB ({r['peak_gpu_reserved_bytes'] / GIB:.1f})", system


def test_prediction_error_is_the_fidelity_table() -> None:
    """Median and worst |error| of iteration time and peak GPU memory over bench/results/fidelity.jsonl
    (`python bench/fidelity.py`), its number of configurations and its dates."""
    text = section("### Prediction error")
    rows = cites(text, "fidelity.jsonl")
    assert f"over {len(rows)} configurations" in text
    assert all(d in text for d in {r["date"] for r in rows})
    got = {what: [abs(r[key]) for r in rows] for what, key in (("iteration time", "iteration_error"),
                                                               ("peak GPU memory", "peak_gpu_error"))}
    table_rows = table(text)
    assert [row[0] for row in table_rows] == list(got)
    for what, median, worst in table_rows:
        assert (median, worst) == (f"{100 * statistics.median(got[what]):.1f}%", f"{100 * max(got[what]):.1f}%")
