"""Which configurations the runner makes, and how each one's process is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from peers.commands import INSTALL_LOG, INSTALL_RC, Paths, launch_for, site_problem
from peers.runs import DEFAULT_RUNS, RUNS, Config, configurations, parse_caps, parse_gpus
from peers.workload import Workload


def test_caps_and_gpu_counts_parse_or_say_what_is_wrong() -> None:
    """`24,none` is a 24 GiB cap and none; a bad item, a duplicate or a non-positive value is named."""
    assert parse_caps("24,none") == (24.0, None)
    assert parse_caps("24GiB") == (24.0,)
    assert parse_gpus("1,2") == (1, 2)
    for bad, match in (("24,x", "'x' is neither"), ("0", "must be > 0"), ("24,24", "distinct")):
        with pytest.raises(ValueError, match=match):
            parse_caps(bad)
    for bad in ("0", "1,1", "one"):
        with pytest.raises(ValueError, match="--gpus"):
            parse_gpus(bad)


def test_configurations_in_order_caps_then_gpus_then_runs() -> None:
    """Every run under the first cap before any under the next; the key names run, GPUs and cap."""
    got = [c.key for c in configurations(("fsdp2", "roundpipe"), (1, 2), (24.0, None))]
    assert got == ["fsdp2-1gpu-24gib", "roundpipe-1gpu-24gib", "fsdp2-2gpu-24gib", "roundpipe-2gpu-24gib",
                   "fsdp2-1gpu-uncapped", "roundpipe-1gpu-uncapped", "fsdp2-2gpu-uncapped", "roundpipe-2gpu-uncapped"]
    assert DEFAULT_RUNS[:2] == ("tinypipe", "roundpipe")


def test_workload_splits_or_says_why_not() -> None:
    """65,536 tokens of 2048 are 32 sequences: 8 microbatches of 4 on one GPU, 4 per rank on two."""
    w = Workload()
    assert (w.sequences, w.passes(1), w.passes(2), w.problem(1), w.problem(2)) == (32, 8, 4, None, None)
    assert "do not split into microbatches of 4 on 3 GPU(s)" in str(Workload().problem(3))
    assert "not a multiple of --seq-len" in str(Workload(batch_tokens=1000).problem(1))


def _paths(tmp_path: Path) -> Paths:
    return Paths(python="py", bench=Path("/b"), config_dir=Path("/m"), work=tmp_path,
                 sites={"roundpipe": tmp_path / "rp", "deepspeed": tmp_path / "ds"})


def test_launch_lines(tmp_path: Path) -> None:
    """FSDP2 on two GPUs goes through torchrun (one process per GPU, two records); RoundPipe is one
    process that sees both GPUs, with its private install first on PYTHONPATH and its bin on PATH;
    tinypipe's process never sees a private install; torchrun's variables from outside are dropped;
    RoundPipe and tinypipe warm up one step more than asked."""
    env = {"PYTHONPATH": "/site", "PATH": "/usr/bin", "RANK": "3", "CUDA_VISIBLE_DEVICES": "4,5,6"}
    work = Workload()
    f = launch_for(Config(RUNS["fsdp2"], 2, 24.0), _paths(tmp_path), work, timed_steps=2, warmup=1, device="cuda",
                   base_env=env)
    assert f.argv[:6] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    assert f.argv[6] == "peers.peer_fsdp2" and f.ranks == 2 and (f.steps, f.warmup) == (3, 1)
    assert "RANK" not in f.env and f.env["CUDA_VISIBLE_DEVICES"] == "4,5" and f.env["PYTHONPATH"] == "/b:/site"
    assert f.argv[f.argv.index("--gpu-mem-gib") + 1] == "24"
    r = launch_for(Config(RUNS["roundpipe-sync"], 2, None), _paths(tmp_path), work, timed_steps=2, warmup=1,
                   device="cuda", base_env=env)
    assert r.argv[:3] == ["py", "-m", "peers.peer_roundpipe"] and r.ranks == 1 and (r.steps, r.warmup) == (4, 2)
    assert r.env["PYTHONPATH"] == f"{tmp_path / 'rp'}:/b:/site" and r.env["PATH"].startswith(f"{tmp_path / 'rp'}/bin:")
    assert r.argv[r.argv.index("--mode") + 1] == "sync" and r.argv[r.argv.index("--gpu-mem-gib") + 1] == "none"
    t = launch_for(Config(RUNS["mobius-async"], 1, 24.0), _paths(tmp_path), work, timed_steps=2, warmup=1,
                   device="cuda", base_env=env)
    assert t.env["PYTHONPATH"] == "/b:/site" and t.argv[-2:] == ["--variant", "mobius"]


def test_a_missing_or_failed_install_is_reported_without_starting(tmp_path: Path) -> None:
    """No install directory, or one whose install exited non-zero: the problem names it and quotes the
    install log's end; a good install (or a system without one) has none."""
    cfg = Config(RUNS["deepspeed"], 1, 24.0)
    assert "deepspeed is not installed" in str(site_problem(cfg, _paths(tmp_path)))
    site = tmp_path / "ds"
    site.mkdir()
    (site / INSTALL_RC).write_text("1\n")
    (site / INSTALL_LOG).write_text("Processing deepspeed\nerror: no module named setuptools\n")
    assert site_problem(cfg, _paths(tmp_path)) == ("deepspeed's install failed (exit 1):\nProcessing deepspeed\n"
                                                    "error: no module named setuptools")
    (site / INSTALL_RC).write_text("0\n")
    assert site_problem(cfg, _paths(tmp_path)) is None
    assert site_problem(Config(RUNS["fsdp2"], 1, None), _paths(tmp_path)) is None
