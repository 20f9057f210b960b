"""The command line: tables for people, --json for programs, one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from tinypipe.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name, params", [("llama-3.1-8b", "8,030,261,248"), ("llama-3.1-70b", "70,553,706,496")])
def test_inspect_model_prints_exact_counts(capsys: pytest.CaptureFixture[str], name: str, params: str) -> None:
    """`inspect model` names the exact published parameter count in its first line."""
    code, out, _ = _run(capsys, "inspect", "model", name)
    assert code == 0
    assert out.splitlines()[0].startswith(f"{name} (llama): {params} parameters")
    assert "bytes/param" in out and "Can it be trained at all?" in out


def test_inspect_model_json(capsys: pytest.CaptureFixture[str]) -> None:
    """`--json` gives the same facts as data: exact count, both layouts (compact with each moment precision),
    fit per preset."""
    code, out, _ = _run(capsys, "inspect", "model", "llama-3.1-8b", "--json", "--hardware", "rtx4090x1")
    rep = json.loads(out)
    assert code == 0 and rep["params"] == 8_030_261_248
    assert set(rep["host"]) == {"replicated", "compact", "compact-bf16", "compact-8bit"}
    assert rep["host"]["compact"]["bytes_per_param"] < rep["host"]["replicated"]["bytes_per_param"]
    assert [f["hardware"] for f in rep["fit"]] == ["rtx4090x1"]


def test_inspect_lists(capsys: pytest.CaptureFixture[str]) -> None:
    """With no name, `inspect model` and `inspect hardware` list what is shipped."""
    code, out, _ = _run(capsys, "inspect", "model")
    assert code == 0 and "llama-3.1-70b" in out and "tiny-llama" in out
    code, out, _ = _run(capsys, "inspect", "hardware")
    assert code == 0 and "rtx4090x8-pcie4" in out and "measured" in out and "spec" in out


def test_inspect_hardware(capsys: pytest.CaptureFixture[str]) -> None:
    """`inspect hardware h200x2` shows the measured link rates and the NVLink between the GPUs."""
    code, out, _ = _run(capsys, "inspect", "hardware", "h200x2")
    assert code == 0 and "measured" in out and "nvlink" in out


@pytest.mark.parametrize("argv, fragment", [
    (["inspect", "model", "llama-9"], "unknown model 'llama-9'"),
    (["inspect", "model", "/nonexistent/config.json"], "not a file or directory"),
    (["inspect", "hardware", "dgx-a100"], "dgx-a100"),
    (["inspect", "model", "llama-3.1-8b", "--seq-len", "0"], "--seq-len: must be >= 1"),
    (["inspect", "model", "llama-3.1-8b", "--seq-len", "many"], "invalid int value"),
    (["simulate", "--policy", "fastest"], "unknown policy 'fastest'"),
    (["simulate", "--gpu-mem", "lots"], "--gpu-mem"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    """A user mistake prints exactly one line `error: ...` naming the problem, exit code 2."""
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert fragment in err


def test_malformed_model_file(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """A malformed config file is named with the problem; nothing else is printed."""
    f = tmp_path / "config.json"
    f.write_text('{"model_type": "llama", "hidden_size": -4}')
    code, _, err = _run(capsys, "inspect", "model", str(f))
    assert code == 2 and str(f) in err and err.count("\n") == 1


def _one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("policy, fragment", [
    ({"name": "short", "packing": [4, 3]}, "pack sizes sum to 7, but model 'tiny-llama' has 6 layers"),
    ({"name": "far", "packing": [1, 2, 1, 2], "mapping": [0, 1, 0, 5]},
     "pack 1 is mapped to GPU 1, but rtx4090x1 has 1 GPU"),
])
def test_simulate_an_invalid_policy_exits_2(capsys: pytest.CaptureFixture[str], tmp_path, policy: dict[str, object],
                                            fragment: str) -> None:
    """A policy that cannot run this model on this hardware is a mistake, as in `inspect schedule`
    and `run`: one error line and exit 2, never a row in an exit-0 table; no plot is drawn."""
    f = tmp_path / "policy.json"
    f.write_text(json.dumps(policy))
    plot = tmp_path / "t.png"
    code, out, err = _run(capsys, "simulate", "--model", "tiny-llama", "--hardware", "rtx4090x1", "--policy",
                          "tinypipe", "--policy", str(f), "--plot", str(plot))
    assert code == 2 and out == "" and fragment in _one_error_line(err)
    assert not plot.exists()


@pytest.mark.parametrize("argv, fragment", [
    (["simulate", "--model", "tiny-llama", "--plot", "/proc/tinypipe.png"], "--plot /proc/tinypipe.png: cannot write"),
    (["simulate", "--model", "tiny-llama", "--trace", "NO_DIR/t.json"], "does not exist"),
    (["simulate", "--model", "tiny-llama", "--trace", "TMP"], "is a directory"),
    (["search", "--model", "tiny-llama", "--plot", "/proc/p.png"], "--plot /proc/p.png: cannot write"),
    (["search", "--model", "tiny-llama", "--out", "/etc/passwd/w.json"], "/etc/passwd is not a directory"),
    (["inspect", "schedule", "--model", "tiny-llama", "--out", "/proc/s.txt"], "--out /proc/s.txt: cannot write"),
    (["search", "--top", "-1"], "--top: must be >= 1, got -1"),
    (["search", "--workers", "0"], "--workers: must be >= 1, got 0"),
    (["inspect", "schedule", "--steps", "-3"], "--steps: must be >= 1, got -3"),
    (["simulate", "--batch-tokens", "1000"], "--batch-tokens 1000: not a multiple of policy 'resident'"),
    (["simulate", "--batch-tokens", "8192", "--microbatches", "4"], "give one"),
    (["search", "--model", "llama-3.1-8b", "--hardware", "rtx4090x1"], "nothing fits llama-3.1-8b on rtx4090x1"),
    (["run", "--hardware", "h200x2"], "--hardware h200x2: only for --backend cuda"),
    (["run", "--lr", "nan"], "--lr: must be a positive number, got nan"),
    (["run", "--betas", "1.5", "0.9"], "--betas: each must be in [0, 1)"),
    (["run", "--out", "/proc/run"], "--out /proc/run: cannot write in /proc"),
])
def test_mistakes_are_found_before_the_work(capsys: pytest.CaptureFixture[str], tmp_path, argv: list[str],
                                            fragment: str) -> None:
    """Unwritable outputs, impossible numbers and settings for another backend end in one error line
    and exit 2 before anything is computed or trained, never in a traceback after it."""
    if argv[0] == "run":
        pytest.importorskip("torch")
    subst = {"NO_DIR": str(tmp_path / "no" / "such"), "TMP": str(tmp_path)}
    argv = [subst.get(a.split("/")[0], a.split("/")[0]) + a[len(a.split("/")[0]):] for a in argv]
    code, _, err = _run(capsys, *argv)
    assert code == 2 and fragment in _one_error_line(err)


def test_simulate_compares_on_one_workload(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """Each row says its tokens per step; --batch-tokens gives every policy the same one (their
    microbatch counts follow their microbatch sizes), and without it a note says they differ."""
    f = tmp_path / "big.json"
    f.write_text(json.dumps({"name": "big", "microbatch_size": 2}))
    code, out, _ = _run(capsys, "simulate", "--model", "tiny-llama", "--policy", "tinypipe", "--policy", str(f),
                        "--microbatches", "4", "--json")
    rows = json.loads(out)["results"]
    assert code == 0 and [r["tokens_per_step"] for r in rows] == [8192, 16384]
    code, out, _ = _run(capsys, "simulate", "--model", "tiny-llama", "--policy", "tinypipe", "--policy", str(f),
                        "--microbatches", "4")
    assert code == 0 and "tokens/step" in out and "different tokens per step" in out
    code, out, _ = _run(capsys, "simulate", "--model", "tiny-llama", "--policy", "tinypipe", "--policy", str(f),
                        "--batch-tokens", "16384", "--json")
    rows = json.loads(out)["results"]
    assert code == 0 and [r["tokens_per_step"] for r in rows] == [16384, 16384]


def test_simulate_says_what_it_wrote(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """--trace (and --plot) name the file written, after the table."""
    trace = tmp_path / "t.json"
    code, out, _ = _run(capsys, "simulate", "--model", "tiny-llama", "--policy", "tinypipe", "--trace", str(trace))
    assert code == 0 and out.rstrip().endswith(f"wrote {trace} (Chrome trace of tinypipe; open in Perfetto)")
    assert json.loads(trace.read_text())["traceEvents"]


def test_inspect_model_flops_are_not_rounded_away(capsys: pytest.CaptureFixture[str]) -> None:
    """tiny-llama's block costs 0.336 MFLOP per token at seq 2048: the table says 0.336, not 0.300."""
    code, out, _ = _run(capsys, "inspect", "model", "tiny-llama")
    row = next(x for x in out.splitlines() if x.startswith("block.0..3"))
    assert code == 0 and "0.336" in row.split()


def test_search_groups_alike_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    """`search`'s top candidates: one row per outcome the simulator predicts (tokens/s, peak GPU, peak host),
    with how many candidates share it and its gap to the fastest, the ranking rule above, and a note when
    another is within the band of the fastest."""
    from tinypipe.cli.simulate import alike_groups
    from tinypipe.search.policy_search import BAND

    assert main(["search", "--model", "tiny-llama", "--hardware", "h200x1", "--workers", "1", "--seq-len", "512",
                 "--batch-tokens", "4096", "--top", "4"]) == 0
    out = capsys.readouterr().out
    assert "rule: among candidates within 2% of the fastest" in out
    top = out.split("top candidates")[1].split("\n\n")[0].splitlines()
    assert top[1].split()[:7] == ["#", "tokens/s", "vs", "fastest", "peak", "GPU", "peak"] and "alike" in top[1]
    rows = [line.split() for line in top[3:] if line[:1].isdigit()]
    assert len(rows) == 4 and float(rows[0][2].rstrip("%")) / 100 >= -BAND
    assert len({(r[1], r[3], r[5]) for r in rows}) == 4  # one row per predicted outcome
    near = sum(1 for r in rows if float(r[2].rstrip("%")) / 100 >= -BAND)
    assert ("note: " in top[-1]) == (near > 1)

    assert main(["search", "--model", "tiny-llama", "--hardware", "h200x1", "--workers", "1", "--seq-len", "512",
                 "--batch-tokens", "4096", "--top", "4", "--prefer", "speed"]) == 0
    out = capsys.readouterr().out
    assert "rule: the fastest predicted tokens/s (--prefer speed)" in out
    first = out.split("top candidates")[1].split("\n\n")[0].splitlines()[3].split()
    assert first[2] == "+0.0%"

    class E:
        def __init__(self, rate: float, gpu: int) -> None:
            self.tokens_per_s, self.peak_gpu_bytes, self.peak_host_bytes = rate, gpu, 0

    a, b, c, d = E(10.0, 1), E(9.0, 1), E(10.0, 1), E(10.0, 2)
    assert alike_groups([a, b, c, d]) == [[a, c], [b], [d]]
