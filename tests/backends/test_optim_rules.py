"""The learning-rate schedule equals transformers' schedules step by step; the pipeline applies it and
the weight-decay groups exactly as the single-process reference does; the lr default by model size."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from test_interpreter import LLAMA, OPTIM, SEQ, assert_same_training, compiled, job  # noqa: E402
from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.launch import run_threads  # noqa: E402
from tinypipe.backends.optim_rules import LRSchedule, decays, default_lr, warmup_steps  # noqa: E402
from tinypipe.backends.reference import reference_train  # noqa: E402

from tinypipe.policy import PRESETS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("warmup", "total"), [(0, 1), (0, 17), (3, 17), (10, 10), (25, 500)])
def test_lr_per_step_equals_transformers_schedules(kind: str, warmup: int, total: int) -> None:
    """The lr of optimizer step t is what transformers' get_{constant,linear,cosine}_schedule_with_warmup
    under LambdaLR gives the optimizer at its t-th step (the first step of a warmup at 0)."""
    import transformers

    make = {"constant": lambda o: transformers.get_constant_schedule_with_warmup(o, warmup),
            "linear": lambda o: transformers.get_linear_schedule_with_warmup(o, warmup, total),
            "cosine": lambda o: transformers.get_cosine_schedule_with_warmup(o, warmup, total)}[kind]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2e-3)
    sched = make(opt)
    theirs = []
    for _ in range(total):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = LRSchedule(2e-3, kind, warmup, total)
    assert [ours.lr(t) for t in range(total)] == pytest.approx(theirs, rel=1e-12, abs=1e-18)


def test_warmup_ratio_rounds_up_like_training_arguments() -> None:
    assert warmup_steps(500, steps=None, ratio=0.05) == 25
    assert warmup_steps(30, steps=None, ratio=0.05) == 2  # ceil(1.5)
    assert warmup_steps(30, steps=7, ratio=0.05) == 7
    assert warmup_steps(30, steps=None, ratio=None) == 0


def test_decay_skips_norms_biases_and_the_embedding() -> None:
    assert decays("layer.self_attn.q_proj.weight", 2) and decays("lm_head.weight", 2)
    assert not decays("embed_tokens.weight", 2)
    assert not decays("layer.input_layernorm.weight", 1) and not decays("layer.self_attn.q_proj.bias", 1)
    assert not decays("norm.weight", 1)


def test_lr_default_by_model_size() -> None:
    """3e-3 up to 10M parameters, then falling as 1/sqrt(size), floored at 3e-5."""
    assert default_lr(180_800) == 3e-3 and default_lr(10_000_000) == 3e-3
    assert default_lr(8_030_261_248) == pytest.approx(1.0587e-4, rel=1e-3)
    assert default_lr(10**15) == 3e-5


@pytest.mark.parametrize("layout", ["compact", "replicated"])
def test_pipeline_applies_the_schedule_and_decay_groups_like_the_reference(layout: str) -> None:
    """Five steps through the pipeline (2 ranks, windows of 3 + 2) with a cosine schedule after 2 warmup
    steps and weight decay off for norms and the embedding equal the reference trained the same way."""
    sched = LRSchedule(OPTIM.lr, "cosine", 2, 5)
    optim = dataclasses.replace(OPTIM, weight_decay=0.1, schedule=sched, decay_exempt=True)
    policy = PRESETS["tinypipe"].replace(optimizer="sync", host_memory=layout)
    results = run_threads(dataclasses.replace(job(LLAMA, compiled(LLAMA, policy, 2), 5), optim=optim), 2)
    batches = make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=2, microbatches=2, seed=0)
    ref = reference_train(LLAMA, batches, steps=5, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, weight_decay=0.1,
                          seed=0, schedule=sched, decay_exempt=True)
    assert_same_training(results, ref)
    plain = reference_train(LLAMA, make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=2,
                                                microbatches=2, seed=0),
                            steps=5, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, weight_decay=0.1, seed=0)
    assert ref.losses[0] == plain.losses[0] and ref.losses[1] != plain.losses[1]  # step 0 ran at lr 0
