"""The whole command line under drawn flags and values: exit 0, or exit 2 with one `error:` line, in bounded time.

Hypothesis draws a subcommand and a handful of its flags with values that are mostly wrong
(negative, zero, NaN, garbage, missing or unwritable paths, other subcommands' flags). `main` runs
in this process. `run` plans for real, but a run that passes every check stops where the workers
would start (nothing trains here: `tests/backends` covers that), `profile` where it would start
measuring, and the CPU is described with fixed numbers instead of measured, so an example costs
milliseconds to a second. An example fails on a traceback, on exit 0 when it holds a value that is
wrong wherever it is drawn (`ALWAYS_BAD`), and on running longer than `BOUND_S`.

The default suite draws a fixed set of examples (derandomized: the same in every CI run); the
longer random search is its own command:

    pytest -m fuzz tests/test_cli_fuzz.py            # 1,000 fresh examples
    FUZZ_EXAMPLES=5000 pytest -m fuzz tests/test_cli_fuzz.py
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinypipe.cli import main

HAVE_TORCH = importlib.util.find_spec("torch") is not None


class WouldTrain(Exception):  # noqa: N818 - not an error: a valid run reached the workers
    """Raised instead of starting worker processes."""


def _files(root: Path) -> dict[str, str]:
    """Paths the strategies refer to by name (made once; every output path is fresh or unwritable)."""
    tied = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": True, "attention_bias": False, "initializer_range": 0.02}
    made = {
        "TIED": ("tied.json", json.dumps(tied)),
        "BAD_MODEL": ("bad_model.json", '{"model_type": "llama", "hidden_size": -4}'),
        "POLICY_OK": ("ok.json", json.dumps({"name": "ok", "packing": [2, 2, 2], "mapping": "round-robin"})),
        "POLICY_SHORT": ("short.json", json.dumps({"name": "short", "packing": [4, 3]})),
        "POLICY_FIELD": ("field.json", json.dumps({"name": "x", "packing": "sideways"})),
        "NOT_JSON": ("not.json", "{this is not json"),
        "DATA_BAD": ("data.jsonl", '{"text": "fine"}\nnot json\n'),
        "DATA_OK": ("data.txt", "1+1=2\n" * 200),
        "DATA_CSV": ("data.csv", "name,label\nhello,1\n"),  # a table without a record field
    }
    out = {}
    for key, (name, text) in made.items():
        (root / name).write_text(text)
        out[key] = str(root / name)
    earlier = root / "earlier"
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")
    ckpt = root / "ckpt" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"format": "tinypipe.checkpoint/1", "step": 30,
                                                 "run": {"steps": 3000, "lr": 0.003}}))
    profiles = root / "profiles"
    profiles.mkdir()
    from tinypipe.describe.trace import load_trace

    (profiles / "t.json").write_text(json.dumps(load_trace("h200-llama-3.1-8b-mb1-seq2048").to_json()))
    out.update(EARLIER=str(earlier), CKPT=str(root / "ckpt"), DIR=str(root), FILE=out["DATA_OK"],
               PROFILES=str(profiles))
    return out


INTS = st.sampled_from(["0", "-1", "1", "2", "3", "4", "16", "64", "x", "2.5", "99999999999999999999999"])
FLOATS = st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e-3", "0.5", "0.98", "1.5", "x"])
BYTES = st.sampled_from(["24GiB", "1KiB", "0", "-5GiB", "lots", "1e3GiB"])
MODELS = st.sampled_from(["tiny-llama", "tiny-llama", "TIED", "llama-9", "BAD_MODEL", "/nonexistent/config.json"])
HARDWARE = st.sampled_from(["rtx4090x1", "h200x2", "rtx4090x8-pcie4", "dgx-a100", "NOT_JSON"])
POLICIES = st.sampled_from(["resident", "tinypipe", "mobius", "fastest", "POLICY_OK", "POLICY_SHORT", "POLICY_FIELD",
                            "NOT_JSON"])
OUT_FILES = st.sampled_from(["FRESH_FILE", "FRESH_FILE", "/proc/tinypipe-x", "DIR", "/etc/passwd/x", "NO_DIR/x"])
OUT_DIRS = st.sampled_from(["FRESH_DIR", "FRESH_DIR", "FILE", "/proc/tinypipe-x", "EARLIER", "CKPT"])
SEQ = st.sampled_from(["1024", "2048", "0", "-5", "100000", "x"])  # (short sequences: hundreds of microbatches)
PROFILES = st.sampled_from(["PROFILES", "PROFILES", "NOT_JSON", "POLICY_OK", "DIR", "EARLIER", "NO_DIR/x"])
DTYPES = st.sampled_from(["bf16", "fp32", "fp16", "int8"])

WORKLOAD = {"--model": MODELS, "--hardware": HARDWARE, "--seq-len": SEQ, "--microbatches": INTS,
            "--microbatch-size": INTS, "--iterations": st.sampled_from(["1", "2", "0", "-1", "x"]), "--json": None,
            "--profile": PROFILES, "--dtype": DTYPES}
FLAGS: dict[tuple[str, ...], dict[str, Any]] = {
    ("inspect", "model"): {"NAME": MODELS, "--seq-len": SEQ, "--microbatch-size": INTS, "--hardware": HARDWARE,
                           "--json": None},
    ("inspect", "hardware"): {"NAME": HARDWARE, "--json": None},
    ("inspect", "schedule"): {**WORKLOAD, "--policy": POLICIES, "--out": OUT_FILES, "--steps": INTS},
    ("simulate",): {**WORKLOAD, "--policy": POLICIES, "--batch-tokens": st.sampled_from(["8192", "4096", "1000", "0"]),
                    "--gpu-mem": BYTES, "--host-mem": BYTES, "--trace": OUT_FILES, "--plot": OUT_FILES},
    ("search",): {"--model": st.sampled_from(["tiny-llama", "TIED", "llama-9"]),
                  "--hardware": st.sampled_from(["rtx4090x1", "h200x2", "dgx-a100", "NOT_JSON"]),
                  "--seq-len": st.sampled_from(["1024", "2048", "0", "x"]),
                  "--batch-tokens": st.sampled_from(["4096", "2048", "1000", "0", "-1"]),
                  "--gpu-mem": BYTES, "--host-mem": BYTES, "--workers": st.sampled_from(["1", "0", "-2", "x"]),
                  "--top": INTS, "--out": OUT_FILES, "--allow-async": None, "--json": None, "--profile": PROFILES,
                  "--dtype": DTYPES},
}
if HAVE_TORCH:
    FLAGS[("run",)] = {
        "--gpus": st.sampled_from(["1", "2", "2", "3", "0", "-1", "1000", "x"]),
        "--steps": st.sampled_from(["1", "2", "0", "-3", "x"]), "--model": MODELS, "--policy": POLICIES,
        "--microbatch-size": INTS, "--seq-len": st.sampled_from(["16", "64", "0", "100000", "x"]),
        "--batch-tokens": st.sampled_from(["64", "128", "512", "50", "0", "x"]), "--lr": FLOATS, "--betas": FLOATS,
        "--eps": FLOATS, "--weight-decay": FLOATS, "--seed": st.sampled_from(["0", "7", "-1", "99999999999999999999"]),
        "--dtype": st.sampled_from(["fp32", "bf16", "fp16"]), "--backend": st.sampled_from(["cpu", "cuda", "tpu"]),
        "--hardware": HARDWARE, "--out": OUT_DIRS, "--resume": None, "--checkpoint-minutes": FLOATS,
        "--checkpoint-every": INTS, "--trace": OUT_FILES,
        "--data": st.sampled_from(["DATA_OK", "DATA_BAD", "DATA_CSV", "NO_DIR/x"]), "--profile": PROFILES,
        "--lr-schedule": st.sampled_from(["constant", "linear", "cosine", "step"]),
        "--warmup-steps": INTS, "--warmup-ratio": FLOATS, "--epochs": FLOATS, "--byte-tokens": None,
        "--no-packing": None, "--no-grad-norm": None, "--save-every": INTS, "--max-grad-norm": FLOATS,
        "--eval-data": st.sampled_from(["DATA_OK", "DATA_BAD", "NO_DIR/x"]), "--eval-fraction": FLOATS,
        "--eval-every": INTS,
        "--save-dtype": st.sampled_from(["fp32", "bf16", "fp16", "int4"]),
        "--decay-all": None,
    }
    FLAGS[("profile",)] = {
        "--model": MODELS, "--seq-len": st.sampled_from(["16", "64", "0", "100000", "x"]), "--microbatch-size": INTS,
        "--backend": st.sampled_from(["cpu", "cuda", "tpu"]), "--dtype": DTYPES, "--repeat": INTS, "--warmup": INTS,
        "--threads": INTS, "--hardware": HARDWARE, "--out": OUT_DIRS, "--no-rates": None, "--json": None,
        "--seed": st.sampled_from(["0", "7", "-1", "x"]),
    }
COMMANDS = sorted(FLAGS)
# Defaults that keep an example fast where the command's own default is slow (llama-3.1-8b, all
# cores); drawn flags replace them, and the defaults themselves are covered in test_cli.py.
QUICK = {("inspect", "schedule"): ["--model", "tiny-llama"], ("simulate",): ["--model", "tiny-llama"],
         ("search",): ["--model", "tiny-llama", "--workers", "1", "--hardware", "h200x2", "--batch-tokens", "4096"],
         ("profile",): ["--model", "tiny-llama", "--out", "FRESH_DIR"]}
NOISE = st.sampled_from(["--frobnicate", "extra", "--json", "--", "-x", "--model"])


@st.composite
def argv(draw: st.DrawFn) -> list[str]:
    command = draw(st.sampled_from(COMMANDS))
    flags = FLAGS[command]
    chosen = draw(st.lists(st.sampled_from(sorted(flags)), max_size=5, unique=True))
    out = list(command)
    for flag in chosen:
        values = flags[flag]
        if flag == "NAME":
            out.append(draw(values))
        elif values is None:
            out.append(flag)
        elif flag == "--betas":
            out += [flag, draw(values), draw(values)]
        else:
            out += [flag, draw(values)]
    quick = QUICK.get(command, [])
    for flag, value in zip(quick[::2], quick[1::2]):
        if flag not in chosen:
            out += [flag, value]
    if draw(st.integers(0, 9)) == 0:
        out.insert(draw(st.integers(1, len(out))), draw(NOISE))
    return out


def _fixed_cpu(workers: int, *, threads: int) -> Any:
    from tinypipe.describe.hardware import GPU, Hardware, Host, Link

    mem = 64 * 2**30
    return Hardware(name=f"fuzz-cpu-x{workers}", provenance="spec", source="fixed numbers for the fuzz test",
                    host=Host(memory_bytes=mem, dma_gbps=10.0, cpu_cores=2, adam_params_per_s=1e8),
                    gpus=tuple(GPU(f"gpu{i}", "CPU", mem, 2e10, 10.0) for i in range(workers)), switches=("rc0",),
                    links=(Link("host", "rc0", "mem", 10.0, 0.0),)
                    + tuple(Link("rc0", f"gpu{i}", "pcie", 10.0, 2e-6) for i in range(workers)))


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _files(tmp_path_factory.mktemp("fuzz"))


# values wrong wherever the strategies draw them (as the pre-substitution names): an argv holding one exits 2
ALWAYS_BAD = frozenset({"x", "2.5", "-1", "-2", "-3", "-5", "nan", "inf", "-inf", "int8", "int4", "tpu", "step", "lots",
                        "-5GiB", "BAD_MODEL", "/nonexistent/config.json", "llama-9", "NOT_JSON", "POLICY_SHORT",
                        "POLICY_FIELD", "DATA_BAD", "DATA_CSV", "/proc/tinypipe-x", "/etc/passwd/x", "NO_DIR/x",
                        "FILE", "--frobnicate", "extra", "-x"})
BOUND_S = 60.0  # no example may run longer: a mistyped number must be refused, not computed for hours
SUPPRESS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


class Overlong(BaseException):  # noqa: N818 - BaseException: no `except Exception` in the code under test stops it
    """Raised in the example when it has run BOUND_S seconds."""


@contextlib.contextmanager
def _bounded(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise Overlong

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=SUPPRESS)
@given(args=argv())
def test_every_command_line_ends_in_exit_0_or_one_error_line(args: list[str], places: dict[str, str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the flags: exit 0 without a traceback, or exit 2 with exactly one `error:` line on
    stderr (the last one) and no traceback; exit 2 whenever a value is always wrong; within BOUND_S;
    a valid `run` reaches the point of starting workers. The same 60 examples in every run."""
    check_command_line(args, places, monkeypatch)


@pytest.mark.fuzz
@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "1000")), deadline=None, suppress_health_check=SUPPRESS)
@given(args=argv())
def test_random_command_lines(args: list[str], places: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same contract over fresh random examples (`pytest -m fuzz`)."""
    check_command_line(args, places, monkeypatch)


def check_command_line(args: list[str], places: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = Path(tempfile.mkdtemp(dir=places["DIR"]))
    monkeypatch.chdir(fresh)  # the default --out (runs/...) lands here
    names = {**places, "FRESH_FILE": str(fresh / "out.file"), "FRESH_DIR": str(fresh / "run"),
             "NO_DIR": str(fresh / "no" / "such")}
    real = [names.get(a, a) if not a.startswith("NO_DIR/") else names["NO_DIR"] + a[6:] for a in args]
    err, out = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        if HAVE_TORCH:
            stack.enter_context(mock.patch("tinypipe.backends.launch.spawn.start_processes", side_effect=WouldTrain))
            stack.enter_context(mock.patch("tinypipe.backends.launch.spawn._run_here", side_effect=WouldTrain))
            stack.enter_context(mock.patch("tinypipe.backends.launch.run.addition_accuracy", return_value=0.0))
            stack.enter_context(mock.patch("tinypipe.backends.launch.prepare.cpu_hardware",
                                           side_effect=_fixed_cpu))
            stack.enter_context(mock.patch("tinypipe.backends.profile.command.LayerBench", side_effect=WouldTrain))
        stack.enter_context(contextlib.redirect_stderr(err))
        stack.enter_context(contextlib.redirect_stdout(out))
        try:
            with _bounded(BOUND_S):
                code = main(real)
        except WouldTrain:
            assert not set(args) & ALWAYS_BAD, (real, "a wrong value reached the workers")
            return
        except Overlong:
            pytest.fail(f"ran longer than {BOUND_S:g} s: {real}")
        except SystemExit as exc:  # argparse's --help
            code = exc.code if isinstance(exc.code, int) else 2
    text = err.getvalue()
    assert "Traceback" not in text, (real, text)
    # a valid run or profile raises WouldTrain where its workers or measurements would start: a 0 from
    # either means a patch above missed and the example trained for real
    assert not (HAVE_TORCH and args[0] in ("run", "profile") and code == 0), (real, text)
    assert code in (0, 2), (real, code, text)
    assert code == 2 or not set(args) & ALWAYS_BAD, (real, "exit 0 with", sorted(set(args) & ALWAYS_BAD), text)
    if code == 2:
        lines = [x for x in text.splitlines() if x.strip()]
        errors = [x for x in lines if x.startswith("error: ")]
        assert len(errors) == 1 and lines[-1] == errors[0], (real, text)
