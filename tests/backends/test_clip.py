"""Clipping by the global gradient norm: a barrier in the schedule (every OPT_STEP of an iteration after
every GRAD_OUT of it), costed by the simulator, met in the backend by an all-reduce of the norm; the
pipeline's clipped training equals the reference's, which equals torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from test_interpreter import LLAMA, MBS, MBS_PER_STEP, OPTIM, SEQ, assert_same_training, compiled, job  # noqa: E402
from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.hf import build_model  # noqa: E402
from tinypipe.backends.launch import run_threads  # noqa: E402
from tinypipe.backends.layers import IGNORE_INDEX  # noqa: E402
from tinypipe.backends.reference import reference_train  # noqa: E402
from tinypipe.sim import simulate  # noqa: E402

from tinypipe.compiler import compile_schedule  # noqa: E402
from tinypipe.compiler.optimizer import norm_barrier  # noqa: E402
from tinypipe.compiler.validate import validate  # noqa: E402
from tinypipe.describe.hardware import load_hardware  # noqa: E402
from tinypipe.describe.hfconfig import load_model  # noqa: E402
from tinypipe.describe.trace import trace_for  # noqa: E402
from tinypipe.ir.schedule import Kind, Schedule  # noqa: E402
from tinypipe.policy import PRESETS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NORM = 0.5  # below the tiny model's gradient norms (~2-5): every step is clipped


def batches() -> object:
    return make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS,
                        microbatches=MBS_PER_STEP, seed=0)


def test_the_schedule_holds_every_optimizer_step_until_the_last_gradient_and_the_simulator_costs_it() -> None:
    """Llama-3.1-8B on 2 H200s, replicated, sync: with the barrier every OPT_STEP of iteration i depends on
    every GRAD_OUT of i (on both GPUs); the schedule validates, round-trips through text, and the simulated
    iteration is longer (the host optimizer no longer overlaps the backward)."""
    model, hw = load_model("llama-3.1-8b"), load_hardware("h200x2")
    policy = PRESETS["tinypipe"].replace(host_memory="replicated", optimizer="sync", microbatches=16)
    trace = trace_for(model, hw.gpus[0], microbatch_size=policy.microbatch_size, seq_len=2048, dtype="bf16",
                      profiles=())
    plain = compile_schedule(policy, model, hw, trace, iterations=3)
    clip = compile_schedule(policy, model, hw, trace, iterations=3, grad_clip=True)
    validate(clip)
    assert Schedule.loads(clip.dumps()) == clip and not Schedule.loads(plain.dumps()).grad_clip
    for a in clip.actions:
        if a.kind is Kind.OPT_STEP:
            outs = {g.id for g in clip.actions if g.kind is Kind.GRAD_OUT and g.iteration == a.iteration}
            assert outs <= set(a.deps) and {g.resource.split(".")[0] for g in clip.actions if g.id in outs} == {
                "g0", "g1"}
    slow, fast = simulate(clip, model, hw, trace), simulate(plain, model, hw, trace)
    assert slow.iteration_s > fast.iteration_s * 1.05


def test_reference_clipping_is_clip_grad_norm_on_a_plain_loop() -> None:
    """Three clipped steps of one AdamW over all parameters with torch.nn.utils.clip_grad_norm_ give the
    reference's weights (per-layer AdamW, its own clipping)."""
    stack = build_model(LLAMA, seed=0)
    params = [p for layer in stack.layers for p in layer.parameters()]
    opt = torch.optim.AdamW(params, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, weight_decay=OPTIM.weight_decay,
                            fused=True)
    data = batches()
    norms = []
    for k in range(3):
        step = data.step(k)
        denom = sum(int((y != IGNORE_INDEX).sum()) for _, y in step)
        opt.zero_grad(set_to_none=True)
        for x, y in step:
            stack.loss(x, y, denom).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
    ref = reference_train(LLAMA, batches(), steps=3, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                          weight_decay=OPTIM.weight_decay, seed=0, max_grad_norm=MAX_NORM)
    assert min(norms) > MAX_NORM and ref.grad_norms == pytest.approx(norms, rel=1e-5)
    for i, tensors in ref.state.items():
        for name, want in tensors.items():
            got = dict(stack.layers[i].named_parameters())[name]
            torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sync", "async"])
def test_pipeline_clips_by_the_norm_over_both_ranks_like_the_reference(optimizer: str) -> None:
    """Five steps on two ranks (threads; windows of 3 + 2), replicated host layout: the same losses and
    weights as the reference clipping each step's gradients by their global norm."""
    policy = PRESETS["tinypipe"].replace(optimizer=optimizer, host_memory="replicated")
    plain = compiled(LLAMA, policy, 2)
    sched = dataclasses.replace(plain, grad_clip=True, actions=norm_barrier(plain.actions))
    validate(sched)
    staleness = 1 if optimizer == "async" else 0
    results = run_threads(dataclasses.replace(job(LLAMA, sched, 5, staleness=staleness), max_grad_norm=MAX_NORM), 2)
    ref = reference_train(LLAMA, batches(), steps=5, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                          weight_decay=OPTIM.weight_decay, seed=0, max_grad_norm=MAX_NORM,
                          async_staleness=staleness)
    assert min(ref.grad_norms) > MAX_NORM
    assert_same_training(results, ref)

