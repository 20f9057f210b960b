"""`tinypipe run` refuses, before training, a policy whose predicted host peak exceeds this machine's memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from conftest import fixed_cpu_hardware, parse_run  # noqa: E402
from tinypipe.backends import launch as launch_mod  # noqa: E402
from tinypipe.backends import prepare as plan_mod  # noqa: E402
from tinypipe.backends.hostfit import check_host_fits  # noqa: E402
from tinypipe.backends.prepare import make_run_plan  # noqa: E402

from tinypipe.cli import main  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402
from tinypipe.describe import thismachine  # noqa: E402
from tinypipe.policy import Policy  # noqa: E402

SEQ = 16




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
    """Replicated over MemAvailable but compact under it: the one-line refusal names the peak, the limit and
    where it comes from, and the compact variant's predicted need."""
    out = str(tmp_path / "run")
    compact_plan = make_run_plan(parse_run("--policy", _policy(tmp_path, "compact"), "--out", out))
    compact = compact_plan.prediction.peak_host_bytes
    replicated = make_run_plan(parse_run("--policy", _policy(tmp_path, "replicated"), "--out", out))
    assert replicated.prediction.peak_host_bytes > compact
    limit_kib = (compact + replicated.prediction.peak_host_bytes) // 2 // 1024
    here.write_text(f"MemTotal: 1 kB\nMemAvailable:   {limit_kib} kB\n")
    with pytest.raises(InputError) as info:
        make_run_plan(parse_run("--policy", _policy(tmp_path, "replicated"), "--out", out))
    msg = str(info.value)
    assert "\n" not in msg
    assert "policy 'replicated' needs" in msg and "(MemAvailable) this run may take" in msg
    assert "with host_memory compact in the policy it needs" in msg and msg.endswith("and fits")
    # --host-mem overrides what the machine says
    make_run_plan(parse_run("--policy", _policy(tmp_path, "replicated"), "--out", out, "--host-mem", "1GiB"))


def test_the_command_exits_2_before_training(tmp_path: Path, here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Too little memory for any variant: exit code 2, one `error:` line, no worker started."""
    here.write_text("MemAvailable:   1 kB\n")
    assert main(["run", "--seq-len", str(SEQ), "--batch-tokens", str(SEQ * 4), "--steps", "2",
                 "--out", str(tmp_path / "run")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "no variant of this policy fits" in err[0]


def test_check_host_fits_tries_the_least_change_first() -> None:
    """Under the limit nothing happens; over it, the first variant under the limit is named."""
    p = Policy(name="p", host_memory="replicated", activation_home="host")
    seen: list[tuple[str, str]] = []

    def predict(q: Policy) -> int | None:
        seen.append((str(q.host_memory), str(q.activation_home)))
        return 50 if q.activation_home == "gpu" else 150

    check_host_fits(p, 100, (100, "x"), predict)
    assert seen == []
    with pytest.raises(InputError, match="with activation_home gpu in the policy it needs"):
        check_host_fits(p, 200, (100, "x"), predict)
    assert seen == [("compact", "host"), ("replicated", "gpu")]
