"""`--compile`: the decoder blocks through one torch.compile'd function per block structure.

The CPU tests compile with dynamo's `aot_eager` backend: the same graph capture and autograd split as
on a GPU, without generating kernels, so the results must equal eager ones exactly.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from test_interpreter import K, assert_same_training, compiled, job, reference  # noqa: E402

from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.model.compiled import LayerCaller  # noqa: E402
from tinypipe.backends.model.hf import build_model  # noqa: E402
from tinypipe.backends.rank.worker import strip_parameters  # noqa: E402
from tinypipe.policy import PRESETS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_blocks_share_one_graph_and_equal_eager() -> None:
    """Two blocks of one model: the compiled call equals the eager one (output and every gradient),
    and both run through one compiled function."""
    stack = build_model("tiny-llama", seed=0, only={1, 2})
    state = stack.state()
    for i in (1, 2):
        strip_parameters(stack.layers[i])
    x = torch.randn(2, 16, stack.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    eager, comp = LayerCaller(), LayerCaller(compile_blocks=True, backend="aot_eager")
    for layer in (1, 2):
        outs, grads = [], []
        for call in (eager, comp):
            w = {n: t.detach().requires_grad_() for n, t in state[layer].items()}
            xin = x.detach().requires_grad_()
            out = call(stack.layers[layer], w, (xin,))
            outs.append(out)
            grads.append(torch.autograd.grad(out.square().sum(), [xin, *w.values()]))
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
        for a, b in zip(grads[0], grads[1]):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert comp.graphs == 1
    assert eager.graphs == 0


@pytest.mark.parametrize("staleness", [0, 1])
def test_compiled_pipeline_trains_like_the_reference(staleness: int) -> None:
    """A 2-rank pipeline with compiled blocks (recomputing and not) trains as the reference does."""
    for recompute in (True, False):
        policy = PRESETS["tinypipe"].replace(recompute=recompute, optimizer="async" if staleness else "sync")
        j = dataclasses.replace(job("tiny-llama", compiled("tiny-llama", policy, 2), K, staleness=staleness),
                                compile_blocks=True, compile_backend="aot_eager")
        assert_same_training(run_threads(j, 2), reference("tiny-llama", K, staleness=staleness))


@pytest.mark.parametrize("freeze", ["1", "0"])
def test_compiled_run_settles_the_heap_after_its_first_iteration(freeze: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With compiled blocks each rank runs iteration 0 alone, then collects and freezes the heap once
    (a span on its host thread between iteration 0's work and iteration 1's), and unfreezes it when the
    run ends; TINYPIPE_GC_FREEZE=0 leaves the collector alone."""
    import gc

    monkeypatch.setenv("TINYPIPE_GC_FREEZE", freeze)
    j = dataclasses.replace(job("tiny-llama", compiled("tiny-llama", PRESETS["tinypipe"], 2), K),
                            compile_blocks=True, compile_backend="aot_eager")
    results = run_threads(j, 2)
    assert gc.get_freeze_count() == 0
    for r in results:
        settles = [(t0, t1) for name, t0, t1 in r.host if name == "gc collect + freeze"]
        assert len(settles) == (1 if freeze == "1" else 0), r.host
        if settles:
            end0 = max(rec.end_s for rec in r.records if rec.iteration == 0)
            start1 = min(rec.start_s for rec in r.records if rec.iteration == 1)
            assert end0 <= settles[0][0] < settles[0][1] <= start1


def test_which_runs_settle_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled runs on any backend and every CUDA run settle the heap; an eager CPU run does not; the
    knob turns it off for all."""
    from tinypipe.backends.rank.hostwork import settle_heap_enabled

    monkeypatch.delenv("TINYPIPE_GC_FREEZE", raising=False)
    assert settle_heap_enabled(True, "cpu") and settle_heap_enabled(True, "cuda")
    assert settle_heap_enabled(False, "cuda") and not settle_heap_enabled(False, "cpu")
    monkeypatch.setenv("TINYPIPE_GC_FREEZE", "0")
    assert not any(settle_heap_enabled(c, b) for c in (True, False) for b in ("cpu", "cuda"))
