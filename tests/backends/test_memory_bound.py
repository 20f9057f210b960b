"""The fit check's GPU peak bounds the CPU backend's own ledger, for either activation home and prefetch depth.

The run's ledger applies the schedule's memory effects in the order the run issued and finished its actions;
the prediction is `sim.guard.simulate_policy`'s, what `run` refuses by, `simulate` prints and `search` ranks.
The model is tiny-llama with 12 blocks, so that its gradients outweigh its activations, as an 8B's do when its
activations live on the host (evidence/h200-2026-12-05: predicted 8.26 GiB, the run's ledger 13.30, its host
optimizer 2.6 x slower than planned). Each case runs with the host as it is, then with every host optimizer
step 50 ms slower (slow beside milliseconds of layer work even on a loaded 2-core machine): under the compact
layout's gradient ring a sync backward then goes on while its gradients wait on the GPU for host slots.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import fixed_cpu_hardware  # noqa: E402
from test_interpreter import MBS, MBS_PER_STEP, SEQ, K, job  # noqa: E402

from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.rank import hostwork  # noqa: E402
from tinypipe.describe.hfconfig import config_path, load_model  # noqa: E402
from tinypipe.describe.trace import analytic_trace  # noqa: E402
from tinypipe.policy import PRESETS  # noqa: E402
from tinypipe.sim import simulate  # noqa: E402
from tinypipe.sim.guard import simulate_policy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCKS = 12
SLOW_STEP_S = 0.05


@pytest.fixture(scope="module")
def deep_tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A config.json of tiny-llama with BLOCKS decoder layers."""
    cfg = json.loads(config_path("tiny-llama")[0].read_text())
    cfg["num_hidden_layers"] = BLOCKS
    path = Path(tmp_path_factory.mktemp("models")) / "tiny-llama-12.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("slow_host", [False, True], ids=["host as it is", "host slow"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("home", ["gpu", "host"])
def test_predicted_gpu_peak_bounds_the_runs_ledger(deep_tiny: str, home: str, depth: int, slow_host: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU, packs of 2 layers swapped layer by layer, nothing resident, compact, sync, 3 steps: the run's
    ledger peak is at most the predicted GPU peak; with the slow host, above the simulator's peak at the planned
    host rate (which the prediction was before the bound)."""
    if slow_host:
        submit = hostwork.HostWorker.submit

        def slow(self: hostwork.HostWorker, before: object, work: object) -> object:
            def late() -> object:
                time.sleep(SLOW_STEP_S)
                return work()  # type: ignore[operator]
            return submit(self, before, late)  # type: ignore[arg-type]

        monkeypatch.setattr(hostwork.HostWorker, "submit", slow)
    spec, hw = load_model(deep_tiny), fixed_cpu_hardware(1)
    packs = len(spec.layers) // 2
    policy = PRESETS["tinypipe"].replace(packing=(2,) * packs, mapping=(0,) * packs, resident="none",
                                         activation_home=home, prefetch_depth=depth, optimizer="sync",
                                         microbatches=MBS_PER_STEP, microbatch_size=MBS)
    trace = analytic_trace(spec, hw.gpus[0], microbatch_size=MBS, seq_len=SEQ, dtype="fp32")
    sched, predicted = simulate_policy(policy, spec, hw, trace, iterations=K)
    (r,) = run_threads(job(deep_tiny, sched, K), 1)
    assert not r.ledger_problems, r.ledger_problems[:3]
    assert 0 < r.ledger_peak["g0"] <= predicted.peak_bytes["g0"]
    if slow_host:
        assert simulate(sched, spec, hw, trace).peak_bytes["g0"] < r.ledger_peak["g0"]
