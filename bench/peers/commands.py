"""The command line and environment of one configuration's peer process: plain `python -m` for one
process, `torchrun` for one process per GPU, the private install directory (RoundPipe's transformers 4.57,
DeepSpeed) first on the PYTHONPATH of that process only, the GPUs it may see."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from peers.runs import Config
from peers.workload import Workload

INSTALL_LOG = ".install.log"  # bench/device/peers.sh writes the install's output here, in the site directory
INSTALL_RC = ".install.rc"  # and its exit status here
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Paths:
    """Where things are: the interpreter, bench/ (the `peers` package's parent), the model's config
    directory, the folder for records and logs, and each private install directory by name."""

    python: str
    bench: Path
    config_dir: Path
    work: Path
    sites: Mapping[str, Path]


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    result_prefix: Path
    ranks: int  # record files to expect: <result_prefix>.rank<R>.json
    steps: int
    warmup: int


def launch_for(cfg: Config, paths: Paths, work: Workload, *, timed_steps: int, warmup: int, device: str,
               base_env: Mapping[str, str] | None = None) -> Launch:
    """How to start `cfg`'s peer process."""
    run = cfg.run
    warm = warmup + run.extra_warmup
    steps = warm + timed_steps
    prefix = paths.work / cfg.key
    args = ["--config", str(paths.config_dir), "--mode", run.mode, "--gpus", str(cfg.gpus),
            "--gpu-mem-gib", "none" if cfg.cap_gib is None else f"{cfg.cap_gib:g}", "--steps", str(steps),
            "--warmup", str(warm), "--result", str(prefix), "--device", device, *work.argv()]
    if run.variant:
        args += ["--variant", run.variant]
    ranks = 1
    if run.launcher == "torchrun" and cfg.gpus > 1:
        argv = [paths.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.gpus}",
                "-m", run.module, *args]
        ranks = cfg.gpus
    else:
        argv = [paths.python, "-m", run.module, *args]
    env = {k: v for k, v in (os.environ if base_env is None else base_env).items() if k not in DIST_VARS}
    path = [str(paths.bench)]
    if run.site:
        site = paths.sites[run.site]
        path.insert(0, str(site))
        env["PATH"] = f"{site / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["PEERS_INSTALL_LOG"] = str(site / INSTALL_LOG)
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cuda":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(cfg.gpus)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:cfg.gpus])
    return Launch(argv=argv, env=env, result_prefix=prefix, ranks=ranks, steps=steps, warmup=warm)


def site_problem(cfg: Config, paths: Paths) -> str | None:
    """Why `cfg`'s private install cannot be used (missing, or its install failed), or None."""
    if not cfg.run.site:
        return None
    site = paths.sites[cfg.run.site]
    if not site.is_dir():
        return (f"{cfg.run.system} is not installed: {site} does not exist (bench/device/peers.sh installs it "
                f"from .peers/wheels)")
    rc_file = site / INSTALL_RC
    if rc_file.is_file() and rc_file.read_text().strip() not in ("", "0"):
        log = site / INSTALL_LOG
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.is_file() else ["(no install log)"]
        return f"{cfg.run.system}'s install failed (exit {rc_file.read_text().strip()}):\n" + "\n".join(tail)
    return None
