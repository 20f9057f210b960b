"""The per-rank interpreter: dispatch table, executed order, and training equal to the reference.

Ranks run as threads of the test process (`spawn.run_threads`, in-process transfers), so the
matrix of policies stays fast; tests/backends/test_run.py runs real processes over gloo.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from conftest import fixed_cpu_hardware  # noqa: E402
from handmade import build  # noqa: E402

from tinypipe.backends.data.batches import make_batches  # noqa: E402
from tinypipe.backends.data.tokenizers import ByteTokenizer  # noqa: E402
from tinypipe.backends.host.layouts import make_host_state  # noqa: E402
from tinypipe.backends.host.state import AdamWConfig  # noqa: E402
from tinypipe.backends.launch.spawn import run_threads  # noqa: E402
from tinypipe.backends.rank.executor import run_actions  # noqa: E402
from tinypipe.backends.rank.interpreter import ExecutionError, Interpreter, UnknownKindError  # noqa: E402
from tinypipe.backends.rank.reference import reference_train  # noqa: E402
from tinypipe.backends.rank.worker import Job  # noqa: E402
from tinypipe.compiler import compile_schedule  # noqa: E402
from tinypipe.describe.hfconfig import load_model  # noqa: E402
from tinypipe.describe.trace import analytic_trace  # noqa: E402
from tinypipe.ir.schedule import HOST_OPTIM, Action, Kind, Schedule, owned_layers, rank_actions, resource_gpu  # noqa: E402  # noqa: E402
from tinypipe.ir.timeline import Timeline  # noqa: E402
from tinypipe.policy import PRESETS, Policy  # noqa: E402
from tinypipe.sim import simulate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ, MBS, MBS_PER_STEP, K = 16, 2, 2, 3
OPTIM = AdamWConfig(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)


def compiled(model: str, policy: Policy, gpus: int, *, iterations: int = K, grad_clip: bool = False) -> Schedule:
    spec = load_model(model)
    hw = fixed_cpu_hardware(gpus)
    trace = analytic_trace(spec, hw.gpus[0], microbatch_size=MBS, seq_len=SEQ, dtype="fp32")
    return compile_schedule(policy.replace(microbatches=MBS_PER_STEP, microbatch_size=MBS), spec, hw, trace,
                            iterations=iterations, grad_clip=grad_clip)


def job(model: str, schedule: Schedule, steps: int, *, staleness: int = 0) -> Job:
    """A test job; `staleness` states what the schedule's optimizer mode gives (the backend reads the schedule)."""
    assert schedule.optimizer.staleness == staleness
    return Job(model=model, schedule=schedule, steps=steps, seq_len=SEQ, microbatch_size=MBS, optim=OPTIM,
               progress=False, save_model=False, keep_masters=True)


def reference(model: str, steps: int, *, staleness: int = 0) -> object:
    batches = make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS,
                           microbatches=MBS_PER_STEP, seed=0)
    return reference_train(model, batches, steps=steps, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                           weight_decay=OPTIM.weight_decay, seed=0, async_staleness=staleness)


def assert_same_training(results: list, ref: object) -> None:
    losses: dict[int, float] = {}
    masters: dict[int, dict[str, torch.Tensor]] = {}
    for r in results:
        losses.update(r.losses)
        masters.update(r.masters)
        assert not r.ledger_problems, r.ledger_problems[:3]
    assert [losses[k] for k in sorted(losses)] == pytest.approx(ref.losses, rel=1e-6, abs=1e-7)
    assert sorted(masters) == sorted(ref.state)
    for i, tensors in ref.state.items():
        for name, want in tensors.items():
            torch.testing.assert_close(masters[i][name], want, rtol=1e-5, atol=1e-6, msg=f"layer {i} {name}")


# ---- dispatch ---------------------------------------------------------------------------------------

def _small_interpreter() -> tuple[Interpreter, Schedule]:
    sched = build([[0], [1]], [0, 0], microbatches=1, iterations=1)
    host = make_host_state({0: {"w": torch.zeros(2)}, 1: {"w": torch.zeros(2)}}, host_memory="compact",
                     compute_dtype=torch.float32, optim=OPTIM)
    return Interpreter(rank=0, schedule=sched, layers=[None, None], host=host, comm=None,
                       device=torch.device("cpu"), hidden_size=4), sched


def test_dispatch_table_refuses_an_unknown_kind() -> None:
    """An action whose kind has no handler is an error naming the kind and the action."""
    interp, sched = _small_interpreter()
    xfer = dataclasses.replace(sched.actions[0], kind="XFER")  # a kind the table does not know
    with pytest.raises(UnknownKindError, match="'XFER'.*action 0"):
        interp.dispatch(xfer, 0)

    class NoLoad(Interpreter):
        HANDLERS = {k: v for k, v in Interpreter.HANDLERS.items() if k is not Kind.LOAD}

    load = next(a for a in sched.actions if a.kind is Kind.LOAD)
    with pytest.raises(UnknownKindError, match="'LOAD'"):
        NoLoad(rank=0, schedule=sched, layers=[None, None], host=interp.host, comm=None,
               device=torch.device("cpu"), hidden_size=4).dispatch(load, 0)
    assert set(Interpreter.HANDLERS) == set(Kind)


def test_a_schedule_that_cannot_progress_is_reported() -> None:
    """A dependency cycle (here: the first action waits for the last) ends in an error listing
    what each resource waits for, not in a hang."""
    interp, sched = _small_interpreter()
    first = dataclasses.replace(sched.actions[0], deps=(len(sched.actions) - 1,))
    acts = [first, *sched.actions[1:]]
    with pytest.raises(ExecutionError, match="cannot progress.*waits for"):
        run_actions(interp, acts, {})


# ---- order ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tinypipe", "mobius"])
def test_executed_per_resource_order_equals_the_schedule(preset: str) -> None:
    """Run for exactly the compiled iterations (one window): on every rank, every resource ran
    its actions in the schedule's order, and host.optim ran the rank's OPT_STEPs in the schedule's
    relative order. The merged timeline has the simulator's per-resource order on every GPU stream."""
    sched = compiled("tiny-llama", PRESETS[preset].replace(packing=(1, 2, 1, 2), mapping=(0, 1, 0, 1)), 2)
    results = run_threads(job("tiny-llama", sched, K), 2)
    for r in results:
        mine = {a.id for a in rank_actions(sched, r.rank)}
        for res, ids in sched.by_resource().items():
            want = [i for i in ids if i in mine]
            assert r.order.get(res, []) == want, f"rank {r.rank} {res}"
        assert set(r.order) <= {res for res in sched.resources if resource_gpu(res) in (r.rank, None)}
    spec = load_model("tiny-llama")
    hw = fixed_cpu_hardware(2)
    sim = simulate(sched, spec, hw, analytic_trace(spec, hw.gpus[0], microbatch_size=MBS, seq_len=SEQ, dtype="fp32"))
    real = Timeline(tuple(rec for r in results for rec in r.records if rec.resource != HOST_OPTIM), source="cpu")
    simulated = Timeline(tuple(rec for rec in sim.timeline.records if rec.resource != HOST_OPTIM))
    from tinypipe.ir.timeline import diff

    d = diff(real, simulated)
    assert d.orders_equal, d.order_mismatches
    assert not d.only_in_a and not d.only_in_b


# ---- training equals the reference ---------------------------------------------------------------------------

LLAMA = "tiny-llama"
MATRIX = [
    # model, ranks, policy changes
    pytest.param(LLAMA, 2, dict(packing=(1, 2, 1, 2), mapping=(0, 1, 0, 1), swap="layer", host_memory="compact"),
                 id="llama-2r-layer-compact"),
    pytest.param(LLAMA, 2, dict(packing=(2, 1, 2, 1), mapping=(0, 1, 0, 1), swap="pack", host_memory="replicated",
                                activation_home="host"), id="llama-2r-pack-replicated-offload"),
    pytest.param(LLAMA, 3, dict(packing=(1, 1, 1, 1, 1, 1), mapping=(0, 1, 2, 0, 1, 2), swap="layer",
                                host_memory="replicated", recompute=False), id="llama-3r-layer-replicated-keep"),
    pytest.param("qwen3", 3, dict(packing=(1, 1, 1, 1, 1), mapping=(0, 1, 2, 0, 1), swap="pack",
                                  host_memory="compact", resident="auto"), id="qwen3-3r-pack-compact"),
    pytest.param("qwen3", 2, dict(packing=(2, 1, 1, 1), mapping=(0, 1, 0, 1), swap="layer",
                                  host_memory="replicated", prefetch_depth=2), id="qwen3-2r-layer-replicated"),
]


@pytest.mark.parametrize(("model", "ranks", "changes"), MATRIX)
def test_pipeline_training_equals_single_process_training(model: str, ranks: int, changes: dict,
                                                          qwen3_config: str) -> None:
    """Five steps through the compiled schedule (windows of 3 + 2 compiled iterations) give the
    reference's losses and final weights: several packs per device, both swap modes, both host
    layouts, sync optimizer, activations kept or offloaded."""
    model = qwen3_config if model == "qwen3" else model
    sched = compiled(model, PRESETS["tinypipe"].replace(optimizer="sync", **changes), ranks)
    assert len(sched.pack_layers) > ranks  # several packs per device
    results = run_threads(job(model, sched, 5), ranks)
    assert_same_training(results, reference(model, 5))


@pytest.mark.parametrize(("model", "ranks", "layout"), [(LLAMA, 2, "compact"), ("qwen3", 3, "replicated")])
def test_async_optimizer_matches_the_one_step_late_reference(model: str, ranks: int, layout: str,
                                                             qwen3_config: str) -> None:
    """optimizer=async (staleness 1): step t computes with the weights after steps <= t-2, as
    `reference_train(async_staleness=1)`; window boundaries (3 + 3 steps) included."""
    model = qwen3_config if model == "qwen3" else model
    n_layers = len(load_model(model).layers)
    policy = PRESETS["tinypipe"].replace(optimizer="async", packing=(1,) * n_layers,
                                         mapping=tuple(i % ranks for i in range(n_layers)), host_memory=layout)
    results = run_threads(job(model, compiled(model, policy, ranks), 6, staleness=1), ranks)
    assert_same_training(results, reference(model, 6, staleness=1))


TIED_MATRIX = [
    pytest.param(dict(packing=(1, 1, 1, 1, 1), mapping=(0, 1, 0, 1, 0), swap="layer", host_memory="compact"), 0,
                 id="layer-compact-sync"),
    pytest.param(dict(packing=(2, 2, 1), mapping=(0, 1, 0), swap="pack", host_memory="replicated"), 0,
                 id="pack-replicated-sync"),
    pytest.param(dict(packing=(1, 1, 1, 1, 1), mapping=(0, 1, 0, 1, 0), swap="layer", host_memory="replicated",
                      optimizer="async"), 1, id="layer-replicated-async"),
    pytest.param(dict(packing=(2, 2, 1), mapping=(0, 1, 0), swap="pack", host_memory="compact", optimizer="async"),
                 1, id="pack-compact-async"),
]


@pytest.mark.parametrize(("changes", "staleness"), TIED_MATRIX)
def test_tied_embeddings_train_bit_for_bit_like_the_reference(changes: dict, staleness: int,
                                                              tied_config: str) -> None:
    """A tied model (the head computes with the embedding matrix; head and embedding on GPU 0):
    five steps through the pipeline (windows of 3 + 2) give exactly the reference's losses and
    weights, both host layouts, both swap modes, sync and async optimizer."""
    policy = PRESETS["tinypipe"].replace(**{"optimizer": "sync", **changes})
    sched = compiled(tied_config, policy, 2)
    assert sched.pack_gpu[0] == sched.pack_gpu[-1]
    results = run_threads(job(tied_config, sched, 5, staleness=staleness), 2)
    ref = reference(tied_config, 5, staleness=staleness)
    assert_same_training(results, ref)
    losses = {k: v for r in results for k, v in r.losses.items()}
    masters = {i: t for r in results for i, t in r.masters.items()}
    assert [losses[k] for k in sorted(losses)] == ref.losses
    assert sorted(masters[4]) == ["norm.weight"]  # the tied matrix is layer 0's only
    for i, tensors in ref.state.items():
        for name, want in tensors.items():
            assert torch.equal(masters[i][name], want), f"layer {i} {name}"


def test_tied_head_away_from_the_embedding_is_refused() -> None:
    """A rank given the tied head without the embedding (a schedule not compiled for the tied
    model) fails at once, naming both GPUs."""
    sched = build([[0, 1, 2], [3, 4]], [0, 1], microbatches=1, iterations=1)
    host = make_host_state({3: {"w": torch.zeros(2)}, 4: {"w": torch.zeros(2)}}, host_memory="replicated",
                     compute_dtype=torch.float32, optim=OPTIM)
    with pytest.raises(ExecutionError, match="must be on one GPU.*GPUs 1 and 0"):
        Interpreter(rank=1, schedule=sched, layers=[None] * 5, host=host, comm=None, device=torch.device("cpu"),
                    hidden_size=4, tied=("lm_head.weight", "embed_tokens.weight"))


def test_bf16_compute_trains_close_to_the_reference() -> None:
    """With bf16 compute the compact layout uploads the truncated high plane: losses stay close to
    the bf16 reference (not equal: the reference rounds, and accumulates gradients in fp32)."""
    sched = dataclasses.replace(compiled(LLAMA, PRESETS["tinypipe"].replace(packing=(3, 3), mapping=(0, 1)), 2),
                                compute_dtype="bf16")
    results = run_threads(job(LLAMA, sched, 3), 2)
    losses = {k: v for r in results for k, v in r.losses.items()}
    batches = make_batches(None, tokenizer=ByteTokenizer(256), seq_len=SEQ, microbatch_size=MBS,
                           microbatches=MBS_PER_STEP, seed=0)
    ref = reference_train(LLAMA, batches, steps=3, lr=OPTIM.lr, dtype=torch.bfloat16)
    assert [losses[k] for k in range(3)] == pytest.approx(ref.losses, rel=2e-2)


def test_each_rank_holds_only_its_layers() -> None:
    """Host state exists only for the layers of the packs mapped to a rank."""
    sched = compiled(LLAMA, PRESETS["tinypipe"].replace(packing=(1, 2, 1, 2), mapping=(0, 1, 0, 1)), 2)
    results = run_threads(job(LLAMA, sched, 1), 2)
    assert [r.layers for r in results] == [owned_layers(sched, 0), owned_layers(sched, 1)] == [[0, 3], [1, 2, 4, 5]]
    assert sorted(results[0].masters) == [0, 3]


def test_handmade_schedule_with_a_missing_load_fails_clearly() -> None:
    """A FWD whose layer was never loaded is an ExecutionError naming the action."""
    sched = build([[0, 1, 2], [3, 4, 5]], [0, 0], microbatches=1, iterations=1)
    acts = tuple(a if not (a.kind is Kind.LOAD and a.layer == 1) else
                 Action(a.id, Kind.EVICT, "g0.compute", layer=5, iteration=0) for a in sched.actions)
    broken = dataclasses.replace(sched, actions=acts)
    with pytest.raises(ExecutionError):
        run_threads(job(LLAMA, broken, 1), 1)
