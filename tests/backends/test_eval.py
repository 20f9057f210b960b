"""Held-out evaluation through the pipeline: the loss of the held-out steps with the weights after step k
equals the reference's, and evaluating changes nothing in training."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_interpreter import LLAMA, MBS, MBS_PER_STEP, OPTIM, SEQ, assert_same_training, compiled, job  # noqa: E402

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.model.hf import build_model  # noqa: E402
from tinypipe.backends.rank.evaluation import eval_steps  # noqa: E402
from tinypipe.backends.rank.reference import reference_train  # noqa: E402
from tinypipe.backends.rank.worker import step_data  # noqa: E402
from tinypipe.policy import PRESETS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
FRACTION = 0.3


def held_out_loss(state: dict, batches: object) -> float:
    """The token-weighted mean loss of every whole held-out step, with `state`'s weights (one process)."""
    stack = build_model(LLAMA, seed=0)
    stack.load_state(state)
    total = tokens = 0.0
    with torch.no_grad():
        for k in range(eval_steps(batches)):
            sd = step_data(batches, k)
            for m, (x, y) in enumerate(sd.microbatches):
                hidden = stack.layers[0](x)
                for block in stack.layers[1:-1]:
                    hidden = block(hidden, sd.documents[m])
                total += float(stack.layers[-1](hidden, y, sd.denom)) * sd.denom
            tokens += sd.denom
    return total / tokens


@pytest.mark.parametrize(("layout", "optimizer"), [("compact", "sync"), ("replicated", "sync"), ("compact", "async"),
                                                   ("replicated", "async")])
def test_held_out_loss_every_two_steps_equals_the_references(tmp_path: Path, layout: str, optimizer: str) -> None:
    """Four steps on two ranks, the last 30% of the packed data held out, evaluated after steps 2 and 4: each
    held-out loss equals the reference model's at that step (a plain forward of the weights after that many
    updates; asynchronous: the last one's gradient applied too, as the host has it once its steps are done),
    and training equals the reference trained on the other 70% (evaluation leaves the host state alone)."""
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(f'{{"text": "line {i}: {"xy" * (i % 7)} and {i * 7}"}}\n' for i in range(80)))
    staleness = 1 if optimizer == "async" else 0
    sched = compiled(LLAMA, PRESETS["tinypipe"].replace(optimizer=optimizer, host_memory=layout), 2)
    run = dataclasses.replace(job(LLAMA, sched, 4, staleness=staleness), data=str(f), eval_fraction=FRACTION,
                              eval_every=2)
    results = run_threads(run, 2)
    shape = {"tokenizer": ByteTokenizer(256), "seq_len": SEQ, "microbatch_size": MBS,
             "microbatches": MBS_PER_STEP, "seed": 0}
    train = make_batches(f, hold_out=FRACTION, **shape)
    held = make_batches(f, hold_out=FRACTION, part="eval", **shape)
    assert eval_steps(held) >= 2 and len(held.source) + len(train.source) == len(make_batches(f, **shape).source)
    refs = {k: reference_train(LLAMA, make_batches(f, hold_out=FRACTION, **shape), steps=k, lr=OPTIM.lr,
                               betas=OPTIM.betas, eps=OPTIM.eps, weight_decay=OPTIM.weight_decay, seed=0,
                               documents=train.documents, async_staleness=staleness) for k in (2, 4)}
    assert_same_training(results, refs[4])
    got = results[0].eval_losses
    assert sorted(got) == [1, 3]
    for k in (2, 4):
        assert got[k - 1] == pytest.approx(held_out_loss(refs[k].state, held), rel=1e-5), k
    assert got[1] != pytest.approx(got[3], rel=1e-3)  # the weights moved between the evaluations
