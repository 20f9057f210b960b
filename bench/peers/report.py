"""One result row per configuration, from its peer's records and how its process ended; the JSON file
and the Markdown table of all rows.

Status: `ok` (exit 0 and every rank's record complete), `timeout` (killed at its time limit; the steps it
finished are kept), `failed` (anything else; `error` holds how it ended and its log's last lines),
`skipped` (not started: not enough of the runner's deadline left, or too few GPUs here).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from peers.execute import Outcome
from peers.runs import Config

GIB = 2**30


def read_records(prefix: Path, ranks: int) -> list[dict[str, Any]]:
    """The records `<prefix>.rank<R>.json` that exist and parse, in rank order."""
    out = []
    for r in range(ranks):
        path = Path(f"{prefix}.rank{r}.json")
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def row(cfg: Config, *, records: Sequence[dict[str, Any]], ranks: int, outcome: Outcome | None,
        common: dict[str, Any], skipped: str | None = None, log: str | None = None) -> dict[str, Any]:
    """The result row of `cfg`: rank 0's step times, the peaks (GPU: max over devices; host: summed over
    processes), the status and, unless ok, the error."""
    first = records[0] if records else {}
    warmup = int(first.get("warmup_steps", 0))
    each = [float(x) for x in first.get("iteration_s_each", [])]
    timed = each[warmup:]
    iteration_s = statistics.fmean(timed) if timed else None
    tokens = int(common["tokens_per_step"])
    complete = len(records) == ranks and all(r.get("done") for r in records)
    if skipped is not None:
        status, error = "skipped", skipped
    elif outcome is None:
        status, error = "failed", "not started"
    elif outcome.timed_out:
        status, error = "timeout", outcome.describe() + "\n" + "\n".join(outcome.tail)
    elif outcome.returncode == 0 and complete:
        status, error = "ok", None
    else:
        why = outcome.describe() if outcome.returncode != 0 else "exit code 0 without a complete record"
        status, error = "failed", why + "\n" + "\n".join(outcome.tail)
    gpu = [int(b) for r in records for b in r.get("peak_gpu_bytes", [])]
    reserved = [int(b) for r in records for b in r.get("peak_gpu_reserved_bytes", [])]
    rss = [r.get("peak_host_rss_bytes") for r in records]
    host = sum(rss) if rss and None not in rss else None  # every process's, or none
    pinned = [r.get("pinned_host_bytes") for r in records]
    params = first.get("params") or common.get("params")
    out = {
        "run": cfg.run.name, "system": cfg.run.system, "mode": cfg.run.mode, "variant": cfg.run.variant,
        "gpus": cfg.gpus, "gpu_mem_cap_gib": cfg.cap_gib, **common, "params": params,
        "steps": first.get("steps"), "warmup_steps": first.get("warmup_steps"), "iteration_s_each": each,
        "timed_steps": len(timed), "iteration_s": iteration_s,
        "tokens_per_s": tokens / iteration_s if iteration_s else None,
        "losses": first.get("losses", []), "setup_s": first.get("setup_s"),
        "peak_gpu_bytes": max(gpu) if gpu else None, "peak_gpu_bytes_per_device": gpu,
        "peak_gpu_reserved_bytes": max(reserved) if reserved else None,
        "setup_peak_gpu_bytes": max((int(b) for r in records for b in r.get("setup_peak_gpu_bytes", [])),
                                    default=None),
        "peak_host_rss_bytes": host, "host_rss_bytes_per_param": host / params if host and params else None,
        "pinned_host_bytes": sum(pinned) if pinned and None not in pinned else None,
        "pinned_note": first.get("pinned_note"),
        "status": status, "error": error, "error_summary": _summary(status, outcome, skipped),
        "returncode": None if outcome is None else outcome.returncode,
        "wall_s": None if outcome is None else outcome.wall_s, "device": first.get("device"),
        "versions": first.get("versions", {}), "date": first.get("date"), "cap": first.get("cap"),
        "details": first.get("details", {}), "log": log,
    }
    for extra in ("host_state_bytes", "launcher_peak_rss_bytes", "trainable_params"):
        if extra in first:
            out[extra] = first[extra]
    return out


def _summary(status: str, outcome: Outcome | None, skipped: str | None) -> str | None:
    """One line for a row that is not ok: how it ended, and its log's last line."""
    if status == "ok":
        return None
    if skipped is not None or outcome is None:
        return (skipped or "not started").strip().splitlines()[0]
    last = outcome.tail[-1] if outcome.tail else ""
    return f"{outcome.describe() if outcome.returncode != 0 or outcome.timed_out else 'incomplete record'}: {last}"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write `payload` to `path` atomically (parents made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


HEAD = ("system", "mode", "GPUs", "cap", "status", "tokens/s", "s/step (timed)", "peak GPU GiB (reserved)",
        "host RSS GiB", "RSS B/param", "pinned GiB")


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table; a row that did not finish says how it ended in its status cell."""
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "|".join(" --- " for _ in HEAD) + "|"]
    for r in rows:
        system = r["system"] + (f" ({r['variant']})" if r.get("variant") else "")
        if r.get("lora"):
            system += f" + LoRA r{r['lora']['rank']}"
        status = r["status"]
        if r["status"] != "ok" and r.get("error_summary"):
            status += ": " + _short(r["error_summary"])
        cap = "none" if r["gpu_mem_cap_gib"] is None else f"{r['gpu_mem_cap_gib']:g} GiB"
        cells = (system, r["mode"], str(r["gpus"]), cap,
                 status.replace("|", "/"), _num(r.get("tokens_per_s"), "{:,.0f}"),
                 _steps(r), _gpu(r), _num(_gib(r.get("peak_host_rss_bytes")), "{:.1f}"),
                 _num(r.get("host_rss_bytes_per_param"), "{:.1f}"), _num(_gib(r.get("pinned_host_bytes")), "{:.1f}"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _short(line: str, limit: int = 160) -> str:
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _gib(value: int | None) -> float | None:
    return None if value is None else value / GIB


def _steps(r: dict[str, Any]) -> str:
    if r.get("iteration_s") is None:
        each = r.get("iteration_s_each") or []
        return "warm-up only: " + ", ".join(f"{s:.1f}" for s in each) if each else "-"
    return f"{r['iteration_s']:.2f} ({r['timed_steps']})"


def _gpu(r: dict[str, Any]) -> str:
    if r.get("peak_gpu_bytes") is None:
        return "-"
    reserved = r.get("peak_gpu_reserved_bytes")
    return f"{r['peak_gpu_bytes'] / GIB:.1f}" + ("" if reserved is None else f" ({reserved / GIB:.1f})")
