"""Compiler passes one by one, golden schedules, policy errors, a 70B schedule, random policies (Hypothesis)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinypipe.common.errors import InputError
from tinypipe.common.units import GIB
from tinypipe.compiler import (
    compile_schedule,
    compute_ops,
    gradient_pass,
    lower,
    make_plan,
    memory_pass,
    optimizer_pass,
    run_passes,
    swap_pass,
    transfer_pass,
)
from tinypipe.compiler.validate import validate
from tinypipe.describe.hardware import GPU, Hardware, Host, Link
from tinypipe.describe.model import LayerKind, LayerSpec, ModelSpec
from tinypipe.describe.trace import KindProfile, ProfileTrace
from tinypipe.estimate.calibration import CostModel
from tinypipe.estimate.plan import Plan
from tinypipe.ir.schedule import Kind, Schedule
from tinypipe.partition import mobius
from tinypipe.policy.policy import PRESETS, Policy

GOLDEN = Path(__file__).parent / "golden"


# ---- toys, built by hand so that goldens do not move with shipped data ---------------------------

def toy_model(n_layers: int = 8, *, tied: bool = False) -> ModelSpec:
    """embed, blocks, head (a single block when n_layers == 1)."""
    if n_layers == 1:
        kinds = [LayerKind.BLOCK]
    else:
        kinds = [LayerKind.EMBED] + [LayerKind.BLOCK] * (n_layers - 2) + [LayerKind.HEAD]
    own = {LayerKind.EMBED: 1000, LayerKind.BLOCK: 3000, LayerKind.HEAD: 500}
    layers = tuple(
        LayerSpec(index=i, kind=k, name=f"{k.value}{i}", params=own[k],
                  gpu_params=own[k] + (1000 if tied and k is LayerKind.HEAD else 0),
                  linear_flops_per_token=2.0 * own[k], attn_flops_per_token_per_ctx=0.0,
                  saved_act_bytes_per_token=64, boundary_bytes_per_token=16)
        for i, k in enumerate(kinds))
    return ModelSpec(name=f"toy{n_layers}", family="llama", layers=layers, hidden_size=8, vocab_size=125,
                     num_blocks=max(0, n_layers - 2), tied_embeddings=tied, max_seq_len=64, source="test")


def toy_trace(microbatch_size: int = 1) -> ProfileTrace:
    kinds = {"embed": KindProfile(0.001, 0.002, 0.003, 64, 16, 32),
             "block": KindProfile(0.010, 0.020, 0.030, 512, 128, 256),
             "head": KindProfile(0.005, 0.010, 0.015, 256, 128, 128)}
    return ProfileTrace(gpu_model="toy", dtype="bf16", microbatch_size=microbatch_size, seq_len=8, kinds=kinds,
                        analytic=True, source="hand-written test trace")


def toy_hardware(n_gpus: int = 2, *, memory_bytes: int = 8 * GIB) -> Hardware:
    """n GPUs under two PCIe switches (one when n == 1) of one root complex."""
    switches = ("rc0", "sw0") + (("sw1",) if n_gpus > 1 else ())
    links = [Link("host", "rc0", "mem", 100.0, 0.0), Link("rc0", "sw0", "pcie", 25.0, 0.0)]
    if n_gpus > 1:
        links.append(Link("rc0", "sw1", "pcie", 25.0, 0.0))
    links += [Link(f"sw{g * 2 // n_gpus if n_gpus > 1 else 0}", f"gpu{g}", "pcie", 25.0, 5e-6) for g in range(n_gpus)]
    gpus = tuple(GPU(f"gpu{g}", "toy", memory_bytes, 1e14, 1000.0) for g in range(n_gpus))
    return Hardware(name=f"toy{n_gpus}", provenance="spec", source="test", host=Host(64 * GIB, 50.0, 8, 1e9),
                    gpus=gpus, switches=switches, links=tuple(links))


def counts_ok(s: Schedule) -> bool:
    got = Counter((a.kind, a.layer, a.iteration) for a in s.actions if a.kind in (Kind.FWD, Kind.BWD))
    return all(got[k, layer, i] == s.microbatches for k in (Kind.FWD, Kind.BWD)
               for layer in range(s.num_layers) for i in range(s.iterations))


def short(ops: list) -> list[str]:
    return [f"{o.kind.value} L{o.layer}" + ("" if o.mb is None else f" m{o.mb}") + f" g{o.gpu}" for o in ops]


# ---- passes, each alone ----------------------------------------------------------------------------

def test_compute_ops_order() -> None:
    """Forward packs in order, backward in reverse; microbatch-major inside a pack; data deps only."""
    plan = Plan.toy((2, 1), (0, 1), 2)
    ops = compute_ops(plan)
    assert short(ops) == [
        "FWD L0 m0 g0", "FWD L1 m0 g0", "FWD L0 m1 g0", "FWD L1 m1 g0", "FWD L2 m0 g1", "FWD L2 m1 g1",
        "BWD L2 m0 g1", "BWD L2 m1 g1", "BWD L1 m0 g0", "BWD L0 m0 g0", "BWD L1 m1 g0", "BWD L0 m1 g0"]
    by = {(o.kind, o.layer, o.mb): o for o in ops}
    assert by[Kind.FWD, 2, 1].deps == [by[Kind.FWD, 1, 1]]
    assert by[Kind.BWD, 1, 0].deps == [by[Kind.FWD, 1, 0], by[Kind.BWD, 2, 0]]
    assert by[Kind.BWD, 2, 0].deps == [by[Kind.FWD, 2, 0]]


def test_swap_pass_layer_mode() -> None:
    """Layer swapping: LOAD right before a layer's first use, EVICT right after its last; window deps."""
    plan = Plan.toy((2, 2), (0, 0), 2, swap="layer", prefetch_depth=0)
    ops = swap_pass(plan, compute_ops(plan))
    assert short(ops)[:8] == ["LOAD L0 g0", "FWD L0 m0 g0", "LOAD L1 g0", "FWD L1 m0 g0", "FWD L0 m1 g0",
                              "EVICT L0 g0", "FWD L1 m1 g0", "EVICT L1 g0"]
    loads = [o for o in ops if o.kind is Kind.LOAD]
    evicts = [o for o in ops if o.kind is Kind.EVICT]
    # window = 2 layers per use + depth 0: the 3rd segment's LOAD waits for the 1st segment's EVICT
    assert evicts[0] in loads[2].deps and evicts[1] in loads[3].deps
    assert loads[0].deps == [] and loads[1].deps == []
    # every FWD/BWD's first op in a segment depends on its LOAD
    first_fwd = next(o for o in ops if o.kind is Kind.FWD and o.layer == 2)
    assert loads[2] in first_fwd.deps


@pytest.mark.parametrize("field, value", [("swap", "layers"), ("optimizer", "asynchronous"),
                                          ("host_memory", "compacted"), ("activation_home", "cpu")])
def test_plan_refuses_an_unknown_mode(field: str, value: str) -> None:
    """A plan built with a mode it does not know fails at once instead of compiling as another mode
    (`swap="layers"` once compiled as pack swapping); mypy catches the literal before that."""
    with pytest.raises(InputError, match=f"plan: {field}: must be one of"):
        Plan.toy((1, 1), (0, 0), 1, **{field: value})


def test_swap_pass_pack_mode_prefetch() -> None:
    """Pack swapping: a pack's LOADs precede its first op; with depth 1 they wait two uses back."""
    plan = Plan.toy((1, 1, 1), (0, 0, 0), 1, swap="pack", prefetch_depth=1)
    ops = swap_pass(plan, compute_ops(plan))
    assert short(ops) == [
        "LOAD L0 g0", "FWD L0 m0 g0", "EVICT L0 g0", "LOAD L1 g0", "FWD L1 m0 g0", "EVICT L1 g0",
        "LOAD L2 g0", "FWD L2 m0 g0", "EVICT L2 g0", "LOAD L2 g0", "BWD L2 m0 g0", "EVICT L2 g0",
        "LOAD L1 g0", "BWD L1 m0 g0", "EVICT L1 g0", "LOAD L0 g0", "BWD L0 m0 g0", "EVICT L0 g0"]
    loads = [o for o in ops if o.kind is Kind.LOAD]
    evicts = [o for o in ops if o.kind is Kind.EVICT]
    assert evicts[0] in loads[2].deps  # use 2 waits for use 0 (one pack prefetched)
    assert evicts[2] in loads[3].deps  # same layer: reload after its evict


def test_swap_pass_kept_and_pinned() -> None:
    """Kept layers stay from forward to backward; pinned layers for the whole iteration."""
    plan = Plan.toy((1, 1), (0, 0), 1, kept=frozenset({1}), pinned=frozenset({0}))
    ops = swap_pass(plan, compute_ops(plan))
    assert short(ops) == ["LOAD L0 g0", "FWD L0 m0 g0", "LOAD L1 g0", "FWD L1 m0 g0", "BWD L1 m0 g0",
                          "EVICT L1 g0", "BWD L0 m0 g0", "EVICT L0 g0"]


def test_transfer_pass_pairs_and_offload() -> None:
    """Cross-GPU deps become SEND/RECV right after the producer; host activations offload and return,
    except the head's (L2), which its kept forward graph holds on the GPU anyway."""
    plan = Plan.toy((1, 1, 1), (0, 1, 1), 2, activation_home="host")
    ops = transfer_pass(plan, compute_ops(plan))
    assert short(ops) == [
        "FWD L0 m0 g0", "SEND_F L1 m0 g0", "RECV_F L1 m0 g1", "FWD L0 m1 g0", "SEND_F L1 m1 g0", "RECV_F L1 m1 g1",
        "FWD L1 m0 g1", "OFFLOAD_ACT L1 m0 g1", "FWD L1 m1 g1", "OFFLOAD_ACT L1 m1 g1",
        "FWD L2 m0 g1", "FWD L2 m1 g1", "BWD L2 m0 g1", "BWD L2 m1 g1",
        "FETCH_ACT L1 m0 g1", "BWD L1 m0 g1", "SEND_B L1 m0 g1", "RECV_B L1 m0 g0",
        "FETCH_ACT L1 m1 g1", "BWD L1 m1 g1", "SEND_B L1 m1 g1", "RECV_B L1 m1 g0", "BWD L0 m0 g0", "BWD L0 m1 g0"]
    fwd1 = next(o for o in ops if o.kind is Kind.FWD and o.layer == 1)
    assert fwd1.deps[0].kind is Kind.RECV_F and fwd1.deps[0].peer == 0
    fetch1 = [o for o in ops if o.kind is Kind.FETCH_ACT][1]
    assert {d.kind for d in fetch1.deps} == {Kind.OFFLOAD_ACT, Kind.BWD}  # one microbatch ahead
    grads = [o for o in ops if o.kind is Kind.SEND_B]
    assert len(grads) == 2 and all(o.gpu == 1 and o.peer == 0 for o in grads)


def test_gradient_and_optimizer_passes_sync() -> None:
    """GRAD_OUT after the last BWD and OPT_STEP after it, except the head's step, which goes after its
    GPU's last GRAD_OUT of the iteration (the next forward reads the head last); the next
    iteration's first LOAD of a layer waits for its step."""
    plan = Plan.toy((1, 1), (0, 0), 2, iterations=2, host_memory="replicated")
    ops = optimizer_pass(plan, gradient_pass(plan, swap_pass(plan, compute_ops(plan))))
    outs = [o for o in ops if o.kind is Kind.GRAD_OUT]
    steps = [o for o in ops if o.kind is Kind.OPT_STEP]
    assert [(o.layer, o.it) for o in outs] == [(1, 0), (0, 0), (1, 1), (0, 1)]
    assert [(o.layer, o.it) for o in steps] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for it in range(2):  # L0 right after its GRAD_OUT, the head right after L0's step
        assert ops.index(steps[2 * it]) == ops.index(outs[2 * it + 1]) + 1
        assert ops.index(steps[2 * it + 1]) == ops.index(steps[2 * it]) + 1
    last_bwd = [o for o in ops if o.kind is Kind.BWD and o.layer == 1 and o.it == 0][-1]
    assert outs[0].deps[0] is last_bwd
    head_step = steps[1]
    assert head_step.deps == [outs[0]]  # it waits for its own gradient only
    load_l1_it1 = next(o for o in ops if o.kind is Kind.LOAD and o.layer == 1 and o.it == 1)
    assert head_step in load_l1_it1.deps
    assert head_step in outs[2].deps  # the host gradient of L1 is consumed before the next GRAD_OUT


def test_optimizer_pass_ring_follows_step_order() -> None:
    """compact: the k-th GRAD_OUT of a GPU waits for the (k - ring_slots)-th OPT_STEP in host.optim
    order, which the deferred head step changes (waiting for the head's own step would be a cycle)."""
    plan = Plan.toy((1, 1, 1), (0, 0, 0), 1, iterations=2, host_memory="compact", ring_slots=2)
    ops = optimizer_pass(plan, gradient_pass(plan, swap_pass(plan, compute_ops(plan))))
    outs = [o for o in ops if o.kind is Kind.GRAD_OUT]
    steps = [o for o in ops if o.kind is Kind.OPT_STEP]
    assert [(o.layer, o.it) for o in outs] == [(2, 0), (1, 0), (0, 0), (2, 1), (1, 1), (0, 1)]
    assert [(o.layer, o.it) for o in steps] == [(1, 0), (0, 0), (2, 0), (1, 1), (0, 1), (2, 1)]
    waits = [{id(d) for d in o.deps if d.kind is Kind.OPT_STEP} for o in outs]
    # its layer's previous step (the host gradient consumed), and the ring's slot
    want = [[], [], [0], [2, 1], [0, 2], [1, 3]]
    assert waits == [{id(steps[i]) for i in w} for w in want]
    pos = {id(o): i for i, o in enumerate(ops)}
    assert all(pos[id(d)] < pos[id(o)] for o in ops for d in o.deps)  # still a topological order


def test_optimizer_pass_async() -> None:
    """Async: LOADs of iteration i wait for OPT_STEP of i-2; OPT_STEP of i-1 waits only for its gradient
    (its GRAD_OUT): uploads of i that come after it read the host state's snapshot of the previous version."""
    plan = Plan.toy((1,), (0,), 1, iterations=3, optimizer="async")
    ops = optimizer_pass(plan, gradient_pass(plan, swap_pass(plan, compute_ops(plan))))
    steps = {o.it: o for o in ops if o.kind is Kind.OPT_STEP}
    loads = [o for o in ops if o.kind is Kind.LOAD]
    by_it = {i: [x for x in loads if x.it == i] for i in range(3)}
    assert steps[0] in by_it[2][0].deps and all(steps[0] not in x.deps for x in by_it[1])
    grad_out = {o.it: o for o in ops if o.kind is Kind.GRAD_OUT}
    assert [d.kind for d in steps[0].deps] == [Kind.GRAD_OUT] and grad_out[0] in steps[0].deps
    assert all(d is not None for d in steps[2].deps)


def test_memory_pass_effects() -> None:
    """Buffers per the contract: weights, inputs, gradients, workspace, host slots."""
    plan = Plan.toy((1, 1), (0, 1), 1, recompute=False)
    ops = memory_pass(plan, optimizer_pass(plan, gradient_pass(plan, transfer_pass(
        plan, swap_pass(plan, compute_ops(plan))))))
    text = {f"{o.kind.value} L{o.layer} g{o.gpu}": ([m.text() for m in o.allocs], [m.text() for m in o.frees])
            for o in ops}
    assert text["FWD L0 g0"] == (["g0:x.L1.m0=10", "g0:a.L0.m0=30", "g0:ws=5"], ["g0:ws=5"])
    # without recompute the graph keeps L1's weights from its FWD: the EVICT before the BWD frees nothing,
    # the LOAD after it makes a second copy (wr), freed with the graph at the last BWD, w at the last EVICT
    order = [(o.kind.value, [m.text() for m in o.allocs], [m.text() for m in o.frees])
             for o in ops if o.layer == 1 and o.gpu == 1 and o.kind.value in ("LOAD", "EVICT", "FWD", "BWD")]
    assert [(k, a, f) for k, a, f in order if k in ("LOAD", "EVICT")] == [
        ("LOAD", ["g1:w.L1=100"], []), ("EVICT", [], []), ("LOAD", ["g1:wr.L1=100"], []),
        ("EVICT", [], ["g1:w.L1=100"])]
    assert text["BWD L1 g1"] == (["g1:dx.L1.m0=10", "g1:gr.L1=100", "g1:ws=5"],
                                 ["g1:x.L1.m0=10", "g1:a.L1.m0=30", "g1:ws=5", "g1:wr.L1=100"])
    assert text["BWD L0 g0"] == (["g0:gr.L0=100", "g0:ws=5"],
                                 ["g0:a.L0.m0=30", "g0:dx.L1.m0=10", "g0:ws=5", "g0:wr.L0=100"])
    assert text["LOAD L0 g0"] == (["g0:wr.L0=100"], [])  # the last LOAD of L0: the copy beside the graph's
    assert text["GRAD_OUT L1 g1"] == (["host:gring.L1=200"], ["g1:gr.L1=100"])
    assert text["OPT_STEP L1 g-1"] == ([], ["host:gring.L1=200"])


def test_lower_ids_are_topological() -> None:
    """Lowered ids are list positions and every dependency points to a smaller id."""
    plan = Plan.toy((2, 1, 1), (0, 1, 0), 3, iterations=2, activation_home="host", optimizer="async")
    ops = compute_ops(plan)
    for p in (swap_pass, transfer_pass, gradient_pass, optimizer_pass, memory_pass):
        ops = p(plan, ops)
    acts = lower(ops)
    assert all(a.id == i and all(d < i for d in a.deps) for i, a in enumerate(acts))


# ---- whole compiles ----------------------------------------------------------------------------------

GOLDEN_CASES = {
    "resident": PRESETS["resident"],
    "mobius": PRESETS["mobius"],
    "tinypipe": PRESETS["tinypipe"],
    "tinypipe-act-host": PRESETS["tinypipe"].replace(name="tinypipe-act-host", activation_home="host"),
    "tinypipe-async": PRESETS["tinypipe"].replace(name="tinypipe-async", optimizer="async"),
}


GOLDEN_KEPT = frozenset({3, 4, 5, 6, 7})  # `auto`'s layers in the goldens: the turnaround packs and L3


def golden_inputs(case: str) -> tuple[Policy, ModelSpec, Hardware, ProfileTrace]:
    """2 GPUs of 40 kB (and no reserve), 4 packs, 2 microbatches."""
    return (GOLDEN_CASES[case].replace(packing=(2, 2, 2, 2), microbatches=2), toy_model(8),
            toy_hardware(2, memory_bytes=40_000), toy_trace())


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_schedules(case: str) -> None:
    """2 GPUs, 4 packs, 2 microbatches, 3 iterations: the compiled text equals tests/golden/<case>.txt.

    The goldens pin the passes; under `auto` they keep GOLDEN_KEPT, given here, whereas what `auto`
    chooses is the GPU-memory formula's (`test_auto_keeps_what_costs_no_memory`)."""
    inputs = golden_inputs(case)
    sched = compile_schedule(*inputs, iterations=3, cost=CostModel(gpu_reserve_bytes=0))
    if inputs[0].resident == "auto":
        plan = make_plan(*inputs, iterations=3, cost=CostModel(gpu_reserve_bytes=0))
        sched = replace(sched, actions=run_passes(replace(plan, kept=GOLDEN_KEPT)), _by_resource=None)
    validate(sched)
    path = GOLDEN / f"{case}.txt"
    text = sched.dumps()
    if os.environ.get("TINYPIPE_REGEN_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"missing {path}; run with TINYPIPE_REGEN_GOLDEN=1"
    assert text == path.read_text(), f"{case}: schedule changed; inspect and regenerate with TINYPIPE_REGEN_GOLDEN=1"
    assert Schedule.loads(text) == sched


def test_auto_keeps_what_costs_no_memory() -> None:
    """`auto` keeps each GPU's turnaround pack, then earlier layers, latest first, while the GPU-memory
    formula's peak fits. On the golden toy every layer is kept: the prefetch window would hold them at
    the peak anyway. The simulator agrees: keeping them all peaks exactly as keeping GOLDEN_KEPT does."""
    from tinypipe.sim import simulate

    inputs = golden_inputs("tinypipe")
    plan = make_plan(*inputs, iterations=3, cost=CostModel(gpu_reserve_bytes=0))
    assert plan.kept == frozenset(range(8))
    sched = compile_schedule(*inputs, iterations=3, cost=CostModel(gpu_reserve_bytes=0))
    golden = replace(sched, actions=run_passes(replace(plan, kept=GOLDEN_KEPT)), _by_resource=None)
    _, model, hw, trace = inputs
    assert simulate(sched, model, hw, trace).peak_bytes == simulate(golden, model, hw, trace).peak_bytes


def test_every_preset_on_shipped_model_is_valid() -> None:
    """The three presets compile tiny-llama on the shipped 8-GPU box into valid schedules."""
    from tinypipe.describe.hardware import load_hardware
    from tinypipe.describe.hfconfig import load_model
    from tinypipe.describe.trace import analytic_trace

    model, hw = load_model("tiny-llama"), load_hardware("rtx4090x8-pcie4")
    trace = analytic_trace(model, hw.gpus[0], microbatch_size=1, seq_len=256)
    for name, policy in PRESETS.items():
        sched = compile_schedule(policy, model, hw, trace)
        validate(sched)
        assert counts_ok(sched), name


@pytest.mark.parametrize(("change", "field"), [
    ({"packing": (3, 3)}, "packing"),
    ({"packing": (4, 4), "mapping": (0, 5)}, "mapping"),
    ({"packing": (4, 4), "mapping": (0, 1, 0)}, "mapping"),
    ({"packing": "balanced", "num_packs": 9}, "num_packs"),
    ({"packing": "uniform", "pack_size": 9}, "pack_size"),
    ({"resident": (1, 8)}, "resident"),
    ({"microbatch_size": 2}, "microbatch_size"),
])
def test_policy_that_cannot_apply_names_the_field(change: dict, field: str) -> None:
    """A policy that does not fit the model or hardware is an InputError naming the policy field."""
    with pytest.raises(InputError, match=rf"{field}:"):
        compile_schedule(Policy(**change), toy_model(8), toy_hardware(2), toy_trace())


def test_llama70b_compiles_to_a_valid_schedule() -> None:
    """llama-3.1-70b on 8 GPUs, 32 microbatches, 3 iterations: a valid ~50k-action schedule. How fast it
    compiles is bench/compile_bench.py's to measure (target < 1 s), not a timed test's."""
    from tinypipe.describe.hardware import load_hardware
    from tinypipe.describe.hfconfig import load_model
    from tinypipe.describe.trace import analytic_trace

    model, hw = load_model("llama-3.1-70b"), load_hardware("rtx4090x8-pcie4")
    trace = analytic_trace(model, hw.gpus[0], microbatch_size=1, seq_len=2048)
    sched = compile_schedule(PRESETS["tinypipe"].replace(microbatches=32), model, hw, trace)
    assert len(sched.actions) > 40_000 and counts_ok(sched)


# ---- random models, hardware and policies --------------------------------------------------------------

@st.composite
def cases(draw: st.DrawFn) -> tuple[Policy, ModelSpec, Hardware, int]:
    n = draw(st.integers(1, 64))
    g = draw(st.integers(1, 8))
    m = draw(st.integers(1, 16))
    model = toy_model(n, tied=draw(st.booleans()))
    kind = draw(st.sampled_from(["explicit", "uniform", "balanced", "per-gpu", "holistic", "mobius"]))
    kw: dict = {}
    if kind == "explicit":
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(12, n - 1)))) if n > 1 else []
        bounds = [0, *cuts, n]
        sizes = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        kw["packing"] = sizes
        kw["mapping"] = draw(st.one_of(st.sampled_from(["round-robin", "cross"]),
                                       st.lists(st.integers(0, g - 1), min_size=len(sizes), max_size=len(sizes))))
        if model.tied_embeddings and isinstance(kw["mapping"], list) and len(kw["mapping"]) > 1:
            kw["mapping"][-1] = kw["mapping"][0]  # a tied head runs on the embedding's GPU (else an InputError)
    else:
        kw["packing"] = kind
        kw["mapping"] = draw(st.sampled_from(["round-robin", "cross"]))
        if kind == "uniform":
            kw["pack_size"] = draw(st.integers(0, n))
        if kind == "balanced":
            kw["num_packs"] = draw(st.integers(0, n))
    recompute = draw(st.booleans())
    resident = draw(st.one_of(st.sampled_from(["none", "all", "auto"]),
                              st.sets(st.integers(0, n - 1), max_size=4).map(lambda s: tuple(sorted(s)))))
    policy = Policy(
        swap=draw(st.sampled_from(["pack", "layer"])), prefetch_depth=draw(st.integers(0, 3)), resident=resident,
        host_memory=draw(st.sampled_from(["replicated", "compact"])), microbatches=m, recompute=recompute,
        optimizer=draw(st.sampled_from(["sync", "async"])),
        activation_home=draw(st.sampled_from(["gpu", "host"])) if recompute else "gpu", **kw)
    return policy, model, toy_hardware(g), draw(st.integers(1, 3))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_policies_compile_to_valid_schedules(case: tuple[Policy, ModelSpec, Hardware, int]) -> None:
    """Random models, GPUs, microbatches and policies compile to valid schedules, M FWD/BWD per layer."""
    policy, model, hw, iterations = case
    with mock.patch.object(mobius, "MOBIUS_TIME_LIMIT_S", 0.2):
        sched = compile_schedule(policy, model, hw, toy_trace(), iterations=iterations)
    validate(sched)
    assert counts_ok(sched)
    assert all(d < a.id for a in sched.actions for d in a.deps)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tied_model_puts_the_head_on_the_embeddings_gpu(preset: str) -> None:
    """Tied embeddings: whatever mapping the policy chooses, the last pack runs on pack 0's GPU
    (the real backend keeps the shared matrix's master on that rank); untied models are unchanged."""
    policy = PRESETS[preset].replace(packing=(2, 2, 2, 2), mapping="round-robin", microbatches=2)
    tied = compile_schedule(policy, toy_model(8, tied=True), toy_hardware(2), toy_trace(), iterations=2)
    validate(tied)
    assert tied.pack_gpu == (0, 1, 0, 0)
    untied = compile_schedule(policy, toy_model(8), toy_hardware(2), toy_trace(), iterations=2)
    assert untied.pack_gpu == (0, 1, 0, 1)


def test_tied_model_refuses_an_explicit_mapping_that_splits_head_and_embedding() -> None:
    policy = PRESETS["tinypipe"].replace(packing=(4, 4), mapping=(0, 1), microbatches=2)
    with pytest.raises(InputError, match=r"^policy 'tinypipe': mapping: .*ties its LM head") as info:
        compile_schedule(policy, toy_model(8, tied=True), toy_hardware(2), toy_trace(), iterations=2)
    assert "\n" not in str(info.value)


def test_run_windows_end_at_every_period_and_the_first_is_the_compiled_length() -> None:
    """`window_steps`: `tinypipe run`'s windows (at most 4 steps) end at each multiple of a checkpoint / save /
    evaluation period and at the last step; the window from step 0 is the longest, the iterations run compiles."""
    from tinypipe.compiler import window_steps

    def windows(steps: int, every: tuple[int, ...], start: int = 0) -> list[int]:
        out, step = [], start
        while step < steps:
            out.append(window_steps(step, iterations=4, steps=steps, every=every))
            step += out[-1]
        return out

    assert windows(10, ()) == [4, 4, 2]
    assert windows(10, (1,)) == [1] * 10
    assert windows(10, (3,)) == [3, 3, 3, 1]
    assert windows(13, (2, 3)) == [2, 1, 1, 2, 2, 1, 1, 2, 1]
    assert windows(10, (0, 6, 0)) == [4, 2, 4]
    assert windows(10, (3,), start=4) == [2, 3, 1]
    for steps, every in ((10, ()), (10, (1,)), (10, (3,)), (13, (2, 3)), (10, (0, 6, 0)), (2, (5,))):
        assert window_steps(0, iterations=4, steps=steps, every=every) == max(windows(steps, every))
