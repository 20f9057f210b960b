"""Clipping by the global gradient norm: a barrier in the schedule (every OPT_STEP of an iteration after
every GRAD_OUT of it, in layer order), costed by the simulator, met in the backend by an all-reduce of the
norm; the compact layout holds a gradient region per layer instead of its ring; a tied matrix counts once.
The pipeline's clipped training equals the reference's, which equals torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import TINY_QWEN3_TIED  # noqa: E402
from test_interpreter import LLAMA, MBS, MBS_PER_STEP, OPTIM, SEQ, assert_same_training, compiled, job  # noqa: E402

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.model.hf import build_model  # noqa: E402
from tinypipe.backends.model.layers import IGNORE_INDEX  # noqa: E402
from tinypipe.backends.rank.reference import reference_train  # noqa: E402
from tinypipe.compiler import compile_schedule  # noqa: E402
from tinypipe.compiler.validate import validate  # noqa: E402
from tinypipe.describe.hardware import load_hardware  # noqa: E402
from tinypipe.describe.hfconfig import load_model  # noqa: E402
from tinypipe.describe.trace import trace_for  # noqa: E402
from tinypipe.estimate.hostmem import DEFAULT_GRAD_RING_SLOTS, host_bytes  # noqa: E402
from tinypipe.ir.schedule import Kind, Schedule  # noqa: E402
from tinypipe.policy import PRESETS  # noqa: E402
from tinypipe.sim import simulate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NORM = 0.5  # below the tiny model's gradient norms (~2-5): every step is clipped


@pytest.fixture(scope="module")
def deep_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Config paths of tiny-llama with 8 blocks (10 layers) and the tiny tied Qwen3 with 9 (11 layers): on 2
    ranks each rank holds more layers than the compact layout's ring has slots."""
    llama = json.loads((Path(__file__).parents[2] / "traces" / "models" / "tiny-llama.json").read_text())
    out = {}
    for name, config in (("llama", {**llama, "num_hidden_layers": 8}),
                         ("tied", {**TINY_QWEN3_TIED, "num_hidden_layers": 9})):
        path = tmp_path_factory.mktemp("models") / f"deep-{name}.json"
        path.write_text(json.dumps(config))
        out[name] = str(path)
    return out


def batches() -> object:
    return make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS,
                        microbatches=MBS_PER_STEP, seed=0)


@pytest.mark.parametrize("layout", ["replicated", "compact"])
def test_the_schedule_holds_every_optimizer_step_until_the_last_gradient_and_the_simulator_costs_it(
        layout: str) -> None:
    """Llama-3.1-8B on 2 H200s, sync, either host layout: with the barrier every OPT_STEP of iteration i
    depends on every GRAD_OUT of i (on both GPUs) and comes after them in the list; each GPU's steps of an
    iteration go in layer order; the schedule validates, round-trips through text, and the simulated
    iteration is longer (the host optimizer no longer overlaps the backward). compact: no GRAD_OUT waits for
    a ring slot (only for its own layer's previous step), and the predicted host peak is the formula's
    state with a whole gradient instead of the ring."""
    model, hw = load_model("llama-3.1-8b"), load_hardware("h200x2")
    policy = PRESETS["tinypipe"].replace(host_memory=layout, optimizer="sync", microbatches=16,
                                         activation_home="gpu")
    trace = trace_for(model, hw.gpus[0], microbatch_size=policy.microbatch_size, seq_len=2048, dtype="bf16",
                      profiles=())
    plain = compile_schedule(policy, model, hw, trace, iterations=3)
    clip = compile_schedule(policy, model, hw, trace, iterations=3, grad_clip=True)
    validate(clip)
    assert Schedule.loads(clip.dumps()) == clip and not Schedule.loads(plain.dumps()).grad_clip
    acts = clip.actions
    owner = {lay: g for layers, g in zip(clip.pack_layers, clip.pack_gpu) for lay in layers}
    steps: dict[tuple[int, int], list[int]] = {}
    for a in acts:
        if a.kind is Kind.OPT_STEP:
            outs = {g.id for g in acts if g.kind is Kind.GRAD_OUT and g.iteration == a.iteration}
            assert outs <= set(a.deps) and max(outs) < a.id
            assert {acts[d].resource.split(".")[0] for d in outs} == {"g0", "g1"}
            steps.setdefault((owner[a.layer], a.iteration), []).append(a.layer)
        elif a.kind is Kind.GRAD_OUT:
            assert [acts[d].kind for d in a.deps if acts[d].kind is Kind.OPT_STEP] == (
                [Kind.OPT_STEP] if a.iteration else []) and all(
                acts[d].layer == a.layer for d in a.deps if acts[d].kind is Kind.OPT_STEP)
    assert all(order == sorted(order) for order in steps.values()) and len(steps) == 6
    slow, fast = simulate(clip, model, hw, trace), simulate(plain, model, hw, trace)
    assert slow.iteration_s > fast.iteration_s * 1.05
    if layout == "compact":
        whole = host_bytes(model, "compact", compute_dtype="bf16", grad_clip=True)
        assert whole.grad_bytes == sum(x.params for x in model.layers) * 2
        assert dict(clip.static_bytes)["host"] == whole.total_bytes - whole.grad_bytes
        assert slow.peak_host_bytes == whole.total_bytes


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


CLIP_MATRIX = [
    pytest.param("llama", "replicated", "sync", id="llama-replicated-sync"),
    pytest.param("llama", "replicated", "async", id="llama-replicated-async"),
    pytest.param("llama", "compact", "sync", id="llama-compact-sync"),
    pytest.param("llama", "compact", "async", id="llama-compact-async"),
    pytest.param("tied", "compact", "sync", id="tied-qwen3-compact-sync"),
    pytest.param("tied", "compact", "async", id="tied-qwen3-compact-async"),
    pytest.param("tied", "replicated", "sync", id="tied-qwen3-replicated-sync"),
]


@pytest.mark.parametrize(("model", "layout", "optimizer"), CLIP_MATRIX)
def test_pipeline_clips_by_the_norm_over_both_ranks_like_the_reference(model: str, layout: str, optimizer: str,
                                                                       deep_models: dict[str, str],
                                                                       tmp_path: Path) -> None:
    """Five steps on two ranks (threads; windows of 3 + 2), a pack per layer dealt in turn, each rank holding
    more layers than the compact ring's slots: the same losses, weights and per-step gradient norms
    (metrics.jsonl) as the reference clipping each step's gradients by their global norm. Tied (Qwen3-like,
    head and embedding on rank 0): the shared matrix's two shares are summed before the norm, so it counts
    once, as in clip_grad_norm_ over the model's parameters."""
    model = deep_models[model]
    n = len(load_model(model).layers)
    policy = PRESETS["tinypipe"].replace(optimizer=optimizer, host_memory=layout, packing=(1,) * n,
                                         mapping=tuple(i % 2 for i in range(n)))
    sched = compiled(model, policy, 2, grad_clip=True)
    assert sched.grad_clip and min(sched.pack_gpu.count(g) for g in (0, 1)) > DEFAULT_GRAD_RING_SLOTS
    validate(sched)
    staleness = 1 if optimizer == "async" else 0
    results = run_threads(dataclasses.replace(job(model, sched, 5, staleness=staleness), max_grad_norm=MAX_NORM,
                                              out=str(tmp_path)), 2)
    ref = reference_train(model, batches(), steps=5, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                          weight_decay=OPTIM.weight_decay, seed=0, max_grad_norm=MAX_NORM,
                          async_staleness=staleness)
    assert min(ref.grad_norms) > MAX_NORM
    assert_same_training(results, ref)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] for r in rows] == pytest.approx(ref.grad_norms, rel=1e-5)
    if layout == "compact" and "llama" in model:  # a region per layer, as the formula says (no ring grown)
        spec = load_model(model)
        assert [r.held["grad_bytes"] for r in results] == [
            host_bytes(spec, "compact", compute_dtype="fp32", layers=tuple(r.layers), grad_clip=True).grad_bytes
            for r in results]


def test_run_plans_clipping_on_the_default_compact_layout_and_a_tied_model(tmp_path: Path,
                                                                          tied_config: str) -> None:
    """`tinypipe run --max-grad-norm 1` with the default policy (compact host layout) and a tied model is
    planned, not refused: the schedule clips, and the predicted host peak is the rank's state with a
    gradient region per layer (no ring slots left for GRAD_OUTs to wait on)."""
    from conftest import parse_run, plan_run

    plan = plan_run(parse_run("--model", tied_config, "--gpus", "2", "--max-grad-norm", "1", "--out",
                                   str(tmp_path / "out")))
    sched = plan.schedule
    assert sched.grad_clip and sched.host_memory.value == "compact" and plan.job.max_grad_norm == 1.0
    whole = host_bytes(plan.spec, "compact", compute_dtype=sched.compute_dtype, grad_clip=True)
    assert dict(sched.static_bytes)["host"] == whole.total_bytes - whole.grad_bytes
    assert plan.prediction.peak_host_bytes >= whole.total_bytes
