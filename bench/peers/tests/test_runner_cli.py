"""`bench/peers/run.py` end to end on the CPU: bad options end in one line and exit code 2 before
anything is written; a real FSDP2 run of a tiny Llama (gloo, one process) through the whole runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peers.run import main

TINY = ["--device", "cpu", "--model", "tiny-llama", "--layers", "2", "--seq-len", "32", "--batch-tokens", "128",
        "--microbatch-size", "2", "--caps", "none"]


@pytest.mark.parametrize("options, message", [
    (["--runs", "fsdp2", "nope"], "error: --runs: unknown nope (known: tinypipe, roundpipe, "),
    (["--caps", "24,x"], "error: --caps: 'x' is neither a number of GiB nor 'none'"),
    (["--steps", "1", "--warmup", "1"], "error: --steps 1 --warmup 1: need 0 <= warm-up < steps"),
    (["--batch-tokens", "1000"], "error: --batch-tokens 1000 is not a multiple of --seq-len 2048"),
    (["--gpus", "1,3"], "error: 32 sequences per step do not split into microbatches of 4 on 3 GPU(s)"),
    (["--model", "gpt2-xl"], "error: --model gpt2-xl: the peers are compared on llama or qwen3 models"),
    (["--layers", "0"], "error: --layers: must be >= 1, got 0"),
    (["--timeout-s", "0"], "error: --timeout-s: must be > 0, got 0"),
    (["--layers", "many"], "error: argument --layers: invalid int value: 'many'"),
])
def test_bad_options_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             options: list[str], message: str) -> None:
    """Each mistake: exit 2, one line on stderr naming the option, no output file."""
    out = tmp_path / "peers.json"
    assert main([*options, "--device", "cpu", "--out", str(out), "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message)
    assert not out.exists()


def test_cuda_asked_for_on_a_machine_without_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a CUDA device the default `--device cuda` is a one-line error, not a row of failures."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["--out", str(tmp_path / "p.json"), "--workdir", str(tmp_path / "w")]) == 2
    assert capsys.readouterr().err.strip() == ("error: --device cuda: no CUDA device here (--device cpu runs the "
                                               "CPU stand-ins)")


def test_past_the_deadline_runs_are_skipped_not_started(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With less of the deadline left than a run needs to start, the run is a `skipped` row and the
    JSON and the table are written all the same."""
    out = tmp_path / "peers.json"
    assert main([*TINY, "--runs", "fsdp2", "--deadline-s", "10", "--min-start-s", "45", "--out", str(out),
                 "--workdir", str(tmp_path / "w")]) == 0
    r = json.loads(out.read_text())["results"][0]
    assert r["status"] == "skipped" and "a run starts with at least 45 s" in r["error"]
    assert "| fsdp2 | sync | 1 | none | skipped: " in capsys.readouterr().out


def test_fsdp2_on_the_cpu_through_the_runner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """FSDP2 (fully_shard, CPUOffloadPolicy, bf16 mixed precision, checkpointing, fused AdamW) trains a
    2-layer tiny Llama for 1 warm-up and 2 timed steps in a gloo process the runner starts; RoundPipe,
    CUDA-only, is skipped. The row has the model's exact parameter count, the steps, tokens/s and
    finite losses near ln(256); the config.json the runner wrote is the one the peer built."""
    out, work = tmp_path / "peers.json", tmp_path / "w"
    assert main([*TINY, "--runs", "fsdp2", "roundpipe", "--out", str(out), "--workdir", str(work)]) == 0
    payload = json.loads(out.read_text())
    fsdp2, roundpipe = payload["results"]
    assert fsdp2["status"] == "ok", fsdp2["error"]
    assert fsdp2["params"] == payload["model"]["params"] == 2 * 256 * 64 + 64 + 2 * (
        2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128 + 2 * 64)
    assert (fsdp2["steps"], fsdp2["warmup_steps"], fsdp2["timed_steps"]) == (3, 1, 2)
    assert fsdp2["tokens_per_s"] > 0 and all(5.0 < x < 6.0 for x in fsdp2["losses"])
    assert fsdp2["details"]["optimizer"] == "torch.optim.AdamW(fused=True) on CPU DTensor parameters"
    assert roundpipe["status"] == "skipped" and roundpipe["error"] == "roundpipe runs on CUDA only"
    config = json.loads((work / "model" / "tiny-llama" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and (work / "fsdp2-1gpu-uncapped.log").is_file()
    assert "| fsdp2 | sync | 1 | none | ok |" in capsys.readouterr().out


def test_peers_do_not_start_in_the_repository_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m` puts the working directory first on sys.path, and the repository root's tinypipe/ lacks
    the backends the installed package maps in: each peer starts in the runner's work directory."""
    import peers.run
    from peers.execute import Outcome

    seen: list[Path | None] = []

    def fake_execute(argv: list[str], env: dict[str, str], *, timeout_s: float, log: Path,
                     cwd: Path | None = None) -> Outcome:
        seen.append(cwd)
        return Outcome(False, 1, 0.1, ["stand-in"])

    monkeypatch.setattr(peers.run, "execute", fake_execute)
    work = tmp_path / "w"
    assert main([*TINY, "--runs", "fsdp2", "mobius", "--out", str(tmp_path / "p.json"), "--workdir", str(work)]) == 0
    assert seen == [work, work] and not (work / "tinypipe").exists()
