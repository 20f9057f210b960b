"""A run's Chrome trace: every rank's records as one Timeline, and what `tinypipe replay` needs to recompile it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinypipe.ir.timeline import Timeline

if TYPE_CHECKING:
    from ..rank.worker import RankResult
    from .prepare import RunPlan


def timeline(plan: RunPlan, results: list[RankResult]) -> Timeline:
    """All ranks' records and device-memory samples as one Timeline (source cpu or cuda)."""
    records = tuple(r for res in results for r in res.records)
    memory = {f"g{res.rank}": tuple(res.memory) for res in results}
    return Timeline(records, memory, source=plan.job.backend,
                    meta={"model": plan.spec.name, "policy": plan.policy.name, "hardware": plan.hardware.name})


def save_trace(plan: RunPlan, results: list[RankResult], path: str | Path, tl: Timeline | None = None) -> None:
    """Write the run's Chrome trace to `path`: its records (`tl`, else `timeline`), each rank's issue spans
    (`RankResult.issue`) and other host spans (`RankResult.host`), and `trace_data`."""
    tl = tl or timeline(plan, results)
    tl.save_chrome_trace(path, other_data=trace_data(plan, results, origin_s=tl.start_s),
                         issue={f"g{res.rank}": res.issue for res in results},
                         host={f"g{res.rank}": res.host for res in results})


def trace_data(plan: RunPlan, results: list[RankResult], origin_s: float | None = None) -> dict[str, Any]:
    """A run's Chrome trace otherData: `run` (`replay_record`); with `origin_s` (the trace's zero on
    `time.perf_counter`'s clock) `origin_unix_s`, that instant on the wall clock, to line the trace up with
    what other tools sampled meanwhile (e.g. the host's /proc/stat); and, with
    --trace-memory, `action_peaks`: per device, [record id, the allocator's peak bytes up to the end of that
    action's issue] (RunLog.peaks)."""
    out: dict[str, Any] = {"run": replay_record(plan)}
    if origin_s is not None:
        out["origin_unix_s"] = time.time() - (time.perf_counter() - origin_s)
    peaks = {f"g{res.rank}": [[rid, b] for _, rid, b in res.peaks] for res in results if res.peaks}
    if peaks:
        out["action_peaks"] = peaks
    return out


def replay_record(plan: RunPlan) -> dict[str, Any]:
    """What `tinypipe replay` needs to recompile this run's schedule (a trace's `otherData.run`): the
    model's config, the hardware and policy as compiled, the workload, the window (K, id stride), and
    the profile trace the run was planned with (its prediction's costs)."""
    from tinypipe.common.jsonio import load_json
    from tinypipe.describe.hfconfig import config_path

    s, job = plan.schedule, plan.job
    # packs pinned as --resume pins them: the packer's choice can depend on rates measured at start-up
    policy = (plan.compiled_policy or plan.policy).replace(packing=tuple(len(p) for p in s.pack_layers),
                                                           mapping=tuple(s.pack_gpu))
    return {"model": job.model, "model_name": plan.spec.name, "model_config": load_json(config_path(job.model)[0]),
            "hardware": plan.hardware.to_json(), "policy": policy.to_json(),
            "seq_len": job.seq_len, "microbatches": s.microbatches, "microbatch_size": job.microbatch_size,
            "batch_tokens": plan.batch_tokens, "gpus": plan.world, "gpu_mem_bytes": job.gpu_mem_bytes,
            "dtype": s.compute_dtype, "backend": job.backend, "steps": job.steps, "iterations": s.iterations,
            "id_stride": len(s.actions), "profile": plan.trace.to_json()}
