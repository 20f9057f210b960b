"""`tinypipe.train`: the README's example runs as written; the keywords are `run`'s flags, read by `run`'s parser
(an unknown one a TypeError, a bad value the command's one-line error); the callback hears every line of
metrics.jsonl and stops the run as Ctrl-C does; the result holds the report's numbers; W&B gets the same
scalars as metrics.jsonl."""

from __future__ import annotations

import importlib.machinery
import json
import re
import shlex
import sys
import types
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import tinypipe  # noqa: E402
from tinypipe.backends.rank.stepfeed import LocalFeed, spawned_feed  # noqa: E402
from tinypipe.backends.save import checkpoint  # noqa: E402
from tinypipe.cli import main as cli_main  # noqa: E402
from tinypipe.cli.python_api import parse_options  # noqa: E402
from tinypipe.common.errors import InputError, StopTraining  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
SMALL = {"gpus": 1, "seq_len": 16, "batch_tokens": 64, "lr": 1e-2, "checkpoint_minutes": 0}  # one CPU rank, here


def lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_readme_python_example_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """README.md's Python block, verbatim, in a fresh directory: the embedded job on 2 spawned workers, whose
    rank 0 sends its metrics back to the callback; the result holds every line of metrics.jsonl and stops
    early exactly when the callback saw a loss at or under its threshold in time to stop."""
    block = README.split("```python\n", 1)[1].split("```", 1)[0]
    threshold = float(re.search(r'm\["loss"\] > ([\d.]+)', block)[1])  # type: ignore[index]
    steps = int(re.search(r"steps=(\d+)", block)[1])  # type: ignore[index]
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the README's code, as a reader runs it
    result = scope["result"]
    out = tmp_path / result.out
    assert list(result.metrics) == lines(out) and [m["step"] for m in result.metrics] == list(range(1, result.step + 1))
    assert result.tokens_per_s > 0 and result.accuracy_before is not None and set(result.peak_device_bytes) == {0, 1}
    low = [m["step"] for m in result.metrics if m["loss"] <= threshold]
    if result.stopped:  # the first low line stops the run at the end of a window, once the launcher relayed it
        assert low and low[0] <= result.step < steps
        assert checkpoint.find(out) is not None and (out / f"step-{result.step}" / "config.json").is_file()
    else:  # a low line too late to stop the run before its end, or none
        assert result.step == steps and (out / "config.json").is_file()
    printed = capsys.readouterr().out
    assert str(result.loss) in printed and result.report in printed


def test_keywords_are_the_run_flags_with_underscores() -> None:
    """Each keyword is read as its flag on the command line: switches, negations, pairs, repeatable flags and a
    JSON object; None leaves a flag out."""
    kw = {"no_save": True, "compile": False, "resume": False, "betas": (0.9, 0.95), "profile": "prof",
          "lr_schedule_kwargs": {"min_lr_rate": 0.1}, "steps": 3, "no_packing": None, "lora_targets": "all"}
    argv = ("run --no-save --no-compile --betas 0.9 0.95 --profile prof --lr-schedule-kwargs '{\"min_lr_rate\": 0.1}'"
            " --steps 3 --lora-targets all")
    from tinypipe.cli import build_parser

    assert vars(parse_options(kw)) == vars(build_parser().parse_args(shlex.split(argv)))
    assert parse_options({"profile": ["a", "b"], "compile": True}).profile == ["a", "b"]


def test_an_unknown_keyword_is_a_type_error_naming_it() -> None:
    """A keyword that is no flag of `run` names itself and the nearest flag."""
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'step' \(did you mean 'steps'\?\)"):
        tinypipe.train(step=3)


@pytest.mark.parametrize(("kw", "argv"), [
    ({"steps": "ten"}, ["--steps", "ten"]),
    ({"backend": "tpu"}, ["--backend", "tpu"]),
    ({"lr": -1}, ["--lr", "-1"]),
    ({"steps": 2, "epochs": 1.0}, ["--steps", "2", "--epochs", "1.0"]),
    ({"report_to": "wandb"}, ["--report-to", "wandb"]),
])
def test_a_bad_value_is_the_commands_one_line_error(kw: dict[str, Any], argv: list[str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`train` raises the InputError whose message `tinypipe run` prints after `error:`, before any worker and
    with nothing written (W&B asked for where wandb does not import: refused the same way)."""
    from tinypipe.backends.launch import spawn

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    for name in ("start_processes", "_run_here"):
        monkeypatch.setattr(spawn, name, lambda *a, **k: pytest.fail("a worker was started"))
    out = tmp_path / "out"
    with pytest.raises(InputError) as info:
        tinypipe.train(out=str(out), **kw)
    assert cli_main(["run", "--out", str(out), *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {info.value}"
    assert "\n" not in str(info.value) and not out.exists()


def test_the_callback_hears_every_line_and_the_result_holds_the_run(tmp_path: Path) -> None:
    """One CPU rank, in this process: the callback gets each line of metrics.jsonl once, in step order; the result
    holds them, the losses, the speed, the memory and the report."""
    heard: list[dict[str, Any]] = []
    result = tinypipe.train(steps=6, out=str(tmp_path / "out"), callback=heard.append, **SMALL)
    assert result is not None and heard == lines(tmp_path / "out") == list(result.metrics)
    assert [m["step"] for m in heard] == list(range(1, 7)) and not result.stopped and result.step == 6
    assert result.losses == {m["step"]: m["loss"] for m in heard} and result.loss == heard[-1]["loss"]
    assert result.tokens_per_s > 0 and result.predicted_tokens_per_s > 0 and result.peak_device_bytes[0] > 0
    assert result.host_state_bytes > 0 and result.peak_rss_bytes > 0 and "tokens/s measured" in result.report


@pytest.mark.parametrize("how", ["false", "raise"])
def test_the_callback_stops_the_run_as_ctrl_c_does(how: str, tmp_path: Path) -> None:
    """Returning False (or raising StopTraining) at step 2 stops the run at that window's end with a checkpoint
    and the model at the stop; `resume=True` then trains on to the end, metrics.jsonl one line per step."""
    out = tmp_path / "out"

    def stop_at_2(m: dict[str, Any]) -> bool:
        if m["step"] == 2 and how == "raise":
            raise StopTraining
        return m["step"] < 2

    result = tinypipe.train(steps=12, out=str(out), checkpoint_every=1, callback=stop_at_2, **SMALL)
    assert result is not None and result.stopped and 2 <= result.step < 12
    assert checkpoint.read_record(checkpoint.find(out))["step"] == result.step  # type: ignore[arg-type]
    assert (out / f"step-{result.step}" / "config.json").is_file() and not (out / "config.json").exists()
    rest = tinypipe.train(resume=True, out=str(out))
    assert rest is not None and not rest.stopped and rest.step == 12
    assert [m["step"] for m in lines(out)] == list(range(1, 13))
    assert [m["step"] for m in rest.metrics] == list(range(result.step + 1, 13))


def test_a_failing_callback_stops_cleanly_and_its_error_is_raised(tmp_path: Path) -> None:
    """Any other exception stops the run the same way, checkpoint written, and is raised once the ranks finish."""
    out = tmp_path / "out"

    def broken(m: dict[str, Any]) -> None:
        raise ValueError(f"bad step {m['step']}")

    with pytest.raises(ValueError, match="bad step 1"):
        tinypipe.train(steps=12, out=str(out), checkpoint_every=1, callback=broken, **SMALL)
    assert checkpoint.find(out) is not None and len(lines(out)) < 12


def test_a_spawned_rank_zeros_lines_are_relayed_and_a_stop_goes_back() -> None:
    """The launcher's side of a spawned run's feed: the queued lines reach the callback in order, and its stop
    request sets the event every rank reads."""
    heard: list[dict[str, Any]] = []
    local = LocalFeed(lambda m: heard.append(m) or m["step"] < 3)
    remote = spawned_feed()
    for step in (1, 2):
        remote.put({"step": step})
    remote.relay(local)
    assert heard == [{"step": 1}, {"step": 2}] and not remote.stop_asked()
    remote.put({"step": 3})
    remote.relay(local)
    assert heard[-1] == {"step": 3} and remote.stop_asked() and local.rows == heard


def test_report_to_wandb_logs_the_metrics_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a wandb module importable (a stand-in here), `report_to="wandb"` opens one run named after --out with
    its files in OUT and the run's options as config, logs every number of each metrics.jsonl line at its step,
    and finishes the run."""
    calls: list[tuple[str, Any]] = []

    class Run:
        def log(self, data: dict[str, Any], step: int) -> None:
            calls.append(("log", (step, data)))

        def finish(self) -> None:
            calls.append(("finish", None))

    def init(**kw: Any) -> Run:
        calls.append(("init", kw))
        return Run()

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # libraries that look for wandb find it
    fake.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "mine"
    tinypipe.train(steps=4, out=str(out), report_to="wandb", **SMALL)
    (kind, kw), *logged, end = calls
    assert kind == "init" and kw["name"] == "mine" and kw["dir"] == str(out) and kw["config"]["steps"] == 4
    want = [(m["step"], {f"train/{k}": v for k, v in m.items() if k != "step" and v is not None}) for m in lines(out)]
    assert [c for _, c in logged] == want and len(want) == 4 and end == ("finish", None)
