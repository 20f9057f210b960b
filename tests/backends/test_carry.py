"""Host optimizer steps carried across window boundaries (`executor.Carried`).

A window returns once its device work is done; OPT_STEPs still on the host worker run on while the
next window starts. Forced here: the embedding's update of the last step of the first window waits
until the next window's forward has reached layer 1, which under the asynchronous optimizer needs
no update of that step. A window that drained its optimizer before returning would never get there
(the wait times out and the test fails); the training must still equal the reference's.
"""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from test_interpreter import assert_same_training, compiled, job, reference  # noqa: E402

from tinypipe.backends.host.compact import CompactHostState  # noqa: E402
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.rank.interpreter import Interpreter  # noqa: E402
from tinypipe.policy import PRESETS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
WINDOW = 2  # compiled iterations per window: steps 0-1, then 2-3


def test_the_next_window_runs_beside_the_last_windows_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    reached = threading.Event()  # the second window's forward reached layer 1
    waited: list[bool] = []
    step, fwd = CompactHostState.step, Interpreter._fwd

    def held_step(self: CompactHostState, layer: int, **kw: object) -> None:
        if layer == 0 and self.version(0) == WINDOW - 1:  # the embedding's update of step 1
            waited.append(reached.wait(timeout=20))
        step(self, layer, **kw)  # type: ignore[arg-type]

    def noting_fwd(self: Interpreter, a: object, s: int) -> None:
        if s == WINDOW and a.layer == 1:  # type: ignore[attr-defined]
            reached.set()
        fwd(self, a, s)  # type: ignore[arg-type]

    monkeypatch.setattr(CompactHostState, "step", held_step)
    monkeypatch.setattr(Interpreter, "_fwd", noting_fwd)
    policy = PRESETS["tinypipe"].replace(optimizer="async", host_memory="compact")
    results = run_threads(job("tiny-llama", compiled("tiny-llama", policy, 1, iterations=WINDOW), 4, staleness=1), 1)
    assert waited == [True]
    assert_same_training(results, reference("tiny-llama", 4, staleness=1))
    recs = {(r.kind, r.layer, r.iteration) for r in results[0].records}
    assert ("OPT_STEP", 0, 1) in recs and ("OPT_STEP", 0, 3) in recs  # carried steps are recorded too
