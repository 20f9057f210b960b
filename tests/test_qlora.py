"""LoRA on a 4-bit (NF4) base in the core: the spec and its flag, host and upload bytes, the dequantisation's time
in the plan, the floor and the simulator, `inspect coverage`; LoRA's clipping barrier in the schedule."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tinypipe.cli import main
from tinypipe.common.errors import InputError
from tinypipe.compiler import compile_schedule
from tinypipe.compiler.compile import make_plan
from tinypipe.compiler.validate import validate
from tinypipe.describe.hardware import HOST, load_hardware
from tinypipe.describe.hfconfig import load_model
from tinypipe.describe.trace import trace_for
from tinypipe.estimate.coverage import COVERAGE_MODELS, coverage
from tinypipe.estimate.floor import schedule_floor
from tinypipe.estimate.lora_costs import base_load_bytes, dequant_s, frozen_host_bytes
from tinypipe.ir.kinds import Cost, Kind
from tinypipe.ir.order import predecessors
from tinypipe.ir.schedule import Schedule
from tinypipe.policy.lora_spec import ROLES, LoraSpec, lora_from_flags, lora_text
from tinypipe.policy.policy import PRESETS, Policy
from tinypipe.sim import simulate
from tinypipe.sim.durations import action_costs

ALL = LoraSpec(rank=16, alpha=32, targets=ROLES)
NF4 = dataclasses.replace(ALL, nf4=True)


def test_the_4bit_base_is_part_of_the_spec_and_not_of_the_adapters() -> None:
    """`nf4` prints as `,nf4` in the schedule's header and the policy JSON and parses back; a bf16 base's record is
    unchanged; a trace names the adapters alone (the base's form changes the uploads, not FWD / BWD);
    --load-in-4bit without --lora is an error naming both."""
    assert NF4.text() == "r16,a32,d0,q+k+v+o+gate+up+down,nf4" and LoraSpec.parse(NF4.text()) == NF4
    assert lora_text(NF4) == lora_text(ALL) == ALL.text()
    assert Policy.from_json(Policy(name="x", lora=NF4).to_json()).lora == NF4
    assert "nf4" not in ALL.to_json() and NF4.to_json()["nf4"] is True
    with pytest.raises(InputError):
        LoraSpec.parse("r16,a32,d0,q,int4")
    with pytest.raises(InputError, match="--load-in-4bit needs --lora R"):
        lora_from_flags(None, load_in_4bit=True)
    assert lora_from_flags(16, 32, None, "all", load_in_4bit=True) == NF4


def test_host_and_upload_bytes_of_llama_8b_in_4_bits() -> None:
    """Llama-3.1-8B: each block's seven linears (218,103,808 weights) as NF4 at 0.5625 B a weight, its norms and
    the embedding and head in bf16. The host copy: 16,060,522,496 B in bf16, 6,027,747,328 B in 4 bits (5.61 GiB);
    a block's LOAD carries 122,699,776 B instead of 436,224,000 (3.56x fewer), and dequantising it on an H200
    costs 7 launches of 10 us plus 558,891,008 B read and written at 0.8 x 4,800 GB/s."""
    m = load_model("llama-3.1-8b")
    gpu = load_hardware("h200x1").gpus[0]
    assert frozen_host_bytes(m).total_bytes == 2 * m.params == 16_060_522_496
    assert frozen_host_bytes(m, nf4=True).total_bytes == 6_027_747_328
    block = m.layers[1]
    assert (base_load_bytes(block, ALL, "bf16"), base_load_bytes(block, NF4, "bf16")) == (436_224_000, 122_699_776)
    assert base_load_bytes(m.layers[0], NF4, "bf16") == base_load_bytes(m.layers[0], ALL, "bf16")  # stays bf16
    assert dequant_s(block, NF4, gpu, "bf16") == pytest.approx(7 * 10e-6 + 558_891_008 / (0.8 * 4800e9))
    assert dequant_s(block, ALL, gpu, "bf16") == 0.0


def test_plan_floor_and_simulator_carry_the_packed_bytes_and_the_dequantisation() -> None:
    """Llama-3.1-8B LoRA on one H200: the schedule's LOADs carry the NF4 bytes while each allocates the bf16
    weights; the simulator costs each block's LOAD as its copy plus the dequantisation (in the copy's fixed cost),
    the floor adds it to the upload lane; the host peak is the NF4 copy (2.66x under the bf16 base's)."""
    m = load_model("llama-3.1-8b")
    hw = load_hardware("h200x1")
    tr = trace_for(m, hw.gpus[0], 1, 2048)
    pol = PRESETS["tinypipe"].replace(microbatches=8)
    plain = compile_schedule(pol.replace(lora=ALL), m, hw, tr, iterations=2)
    four = compile_schedule(pol.replace(lora=NF4), m, hw, tr, iterations=2)
    validate(four)
    assert Schedule.loads(four.dumps()) == four
    loads = [a for a in four.actions if a.kind is Kind.LOAD and a.layer == 1]
    assert loads and all(a.nbytes == 122_699_776 for a in loads)
    assert all(x.nbytes == 436_224_000 for a in loads for x in a.allocs if x.buffer.startswith("w."))
    partner: dict[int, int] = {}
    _, cost, _ = action_costs(four, m, hw, tr, partner)
    _, cost_plain, _ = action_costs(plain, m, hw, tr, partner)
    first = next(a for a in plain.actions if a.kind is Kind.LOAD and a.layer == 1)
    assert cost[loads[0].id][1] == pytest.approx(cost_plain[first.id][1] + dequant_s(m.layers[1], NF4, hw.gpus[0],
                                                                                       "bf16"))
    floor4, floor = schedule_floor(four, m, hw, tr), schedule_floor(plain, m, hw, tr)
    ups = [a for a in four.actions if a.kind.info.cost is Cost.UPLOAD]
    rate = hw.route(HOST, hw.gpus[0].name).bottleneck_gbps * 1e9
    dq = sum(dequant_s(m.layers[a.layer], NF4, hw.gpus[0], "bf16") for a in ups if a.kind is Kind.LOAD)
    assert floor4.h2d_s == pytest.approx((sum(a.nbytes for a in ups) / rate + dq) / four.iterations)
    assert floor4.h2d_s < floor.h2d_s / 2
    sim4, sim = simulate(four, m, hw, tr), simulate(plain, m, hw, tr)
    assert sim4.peak_host_bytes == frozen_host_bytes(m, nf4=True).total_bytes
    assert sim.peak_host_bytes == frozen_host_bytes(m).total_bytes
    plan = make_plan(pol.replace(lora=NF4), m, hw, tr, iterations=2)
    assert plan.load_bytes[1] == 122_699_776 and plan.weight_bytes[1] == 436_224_000
    assert plan.load_s[1] == dequant_s(m.layers[1], NF4, hw.gpus[0], "bf16") and plan.load_s[0] == 0.0


def test_coverage_fits_llama_70b_4bit_lora_on_a_24gb_gpu_with_64gb_host(capsys: pytest.CaptureFixture[str]) -> None:
    """rtx4090x1 (24 GiB GPU, 64 GiB host): LoRA on a bf16 base stops at Qwen3-32B (Llama-3.1-70B's base is
    131 GiB), on a 4-bit base it reaches Llama-3.1-70B (39.8 GiB: NF4 linears, bf16 embedding and head); the
    command prints the column."""
    rows = coverage(load_hardware("rtx4090x1"), [load_model(n) for n in COVERAGE_MODELS])
    got = {r["host_gib"]: (r["tinypipe LoRA"], r["tinypipe LoRA 4-bit"]) for r in rows}
    assert got[64] == ("qwen3-32b", "llama-3.1-70b") and got[128] == ("qwen3-32b", "llama-3.1-70b")
    assert frozen_host_bytes(load_model("llama-3.1-70b"), nf4=True).total_bytes == 42_709_041_152
    assert main(["inspect", "coverage", "--hardware", "rtx4090x1", "--json"]) == 0
    (server,) = json.loads(capsys.readouterr().out)["servers"]
    assert server["rows"][0]["host_gib"] == 64 and server["rows"][0]["tinypipe LoRA 4-bit"] == "llama-3.1-70b"
    assert main(["inspect", "coverage", "--hardware", "rtx4090x1"]) == 0
    out = capsys.readouterr().out
    assert "tinypipe LoRA 4-bit" in out and "--load-in-4bit" in out


def test_the_flag_reaches_simulate_and_search_and_needs_lora(capsys: pytest.CaptureFixture[str]) -> None:
    """`simulate --lora R --load-in-4bit` plans the NF4 host copy; without --lora it is `error:` and exit 2."""
    assert main(["simulate", "--model", "llama-3.1-8b", "--hardware", "h200x1", "--policy", "tinypipe", "--lora",
                 "16", "--lora-targets", "all", "--load-in-4bit", "--iterations", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out[0] if isinstance(out, list) else out
    text = json.dumps(row)
    assert str(frozen_host_bytes(load_model("llama-3.1-8b"), nf4=True).total_bytes) in text
    assert main(["simulate", "--load-in-4bit"]) == 2
    assert "--load-in-4bit needs --lora R" in capsys.readouterr().err


def test_lora_clipping_puts_every_adapter_step_behind_the_last_backward() -> None:
    """LoRA with clipping on 2 GPUs: each GPU's ADAPT_STEPs of an iteration follow every BWD of the iteration on
    every GPU (a barrier the backend meets with an all-reduce), in layer order, before the next iteration's FWD
    on their GPU; a GPU whose layers carry no adapters (here the one holding only the embedding) has one empty
    step so that it joins the all-reduce. The validator accepts it and the simulator runs it."""
    m = load_model("tiny-llama")
    hw = load_hardware("h200x2")
    tr = trace_for(m, hw.gpus[0], 1, 64)
    pol = PRESETS["tinypipe"].replace(lora=ALL, microbatch_size=1, microbatches=2, packing=(1, 5), mapping=(0, 1))
    s = compile_schedule(pol, m, hw, tr, iterations=2, grad_clip=True)
    validate(s)
    before = predecessors(s.actions)
    for it in range(2):
        bwds = {a.id for a in s.actions if a.kind is Kind.BWD and a.iteration == it}
        steps = [a for a in s.actions if a.kind is Kind.ADAPT_STEP and a.iteration == it]
        assert [(a.resource, a.layer) for a in steps] == [("g0.compute", 0)] + [("g1.compute", k) for k in
                                                                                  range(1, 5)]
        assert steps[0].nbytes == 0 and all(a.nbytes > 0 for a in steps[1:])
        last = {max(b for b in bwds if s.actions[b].resource == r) for r in ("g0.compute", "g1.compute")}
        assert all(last <= set(a.deps) | set(before[a.id]) for a in steps)
        assert min(a.id for a in steps) > max(bwds)
    assert simulate(s, m, hw, tr).iteration_s > 0
