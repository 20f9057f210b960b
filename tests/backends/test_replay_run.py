"""`tinypipe run --trace` then `tinypipe replay` of it: the trace describes its run, every record
matches the recompiled schedule, and the replay lands within its bound of the measurement.

Tolerance: the replay starts each action as soon as the model allows and the run never starts one
earlier, so the replayed window is at most the measured one; the measured critical path minus its
waits is a chain the replay also runs, so it is at least measured minus those waits
(tinypipe/replay/report.py). On the CPU stand-in the waits are the host thread's own time between
actions (Python dispatch, the 0.5 ms poll of gloo transfers): ~10% of a 35 ms step on the 2-core box.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tinypipe.cli import main as cli_main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
SEQ, MBS, MB, STEPS = 16, 2, 2, 6  # 6 steps: the first window (4 iterations) and half of a second


def test_run_trace_describes_the_run_and_replays_within_its_bound(tmp_path: Path,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """A 2-process CPU run of tiny-llama writes `otherData.run`; `replay` needs no option, matches all
    records of both windows (6 steps x the schedule's actions per iteration), prints its tables, and
    its steady iteration lies between measured minus the critical path's waits and measured."""
    pol = tmp_path / "policy.json"
    pol.write_text(json.dumps({"name": "test", "swap": "layer", "host_memory": "compact", "microbatch_size": MBS,
                               "resident": "none", "packing": [1, 2, 1, 2], "mapping": [0, 1, 0, 1]}))
    trace = tmp_path / "trace.json"
    before = time.time()
    code = cli_main(["run", "--gpus", "2", "--policy", str(pol), "--steps", str(STEPS), "--seq-len", str(SEQ),
                     "--batch-tokens", str(SEQ * MBS * MB), "--out", str(tmp_path / "out"), "--trace", str(trace)])
    assert code == 0, capfd.readouterr().err
    capfd.readouterr()
    other = json.loads(trace.read_text())["otherData"]
    assert before < other["origin_unix_s"] < time.time()  # the trace's zero on the wall clock
    run = other["run"]
    assert {k: run[k] for k in ("model", "seq_len", "microbatches", "microbatch_size", "gpus", "dtype", "backend",
                                "steps", "iterations")} == {
        "model": "tiny-llama", "seq_len": SEQ, "microbatches": MB, "microbatch_size": MBS, "gpus": 2,
        "dtype": "fp32", "backend": "cpu", "steps": STEPS, "iterations": 4}
    assert run["policy"]["packing"] == [1, 2, 1, 2] and run["hardware"]["name"] == "cpu-x2"
    assert run["model_config"]["model_type"] == "llama" and run["id_stride"] > 0
    assert set(run["profile"]["kinds"]) == {"embed", "block", "head"}  # what its prediction was costed with

    assert cli_main(["replay", str(trace)]) == 0
    out = capfd.readouterr().out
    for text in ("tiny-llama on cpu-x2, policy test, 2 GPU(s), cpu run", "steady", "per resource",
                 "per action kind", "what the replay cannot explain"):
        assert text in out, out
    assert cli_main(["replay", str(trace), "--json"]) == 0
    js = json.loads(capfd.readouterr().out)
    assert js["records"] == STEPS * run["id_stride"] // run["iterations"]
    assert js["first_step"] == 0 and js["actions"] == run["id_stride"]
    it = js["iteration_s"]
    measured, replayed, waits = sum(it["measured"]), sum(it["replayed"]), sum(it["critical_path_gaps"])
    assert measured - waits - 1e-6 <= replayed <= measured + 1e-6, js


def test_a_run_checkpointed_every_step_compiles_its_window_and_replays(tmp_path: Path,
                                                                       capfd: pytest.CaptureFixture[str]) -> None:
    """`--checkpoint-every 1` ends every window after one step, so the run compiles a 1-iteration schedule
    (`compiler.window_steps`) and every window runs it whole: `replay` of its trace matches every record of
    the 3 steps and replays the first window (a 4-iteration schedule left every window a prefix, and replay
    found no whole window)."""
    trace = tmp_path / "trace.json"
    code = cli_main(["run", "--gpus", "2", "--steps", "3", "--checkpoint-every", "1", "--seq-len", str(SEQ),
                     "--batch-tokens", str(SEQ * MBS * MB), "--out", str(tmp_path / "out"), "--trace", str(trace)])
    assert code == 0, capfd.readouterr().err
    capfd.readouterr()
    run = json.loads(trace.read_text())["otherData"]["run"]
    assert (run["steps"], run["iterations"]) == (3, 1)
    assert cli_main(["replay", str(trace), "--json"]) == 0
    js = json.loads(capfd.readouterr().out)
    assert (js["first_step"], js["iterations"], js["records"]) == (0, 1, 3 * run["id_stride"])
    assert len(js["iteration_s"]["measured"]) == 1
