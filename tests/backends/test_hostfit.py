"""`tinypipe run` refuses, before training, a policy whose predicted host peak exceeds this machine's memory."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

from conftest import (  # noqa: E402
    fixed_cpu_hardware,
    parse_run,
    plan_run,  # noqa: E402
)

from tinypipe.backends.launch import prepare as plan_mod  # noqa: E402
from tinypipe.backends.launch import spawn as launch_mod  # noqa: E402
from tinypipe.backends.launch.hostfit import check_host_fits  # noqa: E402
from tinypipe.cli import main  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402
from tinypipe.describe import thismachine  # noqa: E402
from tinypipe.describe.thismachine import HOST_MARGIN_FRACTION, usable_host_bytes  # noqa: E402
from tinypipe.policy import Policy  # noqa: E402

SEQ = 16
GIB = 2**30


def _limit_kib(usable: int) -> int:
    """The MemAvailable (kB) under which a plan may take `usable` bytes: `usable` plus the margin."""
    return math.ceil(usable / (1 - HOST_MARGIN_FRACTION) / 1024)


def _policy(tmp: Path, layout: str) -> str:
    path = tmp / f"{layout}.json"
    path.write_text(json.dumps({"name": layout, "swap": "layer", "host_memory": layout, "microbatch_size": 2,
                                "resident": "none"}))
    return str(path)


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Fixed CPU hardware, no cgroup limit, and a meminfo file the test writes; no worker may start."""
    monkeypatch.setattr(plan_mod, "cpu_hardware", lambda workers, threads: fixed_cpu_hardware(workers))
    monkeypatch.setattr(thismachine, "CGROUP_LIMITS", ())
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   67108864 kB\n")
    monkeypatch.setattr(thismachine, "MEMINFO", meminfo)
    for name in ("start_processes", "_run_here"):
        monkeypatch.setattr(launch_mod, name, lambda *a, **k: pytest.fail("a worker was started"))
    return meminfo


def test_a_run_over_this_machines_memory_is_refused_with_what_fits(tmp_path: Path, here: Path) -> None:
    """Replicated over MemAvailable less the margin but compact under it: the one-line refusal names the peak,
    the limit, where it comes from and the margin, and the compact variant's predicted need."""
    out = str(tmp_path / "run")
    compact_plan = plan_run(parse_run("--policy", _policy(tmp_path, "compact"), "--out", out))
    compact = compact_plan.prediction.peak_host_bytes
    replicated = plan_run(parse_run("--policy", _policy(tmp_path, "replicated"), "--out", out))
    assert replicated.prediction.peak_host_bytes > compact
    limit_kib = _limit_kib((compact + replicated.prediction.peak_host_bytes) // 2)
    here.write_text(f"MemTotal: 1 kB\nMemAvailable:   {limit_kib} kB\n")
    with pytest.raises(InputError) as info:
        plan_run(parse_run("--policy", _policy(tmp_path, "replicated"), "--out", out))
    msg = str(info.value)
    assert "\n" not in msg
    assert "policy 'replicated' needs" in msg and "(MemAvailable) this run may take less" in msg
    assert f"({HOST_MARGIN_FRACTION:.0%}) for what the prediction may miss" in msg
    assert "with host_memory compact in the policy it needs" in msg and msg.endswith("and fits")
    # --host-mem overrides what the machine says
    plan_run(parse_run("--policy", _policy(tmp_path, "replicated"), "--out", out, "--host-mem", "1GiB"))


def test_the_command_exits_2_before_training(tmp_path: Path, here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Too little memory for any variant: exit code 2, one `error:` line, no worker started."""
    here.write_text("MemAvailable:   1 kB\n")
    assert main(["run", "--seq-len", str(SEQ), "--batch-tokens", str(SEQ * 4), "--steps", "2",
                 "--out", str(tmp_path / "run")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "no variant of this policy fits" in err[0]


def test_check_host_fits_tries_the_least_change_first() -> None:
    """Under the limit less its margin nothing happens; over it, the first variant under it is named."""
    p = Policy(name="p", host_memory="replicated", activation_home="host")
    seen: list[tuple[str, str]] = []

    def predict(q: Policy) -> int | None:
        seen.append((str(q.host_memory), str(q.activation_home)))
        return 50 if q.activation_home == "gpu" else 150

    check_host_fits(p, 92, (100, "x"), predict)
    assert seen == []
    with pytest.raises(InputError, match="with activation_home gpu in the policy it needs"):
        check_host_fits(p, 200, (100, "x"), predict)
    assert seen == [("compact", "host"), ("replicated", "gpu")]


def test_the_margin_refuses_a_peak_that_fits_the_limit_alone() -> None:
    """A plan's predicted host peak may take the limit less 8%: a peak under the limit but over that is
    refused in one line that names the margin; a peak at the limit less the margin passes."""
    p = Policy(name="p", host_memory="compact", activation_home="gpu")  # no variant to try
    limit = (100 * GIB, "100 GiB (--host-mem)")
    assert usable_host_bytes(100 * GIB) == 92 * GIB
    check_host_fits(p, 92 * GIB, limit, lambda q: pytest.fail("a variant was tried"))
    with pytest.raises(InputError) as info:
        check_host_fits(p, 92 * GIB + 1, limit, lambda q: None)
    assert str(info.value) == (
        "policy 'p' needs 92.00 GiB of host memory at its predicted peak, more than the 100 GiB (--host-mem) this "
        "run may take less 8.00 GiB (8%) for what the prediction may miss (docs/memory.md): 92.00 GiB; no variant "
        "of this policy fits (compact layout, activations on the GPU): run on a host with more memory")


def test_a_run_that_fits_memavailable_only_without_the_margin_is_refused(tmp_path: Path, here: Path) -> None:
    """The run's own predicted peak against MemAvailable: refused at the peak itself (it fits the limit, not the
    limit less the margin), planned at the peak plus the margin."""
    out = str(tmp_path / "run")
    argv = ("--policy", _policy(tmp_path, "compact"), "--out", out)
    peak = plan_run(parse_run(*argv)).prediction.peak_host_bytes
    here.write_text(f"MemAvailable:   {math.ceil(peak / 1024)} kB\n")
    with pytest.raises(InputError, match="for what the prediction may miss"):
        plan_run(parse_run(*argv))
    here.write_text(f"MemAvailable:   {_limit_kib(peak)} kB\n")
    assert plan_run(parse_run(*argv)).prediction.peak_host_bytes == peak


def test_search_plans_with_the_same_margin(capsys: pytest.CaptureFixture[str]) -> None:
    """`search --host-mem L` keeps the margin `run` keeps: a winner that fits L alone but not L less 8% gives way
    to one under L less 8%, and a note says what candidates may take."""
    argv = ["search", "--model", "tiny-llama", "--hardware", "h200x1", "--workers", "1", "--seq-len", "512",
            "--batch-tokens", "4096", "--top", "2", "--json"]
    assert main(argv + ["--host-mem", "1GiB"]) == 0
    first = json.loads(capsys.readouterr().out)["winner"]["peak_host_bytes"]
    limit = math.ceil(first / 0.96)  # the first winner fits it, not it less the margin
    assert main(argv + ["--host-mem", str(limit)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["winner"]["peak_host_bytes"] <= usable_host_bytes(limit) < first
    assert re.search(r"note: a candidate's predicted host peak may take [\d.]+ MiB of the [\d.]+ MiB host limit: 8% "
                     "is kept for what a prediction may miss", out.err)
