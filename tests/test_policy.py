"""Policy: invariants on construction, JSON round-trip, presets, loading errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinypipe.common.errors import InputError
from tinypipe.policy import PRESETS, Policy, load_policy
from tinypipe.policy.modes import MAPPERS, PACKERS, ActivationHome, HostMemory, OptimizerMode, ResidentMode, SwapMode

policies = st.builds(
    Policy,
    packing=st.sampled_from(PACKERS) | st.lists(st.integers(1, 8), min_size=1, max_size=6).map(tuple),
    mapping=st.sampled_from(MAPPERS) | st.lists(st.integers(0, 7), min_size=1, max_size=6).map(tuple),
    swap=st.sampled_from(tuple(SwapMode)), prefetch_depth=st.integers(0, 4),
    resident=st.sampled_from(tuple(ResidentMode)) | st.lists(st.integers(0, 9), max_size=3).map(tuple),
    host_memory=st.sampled_from(tuple(HostMemory)), microbatches=st.integers(1, 16), microbatch_size=st.integers(1, 8),
    recompute=st.just(True), optimizer=st.sampled_from(tuple(OptimizerMode)),
    activation_home=st.sampled_from(tuple(ActivationHome)),
)


@given(policies)
def test_json_round_trip(p: Policy) -> None:
    """Every valid policy survives to_json -> JSON text -> from_json unchanged."""
    assert Policy.from_json(json.loads(p.dumps())) == p


def test_presets_are_what_the_design_says() -> None:
    """resident keeps all layers; mobius swaps whole packs, replicated; tinypipe swaps layers, compact."""
    r, m, t = PRESETS["resident"], PRESETS["mobius"], PRESETS["tinypipe"]
    assert (r.resident, r.packing) == ("all", "per-gpu")
    assert (m.swap, m.prefetch_depth, m.host_memory) == ("pack", 1, "replicated")
    assert (m.packing, m.mapping) == ("mobius", "cross")
    assert (t.swap, t.host_memory, t.packing) == ("layer", "compact", "holistic")


@pytest.mark.parametrize("kw, msg", [
    ({"swap": "page"}, "swap: must be one of pack, layer"),
    ({"microbatches": 0}, "microbatches: must be an integer >= 1"),
    ({"packing": (3, 0)}, "packing: pack sizes"),
    ({"packing": "greedy"}, "packing: unknown packer 'greedy'"),
    ({"mapping": (-1,)}, "mapping: explicit mapping"),
    ({"recompute": False, "activation_home": "host"}, "activation_home: host needs recompute"),
])
def test_invariants(kw: dict, msg: str) -> None:
    """Invalid combinations are refused on construction with a message naming the field."""
    with pytest.raises(InputError, match=msg):
        Policy(**kw)


def test_load_policy_errors(tmp_path) -> None:
    """Unknown names, unknown fields and wrong types are one-line InputErrors naming the file."""
    with pytest.raises(InputError, match="unknown policy 'fastest'"):
        load_policy("fastest")
    f = tmp_path / "p.json"
    f.write_text('{"swap": "layer", "speed": 3}')
    with pytest.raises(InputError, match=r"p.json: unknown field 'speed'"):
        load_policy(str(f))
    f.write_text('{"microbatches": "four"}')
    with pytest.raises(InputError, match=r"p.json: microbatches: expected an integer"):
        load_policy(str(f))
    f.write_text('{"microbatches": 4')
    with pytest.raises(InputError, match=r"p.json: malformed JSON"):
        load_policy(str(f))


@pytest.mark.parametrize("field, value, allowed", [
    ("swap", "layers", "pack, layer"),
    ("host_memory", "compacted", "replicated, compact"),
    ("optimizer", "asynchronous", "sync, async"),
    ("activation_home", "cpu", "gpu, host"),
    ("packing", "greedy", "uniform, balanced, mobius, holistic, per-gpu"),
    ("mapping", "ring", "round-robin, cross"),
    ("resident", "some", "none, all, auto"),
])
def test_unknown_mode_in_a_file(tmp_path, field: str, value: str, allowed: str) -> None:
    """A mode the policy does not know is a one-line InputError naming the file, the field and the allowed
    values; it never falls back to another mode (`swap: layers` once ran as pack swapping)."""
    f = tmp_path / "p.json"
    f.write_text(json.dumps({field: value}))
    with pytest.raises(InputError) as err:
        load_policy(str(f))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{f}: ") and f"{field}: " in msg
    assert repr(value) in msg and allowed in msg


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=10))
def test_arbitrary_json_only_input_errors(obj: object) -> None:
    """Arbitrary JSON values give a Policy or an InputError, nothing else."""
    try:
        Policy.from_json(obj)
    except InputError:
        pass


@given(st.sampled_from(list(Policy().to_json())), st.none() | st.booleans() | st.integers(-3, 3)
       | st.text(max_size=4) | st.lists(st.integers(-1, 3), max_size=2) | st.floats())
def test_mutated_field_only_input_errors(key: str, value: object) -> None:
    """Setting any field of a valid policy to any value gives a Policy or an InputError."""
    d = PRESETS["tinypipe"].to_json()
    d[key] = value
    try:
        Policy.from_json(d)
    except InputError:
        pass


MISSPELLED = '''
from tinypipe.estimate.plan import Plan
from tinypipe.policy import Policy
from tinypipe.policy.modes import OptimizerMode

def modes(plan: Plan) -> None:
    Policy(swap="layers")
    Policy(host_memory="compact")
    assert plan.optimizer is OptimizerMode.ASYNCHRONOUS
'''


def test_mypy_catches_a_misspelled_mode(tmp_path) -> None:
    """The modes are typed values: a string where a mode is expected (misspelled or not) and a misspelled
    member are mypy errors."""
    pytest.importorskip("mypy")
    root = Path(__file__).resolve().parents[1]
    f = tmp_path / "misspelled.py"
    f.write_text(MISSPELLED)
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml"),
                        "--follow-imports=silent", "--no-incremental", str(f)],
                       capture_output=True, text=True, cwd=root, timeout=300)
    flagged = {int(line.split(":")[1]) for line in r.stdout.splitlines() if line.startswith(str(f))}
    assert flagged == {7, 8, 9}, r.stdout


@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_lora_with_low_precision_moments_is_refused(state: str, tmp_path: Path) -> None:
    """Under LoRA the adapters' AdamW state is fp32 on their GPU and the frozen base has none: a policy asking for
    bf16 or 8-bit moments with `lora` is refused (in a file, naming it), never run with fp32 moments; fp32 is
    what the run does, so it is accepted."""
    from tinypipe.policy.lora_spec import LoraSpec

    with pytest.raises(InputError, match=rf"policy 'custom': optimizer_state: {state} moments are the host "
                                         r"optimizer's; with lora the adapters' AdamW state is fp32"):
        Policy(lora=LoraSpec(rank=4), optimizer_state=state)  # type: ignore[arg-type]
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"name": "mine", "lora": {"rank": 4}, "optimizer_state": state}))
    with pytest.raises(InputError, match=rf"^{path}: policy 'mine': optimizer_state: {state} moments"):
        load_policy(str(path))
    with pytest.raises(InputError, match="optimizer_state"):
        Policy(optimizer_state=state).replace(lora=LoraSpec(rank=4))  # type: ignore[arg-type]
    assert Policy(lora=LoraSpec(rank=4), optimizer_state="fp32").lora == LoraSpec(rank=4)  # type: ignore[arg-type]
