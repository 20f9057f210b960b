"""The learning-rate schedule equals transformers' schedules step by step; the pipeline applies it and
the weight-decay groups exactly as the single-process reference does; the lr default by model size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_interpreter import LLAMA, OPTIM, SEQ, assert_same_training, compiled, job  # noqa: E402

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.host.optim_rules import (  # noqa: E402
    NOT_OF_THE_STEP,
    SCHEDULES,
    LRSchedule,
    decays,
    default_lr,
    lr_schedule,
    schedule_params,
    warmup_steps,
)
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.rank.reference import reference_train  # noqa: E402
from tinypipe.common.errors import InputError  # noqa: E402
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


# (transformers' lr_scheduler_type, lr_scheduler_kwargs, warmup steps): every schedule that is a function of the step
HF_CASES = [
    ("constant", {}, 0), ("constant_with_warmup", {}, 5), ("linear", {}, 5), ("cosine", {}, 5),
    ("cosine", {"num_cycles": 1.5}, 0), ("cosine_with_restarts", {}, 5), ("cosine_with_restarts", {"num_cycles": 3}, 4),
    ("polynomial", {}, 5), ("polynomial", {"lr_end": 1e-4, "power": 2.0}, 3), ("inverse_sqrt", {}, 5),
    ("inverse_sqrt", {}, 0), ("inverse_sqrt", {"timescale": 20}, 5), ("cosine_with_min_lr", {"min_lr_rate": 0.1}, 5),
    ("cosine_with_min_lr", {"min_lr": 2e-4, "num_cycles": 1.0}, 0),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}, 5),
    ("cosine_warmup_with_min_lr", {"min_lr": 1e-4, "warmup_lr_rate": 0.2}, 6),
    ("warmup_stable_decay", {"num_decay_steps": 20}, 5),
    ("warmup_stable_decay", {"num_decay_steps": 10, "num_stable_steps": 30, "warmup_type": "cosine",
                             "decay_type": "1-sqrt", "min_lr_ratio": 0.05}, 6),
    ("warmup_stable_decay", {"num_decay_steps": 15, "warmup_type": "1-sqrt", "decay_type": "linear",
                             "min_lr_ratio": 0.1}, 8),
]


@pytest.mark.filterwarnings("ignore:Both num_training_steps and num_stable_steps")
@pytest.mark.parametrize(("name", "kwargs", "warmup"), HF_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(HF_CASES)])
def test_each_transformers_schedule_name_gives_transformers_lr_for_50_steps(name: str, kwargs: dict,
                                                                             warmup: int) -> None:
    """`--lr-schedule NAME --lr-schedule-kwargs JSON` gives, at each of 50 optimizer steps, the lr that
    transformers' get_scheduler(NAME, scheduler_specific_kwargs=JSON) under the same warmup gives a tiny
    optimizer at that step."""
    import transformers

    total, peak = 50, 2e-3
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    sched = transformers.get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total,
                                       scheduler_specific_kwargs=dict(kwargs))
    theirs = []
    for _ in range(total):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = lr_schedule(peak, name, kwargs, warmup, total)
    assert [ours.lr(t) for t in range(total)] == pytest.approx(theirs, rel=1e-12, abs=1e-18)


def test_the_schedule_names_are_transformers_scheduler_types() -> None:
    """Every SchedulerType of transformers is either a schedule here or refused as not a function of the step."""
    from transformers.trainer_utils import SchedulerType

    assert set(SCHEDULES) | set(NOT_OF_THE_STEP) == {s.value for s in SchedulerType}
    assert not set(SCHEDULES) & set(NOT_OF_THE_STEP)


@pytest.mark.parametrize(("name", "kwargs", "match"), [
    ("cosine_annealing", None, "--lr-schedule cosine_annealing: unknown; one of constant, constant_with_warmup, "
                               "linear, cosine, cosine_with_restarts, polynomial"),
    ("reduce_lr_on_plateau", None, "lowers the lr when a metric stops improving, not a function of the step"),
    ("cosine", {"min_lr_rate": 0.1}, "cosine takes no 'min_lr_rate' .*num_cycles"),
    ("linear", {"power": 2}, r"linear takes no 'power' \(its parameters: none\)"),
    ("cosine_with_min_lr", None, "give one of min_lr and min_lr_rate"),
    ("cosine_with_min_lr", {"min_lr": 1e-5, "min_lr_rate": 0.1}, "give one of min_lr and min_lr_rate"),
    ("warmup_stable_decay", {}, "give num_decay_steps"),
    ("warmup_stable_decay", {"num_decay_steps": 2.5}, "num_decay_steps must be a whole number"),
    ("warmup_stable_decay", {"num_decay_steps": 5, "decay_type": "exp"}, "decay_type must be one of linear, cosine"),
    ("polynomial", {"power": "2"}, "power must be a number >= 0, got '2'"),
    ("inverse_sqrt", {"timescale": 0}, "timescale must be a whole number of steps >= 1"),
])
def test_a_wrong_schedule_or_parameter_is_one_line_naming_what_is_allowed(name: str, kwargs: dict | None,
                                                                           match: str) -> None:
    with pytest.raises(InputError, match=match) as info:
        schedule_params(name, kwargs)
    assert "\n" not in str(info.value)


def test_the_command_line_takes_the_names_and_json_parameters(tmp_path: Path) -> None:
    """`run --lr-schedule NAME --lr-schedule-kwargs JSON` settles to the name and the parsed object (what a
    checkpoint records); an unknown name or JSON that is not an object is refused before anything loads."""
    from conftest import parse_run

    from tinypipe.backends.options.settings import record, settle

    out = str(tmp_path / "out")
    opts = settle(vars(parse_run("--lr-schedule", "cosine_with_min_lr", "--lr-schedule-kwargs",
                                 '{"min_lr_rate": 0.1}', "--out", out)))
    assert (opts.lr_schedule, opts.lr_schedule_kwargs) == ("cosine_with_min_lr", {"min_lr_rate": 0.1})
    assert record(opts)["lr_schedule_kwargs"] == {"min_lr_rate": 0.1}
    with pytest.raises(InputError, match="--lr-schedule warmup: unknown; one of constant, "):
        settle(vars(parse_run("--lr-schedule", "warmup", "--out", out)))
    with pytest.raises(InputError, match="--lr-schedule-kwargs 0.1: a JSON object"):
        settle(vars(parse_run("--lr-schedule", "cosine_with_min_lr", "--lr-schedule-kwargs", "0.1", "--out", out)))
    with pytest.raises(InputError, match="--lr-schedule-kwargs {min_lr_rate: 0.1}: not JSON"):
        settle(vars(parse_run("--lr-schedule-kwargs", "{min_lr_rate: 0.1}", "--out", out)))


def test_schedule_parameters_that_need_the_run_are_checked_with_it() -> None:
    """polynomial's lr_end must be below the peak; warmup_stable_decay's warmup and decay must fit the run."""
    with pytest.raises(InputError, match="lr_end 0.01 must be below the peak lr 0.001"):
        lr_schedule(1e-3, "polynomial", {"lr_end": 1e-2}, 0, 10)
    with pytest.raises(InputError, match="3 warmup and 8 decay steps are more than the run's 10"):
        lr_schedule(1e-3, "warmup_stable_decay", {"num_decay_steps": 8}, 3, 10)
    assert lr_schedule(1e-3, "cosine_with_min_lr", {"min_lr_rate": 0.1}, 2, 10).text() == \
        "cosine_with_min_lr (min_lr_rate=0.1)"


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
