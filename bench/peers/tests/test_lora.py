"""LoRA in the peers comparison (`--lora R`): the option and its checks, the command each peer starts with,
the runs skipped because their scripts train every parameter, tinypipe's own LoRA options, the table; and,
where a RoundPipe install is at hand, RoundPipe's Llama preset over peft's adapters on a CPU."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from peers.execute import Outcome
from peers.measure import peer_parser
from peers.modelconfig import model_config, write_config
from peers.report import row, table
from peers.run import main
from peers.runs import RUNS, Config
from peers.workload import LORA_TARGETS, Lora, Workload, workload_of

BENCH = Path(__file__).resolve().parents[2]  # bench/
LORA = ["--lora", "16", "--lora-alpha", "32"]
TINYPIPE_LORA = ["--lora", "16", "--lora-alpha", "32", "--lora-dropout", "0", "--lora-targets", "all"]
# Llama-3.1-8B, r 16 on q, k, v, o, gate, up, down: 16 x (in + out) summed over the seven linears, x 32 layers
ADAPTERS_8B = 32 * 16 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 3 * (4096 + 14336))


def _workload(*argv: str) -> Workload:
    return workload_of(peer_parser("test").parse_args(["--config", "c", "--result", "r", *argv]))


def test_lora_option_alpha_defaults_to_twice_the_rank_and_travels_to_the_peers() -> None:
    """`--lora 16` is rank 16, alpha 32; `--lora-alpha` overrides; the workload's argv (what every peer gets)
    carries both; no `--lora` is full training with no LoRA options at all."""
    assert _workload("--lora", "16").lora == Lora(rank=16, alpha=32.0)
    assert _workload("--lora", "16", "--lora-alpha", "8").lora == Lora(rank=16, alpha=8.0)
    assert _workload("--lora", "16").argv()[-4:] == LORA
    assert _workload().lora is None and "--lora" not in _workload().argv()
    assert Workload(lora=Lora(0, 1.0)).problem(1) == "--lora: the rank must be >= 1, got 0"
    assert Workload(lora=Lora(4, -1.0)).problem(1) == "--lora-alpha: must be > 0, got -1"
    assert LORA_TARGETS == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("options, message", [
    (["--lora-alpha", "8"], "error: --lora-alpha needs --lora R"),
    (["--lora", "0"], "error: --lora: the rank must be >= 1, got 0"),
    (["--lora", "16", "--lora-alpha", "0"], "error: --lora-alpha: must be > 0, got 0"),
    (["--lora", "x"], "error: argument --lora: invalid int value: 'x'"),
])
def test_bad_lora_options_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  options: list[str], message: str) -> None:
    """Each LoRA mistake: exit 2 and one line naming the option, before anything runs or is written."""
    out = tmp_path / "peers.json"
    assert main([*options, "--device", "cpu", "--out", str(out), "--workdir", str(tmp_path / "w")]) == 2
    assert capsys.readouterr().err.strip() == message
    assert not out.exists()


def test_lora_starts_the_lora_peers_with_the_adapters_and_skips_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """On a (stand-in) 1-GPU machine, `--lora 16` on Llama-3.1-8B: the whole model (32 layers, the default
    with LoRA); tinypipe and RoundPipe start with `--lora 16 --lora-alpha 32`, RoundPipe with its private
    install first on PYTHONPATH; FSDP2 and DeepSpeed are not started and their rows say why; the JSON holds
    the adapters (rank, alpha, dropout, peft's target names) and their parameter count."""
    import peers.run

    started: list[list[str]] = []
    paths: list[str] = []

    def fake_execute(argv: list[str], env: dict[str, str], *, timeout_s: float, log: Path,
                     cwd: Path | None = None) -> Outcome:
        started.append(argv)
        paths.append(env["PYTHONPATH"])
        return Outcome(False, 1, 0.1, ["stand-in"])

    monkeypatch.setattr(peers.run, "execute", fake_execute)
    monkeypatch.setattr(peers.run, "_gpu_count", lambda device: 1)
    site, out, work = tmp_path / "rp", tmp_path / "peers.json", tmp_path / "w"
    site.mkdir()
    assert main(["--lora", "16", "--runs", "tinypipe", "roundpipe", "fsdp2", "deepspeed", "--roundpipe-site",
                 str(site), "--out", str(out), "--workdir", str(work)]) == 0
    assert [a[2] for a in started] == ["peers.peer_tinypipe", "peers.peer_roundpipe"]
    for argv in started:
        assert argv[argv.index("--lora"):argv.index("--lora") + 4] == LORA
    assert paths[1].startswith(f"{site}{os.pathsep}")
    payload = json.loads(out.read_text())
    tp, rp, fsdp2, ds = payload["results"]
    reason = "no LoRA: its script trains every parameter; peft LoRA is not set up for it here"
    assert [(r["status"], r["error"]) for r in (fsdp2, ds)] == [("skipped", reason)] * 2
    assert tp["status"] == rp["status"] == "failed"  # the stand-in exits 1
    lora = {"rank": 16, "alpha": 32.0, "dropout": 0.0, "targets": list(LORA_TARGETS)}
    assert payload["workload"]["lora"] == tp["lora"] == lora
    assert (payload["model"]["layers"], payload["model"]["adapter_params"]) == (32, ADAPTERS_8B) == (32, 41_943_040)
    assert json.loads((work / "model" / "llama-3.1-8b" / "config.json").read_text())["num_hidden_layers"] == 32
    assert f"| fsdp2 + LoRA r16 | sync | 1 | 24 GiB | skipped: {reason} |" in capsys.readouterr().out


def test_layers_default_is_12_for_full_training_and_the_models_own_for_lora() -> None:
    """Without --lora the runner builds 12 decoder layers unless told; with it, the model's own count
    (`model_config` with None); an explicit --layers wins either way."""
    from peers.run import _layers

    assert (_layers(None, Workload()), _layers(None, Workload(lora=Lora(16, 32.0))), _layers(4, Workload(
        lora=Lora(16, 32.0)))) == (12, None, 4)
    assert model_config("llama-3.1-8b", None, 2048)[1]["num_hidden_layers"] == 32


def test_tinypipe_search_and_run_get_its_lora_options_which_its_own_parsers_read() -> None:
    """peer_tinypipe passes `--lora 16 --lora-alpha 32 --lora-dropout 0 --lora-targets all` to both
    `tinypipe search` and `tinypipe run`, and tinypipe's parsers read them as rank 16, alpha 32 on all seven
    linears; without --lora neither gets a LoRA option."""
    pytest.importorskip("torch")
    from peers.peer_tinypipe import _run_args, _search_args
    from tinypipe.backends.options.run_flags import add_run_arguments
    from tinypipe.cli import build_parser
    from tinypipe.cli.edge import lora_of
    from tinypipe.policy.lora_spec import ROLES, LoraSpec

    args = peer_parser("test").parse_args(["--config", "/m", "--result", "r", "--gpu-mem-gib", "24", *LORA])
    work = workload_of(args)
    search = _search_args(args, work, "h200x1", 10**11, Path("s.json"))
    run = _run_args(args, work, "cuda", "p.json", Path("o"))
    assert search[search.index("--lora"):search.index("--lora") + 8] == TINYPIPE_LORA
    assert run[run.index("--lora"):run.index("--lora") + 8] == TINYPIPE_LORA
    want = LoraSpec(rank=16, alpha=32.0, dropout=0.0, targets=ROLES)
    assert lora_of(build_parser().parse_args(["search", *search])) == want
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    assert lora_of(parser.parse_args(run)) == want
    full = peer_parser("test").parse_args(["--config", "/m", "--result", "r"])
    assert not [a for a in (*_search_args(full, workload_of(full), "h200x1", 1, Path("s")),
                            *_run_args(full, workload_of(full), "cuda", "p", Path("o"))) if a.startswith("--lora")]


def test_table_names_the_adapters() -> None:
    """A LoRA row's system cell says `+ LoRA r<rank>`; the rest of the row is as for full training."""
    common = {"model": "m", "layers": 32, "tokens_per_step": 65536, "seq_len": 2048, "microbatch_size": 4,
              "params": 8_030_261_248, "lora": {"rank": 16, "alpha": 32.0, "dropout": 0.0,
                                                "targets": list(LORA_TARGETS)}}
    r = row(Config(RUNS["roundpipe"], 1, 24.0), ranks=1, common=common, outcome=Outcome(False, 0, 60.0, []),
            records=[{"done": True, "warmup_steps": 2, "iteration_s_each": [30.0, 9.0, 8.0, 8.0],
                      "peak_gpu_bytes": [12 * 2**30], "peak_gpu_reserved_bytes": [13 * 2**30],
                      "peak_host_rss_bytes": 36 * 2**30, "pinned_host_bytes": None, "trainable_params": 41_943_040}])
    assert r["trainable_params"] == 41_943_040
    assert table([r]).splitlines()[2] == ("| roundpipe + LoRA r16 | async | 1 | 24 GiB | ok | 8,192 | 8.00 (2) "
                                          "| 12.0 (13.0) | 36.0 | 4.8 | - |")


ROUNDPIPE_SITE = os.environ.get("PEERS_ROUNDPIPE_SITE")


@pytest.mark.skipif(not (ROUNDPIPE_SITE and Path(ROUNDPIPE_SITE, "roundpipe").is_dir()),
                    reason="set PEERS_ROUNDPIPE_SITE to a RoundPipe install (pip install --no-deps --target DIR "
                           "-r bench/peers/requirements-roundpipe.txt)")
def test_roundpipe_preset_wraps_the_peft_model_and_steps_the_adapters_only(tmp_path: Path) -> None:
    """With RoundPipe's pinned install (transformers 4.57, peft) first on the path, as on the GPU machine:
    peer_roundpipe's `_inject_lora` on a 2-layer tiny Llama leaves it a `LlamaForCausalLM` whose 28
    adapter tensors (bf16, 8,192 parameters) alone require grad; `wrap_model_to_roundpipe` finds its
    sequential preset for it (prefix, 2 layers, postfix) with peft's Linear inside, and `optim_parameters()`
    yields fp32 copies of exactly the adapters. RoundPipe imports only with CUDA, so its device list's free
    memory and `torch.cuda.Event` are stood in for; nothing runs on a device."""
    directory = write_config(tmp_path, *model_config("tiny-llama", 2, 32))
    script = textwrap.dedent(f"""
        import importlib.util, json, sys, types, torch
        class Event:
            def __init__(self, *args, **kwargs): pass
        torch.cuda.Event = Event
        spec = importlib.util.find_spec("roundpipe")
        package = types.ModuleType("roundpipe")
        package.__path__, package.ENABLE_BEAR = list(spec.submodule_search_locations), False
        sys.modules["roundpipe"] = package  # its __init__ needs a GPU; the submodules below do not
        import roundpipe.device
        roundpipe.device.get_min_gpu_memory = lambda: 24.0
        from roundpipe.run_config import RoundPipeRunConfig
        from roundpipe.wrapper import wrap_model_to_roundpipe
        from peers.hfmodel import build_model
        from peers.peer_roundpipe import _inject_lora
        from peers.workload import Lora
        model = build_model({str(directory)!r}, dtype=torch.bfloat16, seed=0, init_device="cpu")
        info = _inject_lora(model, Lora(rank=4, alpha=8.0), 0)
        wrapped = wrap_model_to_roundpipe(model, use_sequential_preset=True, optim_dtype=torch.float32,
                                          pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=2))
        optim = list(wrapped.optim_named_parameters())
        print(json.dumps({{"class": type(model).__name__, "info": info, "stages": wrapped.num_layers,
               "inner": type(wrapped.layers[1].layer.self_attn.q_proj).__module__,
               "optim": [n.split(".", 2)[2] for n, _ in optim], "optim_params": sum(p.numel() for _, p in optim),
               "optim_dtypes": sorted({{str(p.dtype) for _, p in optim}})}}))
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROUNDPIPE_SITE), str(BENCH)])}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert (got["class"], got["stages"], got["inner"]) == ("LlamaForCausalLM", 4, "peft.tuners.lora.layer")
    assert (got["info"]["adapter_tensors"], got["info"]["adapter_params"], got["info"]["adapter_dtype"]) == (
        28, 8192, "bfloat16")
    assert (len(got["optim"]), got["optim_params"], got["optim_dtypes"]) == (28, 8192, ["torch.float32"])
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in got["optim"])
