"""What `tinypipe run` tells a user: the README's capitals command works as written (a byte-level model without
tokenizer files trains on byte ids and says so), the data it read in two lines at the start, and a speed,
step time and ETA of training alone, with held-out evaluation's time reported apart."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import shlex
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import plan_run  # noqa: E402
from test_run import MB, MBS, SEQ, parse, policy_file  # noqa: E402

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.formats import read_data  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer, describe, load_tokenizer  # noqa: E402
from tinypipe.backends.launch.run_report import summary  # noqa: E402
from tinypipe.backends.launch.runtrace import timeline  # noqa: E402
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.launch.steady import common, iteration_times, merged, steady_iteration  # noqa: E402
from tinypipe.backends.rank import metrics  # noqa: E402
from tinypipe.backends.rank.evaluation import EVAL_SPAN  # noqa: E402
from tinypipe.backends.rank.metrics import StepLog, eta_s, evals_after  # noqa: E402
from tinypipe.cli import main as cli_main  # noqa: E402
from tinypipe.ir.timeline import Record, Timeline  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def readme_capitals() -> tuple[str, int, dict[str, str], list[str]]:
    """The README's capitals example: its command line, the data it describes (N lines of a JSON record, in
    the file the command reads) and the output lines it shows."""
    m = re.search(r"and (\d+) lines of `(\{[^`]*\})`\s+in `([\w.]+)`", README)
    assert m is not None, "the README no longer describes the capitals example's data"
    block = README[m.end():].split("```\n", 2)[1]
    command, *shown = block.splitlines()
    assert command.startswith("$ tinypipe run ") and command.endswith("--out runs/capitals"), command
    assert m[3] in shlex.split(command)
    return command[2:], int(m[1]), {"file": m[3], "line": m[2]}, shown


def test_the_readme_capitals_command_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The command line of README.md's capitals example, on the data its text describes, in a fresh directory:
    it exits 0 with no download and no --byte-tokens (tiny-llama has no tokenizer files and a byte-level
    vocabulary), prints the README's header and data lines word for word, and saves runs/capitals, which trains
    further as the README says (its tokenizer: byte ids again). The ranks run as threads here
    (test_run.py starts real worker processes)."""
    from tinypipe.backends.launch import run as run_mod
    from tinypipe.backends.launch import spawn as launch_mod

    command, lines, data, shown = readme_capitals()
    monkeypatch.chdir(tmp_path)
    (tmp_path / data["file"]).write_text((data["line"] + "\n") * lines)
    monkeypatch.setattr(launch_mod, "launch", lambda job, world: run_threads(job, world))
    monkeypatch.setattr(run_mod, "addition_accuracy", lambda *a, **k: pytest.fail("scored a --data run"))
    argv = shlex.split(command)
    assert argv[0] == "tinypipe"
    code = cli_main(argv[1:])
    out, err = capsys.readouterr()
    assert code == 0, err
    packs = re.compile(r"\d+ packs on GPUs \[[\d, ]+\]")  # the packer's choice reads rates measured here
    printed = [packs.sub("PACKS", x) for x in err.splitlines()]
    for line in shown:
        if line.startswith(("tinypipe run:", "data ", " " * 10 + "tokenised")):
            assert packs.sub("PACKS", line) in printed, line
    assert "saved     runs/capitals (AutoModelForCausalLM.from_pretrained loads it)" in out
    assert (tmp_path / "runs" / "capitals" / "config.json").is_file()
    tok = load_tokenizer(tmp_path / "runs" / "capitals", vocab_size=256, byte_tokens=False)
    assert isinstance(tok, ByteTokenizer)


def test_a_model_without_tokenizer_files_takes_byte_ids_only_for_a_byte_vocabulary(tmp_path: Path) -> None:
    """No tokenizer files: a vocabulary of 256..258 ids (bytes, end-of-text, padding) trains on byte ids and
    says why; a larger one is an error naming --byte-tokens, which then gives byte ids and says so."""
    for vocab in (256, 258):
        tok = load_tokenizer(tmp_path, vocab_size=vocab, byte_tokens=False)
        assert describe(tok) == f"UTF-8 byte ids (no tokenizer files, a byte-level vocabulary of {vocab} ids)"
    with pytest.raises(Exception, match="no tokenizer files .* a vocabulary of 259 ids; .* --byte-tokens"):
        load_tokenizer(tmp_path, vocab_size=259, byte_tokens=False)
    assert describe(load_tokenizer(tmp_path, vocab_size=32000, byte_tokens=True)) == "UTF-8 byte ids (--byte-tokens)"


# --- what the run read -----------------------------------------------------------------------------------

def _shape(**kw: object) -> dict:
    return {"tokenizer": ByteTokenizer(258), "seq_len": 16, "microbatch_size": 1, "microbatches": 1, "seed": 0, **kw}


def test_the_data_lines_say_format_examples_windows_loss_share_and_what_was_cut(tmp_path: Path) -> None:
    """Packed: 10 prompt/completion records of 12 tokens (prompt 5, completion 6 + end-of-text) are 120 tokens in
    8 windows of 16 (the last padded), 70 of their 128 label positions with loss, none truncated, and the 5
    examples a window's end cuts counted (the ends at 48 and 96 fall between examples); with 2 windows held
    out, 6 train. Unpacked, with a 30-token record and one whose loss lies past the window: one truncated, one
    dropped. Plain text: one example. The addition task: no lines."""
    f = tmp_path / "caps.jsonl"
    f.write_text("".join(json.dumps({"prompt": "abcde", "completion": f"fghij{i}"}) + "\n" for i in range(10)))
    lines = make_batches(f, **_shape()).lines()
    assert lines == (f"data      {f}: JSON Lines (prompt/completion), 10 examples -> 8 training windows of 16 tokens; "
                     "54.7% of their tokens carry loss",
                     "          tokenised as UTF-8 byte ids; packed: none truncated, 5 split across windows")
    assert "6 training windows of 16 tokens (+ 2 held out)" in make_batches(f, hold_out=0.2, **_shape()).lines()[0]
    g = tmp_path / "mixed.jsonl"
    g.write_text(json.dumps({"text": "short one"}) + "\n" + json.dumps({"text": "x" * 30}) + "\n"
                 + json.dumps({"prompt": "p" * 20, "completion": "late"}) + "\n")
    first, second = make_batches(g, packing=False, **_shape()).lines()
    assert first.startswith(f"data      {g}: JSON Lines (2 text, 1 prompt/completion), 3 examples -> 2 training "
                            "windows of 16 tokens")
    assert second.endswith("unpacked: 1 truncated at 17 tokens, 1 dropped without a loss token")
    t = tmp_path / "notes.txt"
    t.write_text("plain words " * 4)
    assert read_data(t).format == "plain text" and make_batches(t, **_shape()).lines()[0].startswith(
        f"data      {t}: plain text, 1 example -> 3 training windows")
    assert make_batches(None, **_shape()).lines() == ()


def test_the_plan_carries_the_data_lines_printed_under_the_header(tmp_path: Path) -> None:
    f = tmp_path / "caps.jsonl"
    f.write_text("".join(json.dumps({"prompt": "The capital of Peru is", "completion": " Lima."}) + "\n"
                         for _ in range(40)))
    plan = plan_run(parse("--data", str(f), "--steps", "2", "--out", str(tmp_path / "out")))
    assert len(plan.data_lines) == 2 and plan.data_lines[0].startswith(f"data      {f}: JSON Lines (prompt/completion)")
    assert plan.data_lines[1].startswith("          tokenised as UTF-8 byte ids (no tokenizer files")


# --- evaluation's time apart from training's ------------------------------------------------------------------

def _timeline(ends: list[float]) -> Timeline:
    """One FWD per iteration ending at `ends`, each iteration's optimizer step inside it."""
    recs, t = [], 0.0
    for i, e in enumerate(ends):
        recs.append(Record(2 * i, "g0.compute", "FWD", "F0", 0, 0, i, t, e))
        recs.append(Record(2 * i + 1, "host.optim", "OPT_STEP", "O0", 0, None, i, t, (t + e) / 2))
        t = e
    return Timeline(tuple(recs), source="cpu")


def test_an_evaluation_between_iterations_is_left_out_of_the_step_time() -> None:
    """Iterations of 1 s with a 10 s evaluation before the fourth, while both ranks evaluate (rank 0 from 2.8 s,
    while rank 1 still trains): the steady step is 1 s, not 3.5 s."""
    tl = _timeline([1.0, 2.0, 3.0, 14.0, 15.0])
    assert merged([(3.0, 12.5), (3.2, 13.0), (14.5, 20.0)]) == [(3.0, 13.0), (14.5, 20.0)]
    pauses = common([[(2.8, 13.0), (15.0, 16.0)], [(3.0, 13.5), (15.1, 16.2)]])
    assert pauses == [(3.0, 13.0), (15.1, 16.0)]
    assert iteration_times(tl, pauses) == pytest.approx([1.0, 1.0, 1.0, 1.0, 1.0])
    assert steady_iteration(tl) == (pytest.approx(3.5), 1)  # the evaluation counted in the step time
    assert steady_iteration(tl, pauses) == (pytest.approx(1.0), 1)


def test_the_eta_is_training_time_per_step_plus_the_evaluations_due() -> None:
    """Evaluations every 10 steps and at the end of 45: after step 10, 20, 30, 40 and 45 are due; the ETA is
    the steps left at the training time per step, plus each due evaluation at the mean time of those measured."""
    assert [evals_after(s, 45, 10) for s in (0, 10, 40, 44, 45)] == [5, 4, 1, 1, 0]
    assert [evals_after(s, 40, 10) for s in (0, 10, 39)] == [4, 3, 1]
    assert evals_after(3, 10, 0) == 1 and evals_after(3, 10, None) == 0
    assert eta_s(done=10, left=35, train_s=5.0, evals_left=4, eval_s=6.0, evals=1) == pytest.approx(17.5 + 24.0)
    assert eta_s(done=4, left=6, train_s=2.0, evals_left=2, eval_s=0.0, evals=0) == pytest.approx(3.0)


def test_the_progress_line_takes_evaluation_out_of_the_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten steps, evaluating every 4 and at the end; the first window, 4 steps in 2 s, then a 4 s evaluation: the
    ETA is 6 steps at 0.5 s plus the 2 evaluations due (after steps 8 and 10) at 4 s, 11 s (the elapsed time per
    step would say 6 x 1.5 s = 9 s, the evaluation spread over the steps), the window's tokens/s is its training's,
    and the line shows the evaluation's time."""
    clock = iter([0.0, 6.0])  # the log's start; step 4's line, after 2 s of training and 4 s of evaluation
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    log = StepLog(None, steps=10, start=0, tokens_per_step=100, ranks=1, lr_at=lambda k: 0.1, stream=stream,
                  eval_every=4)
    log.window(0, 4, 2.0, [({0: 1.0, 1: 0.9, 2: 0.8, 3: 0.7}, {})], eval_loss=0.95, eval_s=4.0)
    assert stream.getvalue() == ("training [#########...............] step 4/10  loss 0.7000  200 tokens/s  ETA 0:11"
                                 "  eval loss 0.9500 (4.0 s)\n")


def test_a_run_with_evaluation_reports_its_time_apart(tmp_path: Path) -> None:
    """Four steps on two ranks, evaluated after steps 2 and 4: each rank records two evaluation spans; the
    iteration after the first evaluation is measured without it; the summary says how many evaluations took
    how long, and that the speed leaves them out."""
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": f"line {i}: {'xy' * (i % 7)} and {i * 7}"}) + "\n" for i in range(80)))
    pol = policy_file(tmp_path, packing=[1, 2, 1, 2], mapping=[0, 1, 0, 1])
    plan = plan_run(parse("--gpus", "2", "--policy", pol, "--steps", "4", "--data", str(f), "--eval-fraction",
                               "0.3", "--eval-every", "2", "--out", str(tmp_path / "out")))
    assert plan.job.tokens_per_step == SEQ * MBS * MB
    results = run_threads(dataclasses.replace(plan.job, progress=False, save_model=False), 2)
    spans = [(a, b) for r in results for name, a, b in r.host if name == EVAL_SPAN]
    assert len(spans) == 4 and all(b > a for a, b in spans)
    tl = timeline(plan, results)
    both = common([[(a, b) for name, a, b in r.host if name == EVAL_SPAN] for r in results])
    ends = tl.iteration_ends_s()
    assert len(both) == 2 and ends[1] <= both[0][0] < both[0][1] <= ends[2] and ends[3] <= both[1][0]
    plain, less = tl.iteration_times_s(), iteration_times(tl, both)
    assert less[2] == pytest.approx(plain[2] - (both[0][1] - both[0][0]))  # step 3 ran after the first evaluation
    assert [less[k] for k in (0, 1, 3)] == pytest.approx([plain[k] for k in (0, 1, 3)])
    text = summary(plan, results, None, None)
    assert re.search(r"^eval      held-out loss [\d.]+ at step 2, [\d.]+ at step 4; 2 evaluations took [\d.]+ s, "
                     r"left out of the speed below$", text, re.M), text
