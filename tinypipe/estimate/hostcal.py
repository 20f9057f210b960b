"""Launch-time calibration: this machine's host rates, measured now or cached, applied to a plan's hardware and traces.

A plan is most sensitive to what varies between machines of one kind: the host optimizer's step rate
(on three H200 machines of one kind the AdamW block step took 62.5 ms on one and 238.8 ms on another,
the second under 3.3% hypervisor steal: issue 26) and the host <-> device copy rates. The rates
(`tinypipe profile`'s rates.json, `backends/profile/rates.py`) go into the hardware description
(`with_rates`: links, DMA cap, the optimizer's layout rates), and every measured trace's host optimizer
step is scaled by how much slower or faster this host steps each layout than the one the hardware
description (and its traces) measured (`calibrated_profiles`). Compute (GEMM) times are not
recalibrated: they vary little between machines of one GPU model.

The cache: `tinypipe run --backend cuda` writes what it measured to
`$TINYPIPE_CACHE` (default `~/.cache/tinypipe`) / `<machine fingerprint>` / `rates-<device>-t<threads>-<dtype>.json`;
the fingerprint (`thismachine.fingerprint`) covers the host name, this boot, the CPU model and count,
the memory and the GPU models, so a new VM, a reboot or another machine never reads it. A cached file
is reused for MAX_AGE_S after it was measured: steal and co-tenants change over hours, and a
measurement takes seconds, so an older one is measured again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.common.units import MIB
from tinypipe.describe.hardware import Hardware, Host
from tinypipe.describe.optimprofile import OptimizerProfile
from tinypipe.describe.thismachine import fingerprint
from tinypipe.describe.trace import ProfileTrace, measured_traces
from tinypipe.estimate.hostmem import optimizer_s_per_param, step_bytes_per_param
from tinypipe.policy.modes import HostMemory

FORMAT = "tinypipe-host-rates-v1"
MAX_AGE_S = 6 * 3600.0
CACHE_ENV = "TINYPIPE_CACHE"
RATE_FIELDS = ("h2d_gbps", "d2h_gbps", "bidir_gbps", "copy_latency_s", "adam_params_per_s",
               "replicated_params_per_s", "compact_params_per_s", "threads")


def cache_dir() -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tinypipe")
    return root / fingerprint()


def cache_file(device: str, threads: int, dtype: str) -> Path:
    """Where this machine's rates for `device` ("cuda" or "cpu"), `threads` and `dtype` are cached."""
    return cache_dir() / f"rates-{device}-t{threads}-{dtype}.json"


def check_rates(obj: Any, where: str) -> dict[str, Any]:
    """A rates.json object (`tinypipe profile`, or the cache), checked; InputError naming what is wrong."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise InputError(f"{where}: not a host rates file ({FORMAT}, as `tinypipe profile` writes rates.json)")
    for k in RATE_FIELDS:
        v = obj.get(k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v > 0 or (k == "copy_latency_s" and v == 0)):
            raise InputError(f"{where}: {k}: expected a positive number, got {v!r}")
    return obj


def read_cached(path: Path, *, max_age_s: float = MAX_AGE_S, now_s: float | None = None) -> dict[str, Any] | None:
    """The cached rates at `path` if they are no older than `max_age_s` (by `measured_unix_s`); else None."""
    try:
        obj = json.loads(path.read_text())
        rates = check_rates(obj, str(path))
    except (OSError, ValueError, InputError):
        return None
    age = (time.time() if now_s is None else now_s) - float(rates.get("measured_unix_s", 0.0))
    return rates if 0 <= age <= max_age_s else None


def write_cache(path: Path, rates: Mapping[str, Any]) -> None:
    """Write `rates` (with `measured_unix_s`) atomically; a cache that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(dict(rates), indent=1))
        tmp.replace(path)
    except OSError:
        pass


def load_rates(arg: str) -> dict[str, Any]:
    """`--calibration`: `here` (this machine's freshest cached rates, any thread count) or a rates.json / a
    `tinypipe profile` output directory holding one."""
    if arg == "here":
        found = sorted(cache_dir().glob("rates-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for p in found:
            rates = read_cached(p)
            if rates is not None:
                return rates
        raise InputError(f"--calibration here: no calibration of this machine younger than {MAX_AGE_S / 3600:g} h in "
                         f"{cache_dir()} (`tinypipe run --backend cuda` measures and caches one; or give a "
                         "`tinypipe profile` rates.json)")
    p = Path(arg)
    p = p / "rates.json" if p.is_dir() else p
    try:
        return check_rates(json.loads(p.read_text()), str(p))
    except OSError as exc:
        raise InputError(f"--calibration {arg}: cannot read {p}: {exc.strerror or exc}") from None
    except ValueError:
        raise InputError(f"--calibration {arg}: {p} is not JSON") from None


def with_rates(base: Hardware, r: Mapping[str, Any]) -> Hardware:
    """`base` with rates `r`: each GPU's own PCIe link at min(H2D, D2H) with the measured fixed cost, the
    host's AdamW and layout rates, and (one-GPU presets) the host DMA cap and memory links at the measured
    two-way total; a preset of several GPUs keeps its DMA cap unless this one GPU exceeded it. GEMM rates,
    memory sizes and GPU <-> GPU links stay the preset's (not measured)."""
    gpus = {g.name for g in base.gpus}
    one = len(base.gpus) == 1
    dma = r["bidir_gbps"] if one else max(base.host.dma_gbps, r["bidir_gbps"])
    link = min(r["h2d_gbps"], r["d2h_gbps"])
    links = []
    for x in base.links:
        if x.kind == "pcie" and (x.a in gpus or x.b in gpus):
            x = replace(x, gbps=link, latency_s=r["copy_latency_s"])
        elif x.kind == "mem":
            x = replace(x, gbps=dma if one else max(x.gbps, dma))
        links.append(x)
    host = Host(memory_bytes=base.host.memory_bytes, dma_gbps=dma, cpu_cores=base.host.cpu_cores,
                adam_params_per_s=r["adam_params_per_s"], replicated_params_per_s=r["replicated_params_per_s"],
                compact_params_per_s=r["compact_params_per_s"],
                compact_bf16_params_per_s=r.get("compact_bf16_params_per_s"),
                compact_8bit_params_per_s=r.get("compact_8bit_params_per_s"), mem_gbps=r.get("host_mem_gbps"))
    adam = r["adam_params_per_s"]
    source = (f"{base.name} with rates measured on {r.get('device', 'this machine')}, {r.get('when', '')}: GPU links "
              f"{link:.1f} GB/s (min of H2D {r['h2d_gbps']:.1f}, D2H {r['d2h_gbps']:.1f}, "
              f"{int(r.get('copy_bytes', 0)) // MIB} MiB copies) with a {r['copy_latency_s'] * 1e6:.1f} us fixed "
              f"cost; both directions at once {r['bidir_gbps']:.1f} GB/s -> host DMA cap {dma:.1f} GB/s; fused AdamW "
              f"{adam / 1e9:.3g} G params/s on {r['threads']} threads (compact step "
              f"{adam / r['compact_params_per_s']:.2f} x, replicated {adam / r['replicated_params_per_s']:.2f} x its "
              f"time; the simulator takes these measured layouts' rates). Not measured, kept from the preset: GEMM "
              f"rates, memory sizes, GPU <-> GPU links. The preset: {base.source}")
    return Hardware(name=f"{base.name}-measured", provenance="measured", source=source, host=host, gpus=base.gpus,
                    switches=base.switches, links=tuple(links), gpu_p2p=base.gpu_p2p)


def slowdown(reference: Host, here: Host) -> dict[HostMemory, float]:
    """Per layout, this host's optimizer seconds per parameter over the reference host's."""
    return {lay: optimizer_s_per_param(here, lay) / optimizer_s_per_param(reference, lay) for lay in HostMemory}


def _scaled(opt: OptimizerProfile, factor: Mapping[HostMemory, float]) -> OptimizerProfile:
    def by(times: Mapping[str, float]) -> dict[str, float]:
        return {lay: t * factor[HostMemory(lay)] for lay, t in times.items()}

    return replace(opt, alone_s=by(opt.alone_s), in_run_s=by(opt.in_run_s), async_in_run_s=by(opt.async_in_run_s),
                   async_alone_s=by(opt.async_alone_s), beside_fwd_s=by(opt.beside_fwd_s),
                   beside_bwd_s=by(opt.beside_bwd_s), async_beside_fwd_s=by(opt.async_beside_fwd_s),
                   async_beside_bwd_s=by(opt.async_beside_bwd_s))


def calibrated_profiles(traces: Sequence[ProfileTrace], factor: Mapping[HostMemory, float],
                        gpu_model: str) -> tuple[ProfileTrace, ...]:
    """`traces` then the shipped measured ones of `gpu_model`, each kind's host optimizer step scaled by
    `factor` (what `--profile` takes: they are chosen before the shipped ones)."""
    pool = list(traces) + [t for t in measured_traces() if t.gpu_model.casefold() == gpu_model.casefold()]
    out = []
    for t in pool:
        kinds = {k: replace(p, optimizer=_scaled(p.optimizer, factor)) if p.optimizer is not None else p
                 for k, p in t.kinds.items()}
        note = ", ".join(f"{lay} x{f:.2f}" for lay, f in factor.items())
        out.append(replace(t, kinds=kinds, source=f"{t.source}; host optimizer steps calibrated to this host ({note})"))
    return tuple(out)


def _rate(per_s: float) -> str:
    return f"{per_s / 1e9:.2f} G params/s" if per_s >= 1e9 else f"{per_s / 1e6:.1f} M params/s"


def calibrate(base: Hardware, rates: Mapping[str, Any],
              traces: Sequence[ProfileTrace] = ()) -> tuple[Hardware, tuple[ProfileTrace, ...], str]:
    """The hardware and profiles to plan with on the host `rates` describe, and a line saying what changed."""
    here = with_rates(base, rates)
    factor = slowdown(base.host, here.host)
    line = (f"host optimizer {_rate(rates['adam_params_per_s'])} AdamW, compact step "
            f"{_rate(rates['compact_params_per_s'])}, replicated {_rate(rates['replicated_params_per_s'])} on "
            f"{rates['threads']} thread(s) (steps x{factor[HostMemory.COMPACT]:.2f} compact, "
            f"x{factor[HostMemory.REPLICATED]:.2f} replicated against {base.name}); copies H2D "
            f"{rates['h2d_gbps']:.1f}, D2H {rates['d2h_gbps']:.1f}, both {rates['bidir_gbps']:.1f} GB/s")
    mem, beside = rates.get("host_mem_gbps"), rates.get("compact_beside_copies_params_per_s")
    if mem:
        line += f"; host memory {mem:.1f} GB/s"
    if mem and beside:
        model = step_beside_copies(rates["compact_params_per_s"], mem, rates["h2d_gbps"])
        line += (f"; compact step beside host -> device copies {_rate(beside)} (the shared-memory model: "
                 f"{_rate(model)})")
    return here, calibrated_profiles(traces, factor, base.gpus[0].model), line


def step_beside_copies(compact_params_per_s: float, mem_gbps: float, copy_gbps: float) -> float:
    """The compact fp32 step's rate (params/s) while copies at `copy_gbps` pass through host memory, as the simulator
    shares DRAM (`mem_gbps`) between them: max-min fair, each at most its own rate."""
    own = compact_params_per_s * step_bytes_per_param() / 1e9  # GB/s the step moves alone
    if own + copy_gbps <= mem_gbps:
        return compact_params_per_s
    share = max(mem_gbps - copy_gbps, mem_gbps / 2)
    return min(own, share) * 1e9 / step_bytes_per_param()
