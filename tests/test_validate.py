"""The validator: a compiled schedule passes; hand-broken ones fail with the right summary and marked grid."""

from __future__ import annotations

import dataclasses

import pytest

from tinypipe.common.errors import ScheduleError
from tinypipe.compiler import run_passes
from tinypipe.compiler.validate import validate
from tinypipe.estimate.plan import Plan
from tinypipe.ir.schedule import Action, Kind, Schedule


def small(**kw: object) -> Schedule:
    """4 layers in 4 packs on 2 GPUs, 2 microbatches, 2 iterations, straight from the passes."""
    plan = Plan.toy((1, 1, 1, 1), (0, 1, 0, 1), 2, iterations=2, **kw)
    return Schedule(actions=run_passes(plan), num_gpus=2, num_layers=4, iterations=2, microbatches=2,
                    tokens_per_microbatch=8, recompute=plan.recompute, pack_layers=plan.pack_layers,
                    pack_gpu=plan.pack_gpu, host_memory=plan.host_memory)


def with_actions(s: Schedule, actions: list[Action]) -> Schedule:
    return dataclasses.replace(s, actions=tuple(actions), _by_resource=None)


def edit(s: Schedule, aid: int, **changes: object) -> Schedule:
    acts = list(s.actions)
    acts[aid] = dataclasses.replace(acts[aid], **changes)  # type: ignore[arg-type]
    return with_actions(s, acts)


def drop(s: Schedule, aid: int) -> Schedule:
    """Remove one action, renumbering the others and their deps."""
    acts = []
    for a in s.actions:
        if a.id == aid:
            continue
        deps = tuple(d - (d > aid) for d in a.deps if d != aid)
        acts.append(dataclasses.replace(a, id=a.id - (a.id > aid), deps=deps))
    return with_actions(s, acts)


def find(s: Schedule, kind: Kind, layer: int, mb: int | None = None, it: int = 0, nth: int = 0) -> Action:
    hits = [a for a in s.actions if a.kind is kind and a.layer == layer and a.iteration == it
            and (mb is None or a.microbatch == mb)]
    return hits[nth]


def failure(s: Schedule) -> list[str]:
    with pytest.raises(ScheduleError) as info:
        validate(s)
    lines = str(info.value).splitlines()
    assert lines[1].startswith("step"), "the grid follows the one-line summary"
    return lines


@pytest.mark.parametrize("kw", [{}, {"swap": "pack"}, {"activation_home": "host"}, {"optimizer": "async"},
                                {"recompute": False, "host_memory": "replicated"}])
def test_compiled_schedule_is_valid(kw: dict) -> None:
    """Compiled schedules pass every check, and still pass after a text round trip."""
    s = small(**kw)
    validate(s)
    validate(Schedule.loads(s.dumps()))


def test_cycle() -> None:
    """A dependency that closes a loop is reported as a cycle, its first action marked."""
    s = small()
    f, b = find(s, Kind.FWD, 0, 0), find(s, Kind.BWD, 0, 0)
    lines = failure(edit(s, f.id, deps=(*f.deps, b.id)))
    assert lines[0].startswith("dependency cycle (deps, stream order and SEND/RECV pairs): ")
    assert f"{f.id} (g0.compute FWD L0 m0)" in lines[0]
    assert any(">>" in ln for ln in lines[2:])


def test_fwd_before_load() -> None:
    """A FWD that does not wait for its layer's LOAD is 'not loaded', with that FWD marked."""
    s = small()
    f = find(s, Kind.FWD, 1, 0)
    load = find(s, Kind.LOAD, 1)
    assert load.id in f.deps
    lines = failure(edit(s, f.id, deps=tuple(d for d in f.deps if d != load.id)))
    assert lines[0] == (f"not loaded: action {f.id} (g1.compute FWD L1 m0) may run before a LOAD of layer 1 on g1 "
                        f"finishes (nearest action {load.id} (g1.h2d LOAD L1)); make it depend on that LOAD")
    assert any(">>F1.0<<" in ln for ln in lines)


def test_unpaired_send() -> None:
    """A SEND whose RECV is missing is reported as unpaired, the SEND marked."""
    s = small()
    recv = [a for a in s.actions if a.kind in (Kind.RECV_F, Kind.RECV_B) and a.resource == "g1.recv"][-1]
    send = s.actions[recv.id - 1]
    assert send.kind in (Kind.SEND_F, Kind.SEND_B)
    lines = failure(drop(s, recv.id))
    assert lines[0].startswith(f"unpaired SEND: action {send.id} ({send}) has no matching RECV on g{send.peer}")
    assert any(f">>{send.label}<<" in ln for ln in lines)


def test_pairs_out_of_order() -> None:
    """Two RECVs swapped on one side no longer match their SENDs in order."""
    s = small()
    recvs = [a for a in s.actions if a.kind in (Kind.RECV_F, Kind.RECV_B) and a.resource == "g1.recv"]
    a, b = recvs[0], recvs[1]
    s2 = edit(edit(s, a.id, microbatch=b.microbatch, layer=b.layer), b.id, microbatch=a.microbatch, layer=a.layer)
    lines = failure(s2)
    assert lines[0].startswith("SEND/RECV out of order: pair 0 from g0 to g1 joins")


def test_pair_of_two_directions() -> None:
    """A SEND_F whose RECV says RECV_B: the halves disagree on the direction, both marked."""
    s = small()
    recv = [a for a in s.actions if a.kind is Kind.RECV_F and a.resource == "g1.recv"][0]
    lines = failure(edit(s, recv.id, kind=Kind.RECV_B))
    assert lines[0].startswith("SEND/RECV out of order: pair 0 from g0 to g1 joins")
    assert lines[0].endswith("the halves must name the same layer, microbatch, iteration, bytes and direction, "
                             "in the same order on both sides")


def test_unbalanced_memory() -> None:
    """An EVICT that frees nothing leaves the weights allocated: 'memory does not balance', LOAD marked."""
    s = small()
    ev = [a for a in s.actions if a.kind is Kind.EVICT and a.layer == 2][-1]
    load = [a for a in s.actions if a.kind is Kind.LOAD and a.layer == 2][-1]
    lines = failure(edit(s, ev.id, frees=()))
    assert lines[0] == (f"memory does not balance: g0:w.L2 ({load.nbytes} B) allocated by action {load.id} "
                        f"(g0.h2d LOAD L2) is never freed (1 buffer left at the end)")
    assert any(">>LD2<<" in ln for ln in lines)


def test_freed_but_not_allocated() -> None:
    """Freeing a buffer nobody allocated is reported at the freeing action."""
    s = small()
    load = find(s, Kind.LOAD, 3)
    lines = failure(edit(s, load.id, allocs=()))
    assert lines[0].startswith("memory does not balance: action ")
    assert lines[0].endswith("frees g1:w.L3, which is not allocated")


def test_cross_gpu_dependency() -> None:
    """A dependency between GPUs outside a SEND/RECV pair breaks the contract's rule."""
    s = small()
    f1, f0 = find(s, Kind.FWD, 1, 0), find(s, Kind.FWD, 0, 0)
    lines = failure(edit(s, f1.id, deps=(*f1.deps, f0.id)))
    assert lines[0].startswith(f"cross-GPU dependency: action {f1.id} (g1.compute FWD L1 m0) depends on "
                               f"action {f0.id} (g0.compute FWD L0 m0) on g0")


def test_wrong_work_count() -> None:
    """Every iteration has exactly M FWD and M BWD per layer: a missing BWD is named."""
    s = small()
    b = find(s, Kind.BWD, 2, 1, it=1)
    lines = failure(drop(s, b.id))
    assert lines[0].startswith("wrong work count: 0 BWD of layer 2 microbatch 1 in iteration 1")


def test_bad_stream() -> None:
    """A kind on the wrong stream is refused."""
    s = small()
    load = find(s, Kind.LOAD, 0)
    lines = failure(edit(s, load.id, resource="g0.d2h"))
    assert lines[0] == f"action {load.id} (g0.d2h LOAD L0): LOAD runs on the h2d stream, not d2h"
