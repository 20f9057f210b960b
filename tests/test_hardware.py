"""Hardware presets, routing over the PCIe/NVLink graph, and loader errors."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinypipe import traces as shipped
from tinypipe.common.errors import InputError
from tinypipe.describe.hardware import Hardware, Route, load_hardware, shipped_hardware

PRESETS = ["h100x1", "h200x1", "h200x2", "rtx3090x4-pcie3", "rtx3090x8-pcie3", "rtx4090x1", "rtx4090x8-pcie4"]


def _preset_json(name: str) -> Any:
    path = shipped.path("hardware", name)
    assert path is not None
    return json.loads(path.read_text())


def _write(tmp: Path, obj: Any, name: str = "hw.json") -> str:
    p = tmp / name
    p.write_text(json.dumps(obj))
    return str(p)


def test_shipped_names() -> None:
    """The seven presets ship and are listed by name."""
    assert shipped_hardware() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_round_trips(name: str) -> None:
    """Every preset loads, says where its numbers come from, and survives to_json/from_json."""
    hw = load_hardware(name)
    assert hw.name == name
    assert hw.provenance == ("measured" if name.startswith("h200") else "spec")
    assert len(hw.source) > 100
    assert [g.name for g in hw.gpus] == [f"gpu{i}" for i in range(len(hw.gpus))]
    assert Hardware.from_json(hw.to_json()) == hw
    for g in hw.gpus:  # every GPU reaches the host over PCIe, through the host DMA cap
        r = hw.route("host", g.name)
        assert r.through_host and r.nodes[0] == "host" and r.nodes[-1] == g.name


def test_preset_table() -> None:
    """GPU count, model, GPU memory, host DRAM, DMA cap and CPU Adam rate of each preset."""
    rows = []
    for name in PRESETS:
        hw = load_hardware(name)
        rows.append((name, len(hw.gpus), hw.gpu(0).model, hw.gpu(0).memory_bytes, hw.host.memory_bytes,
                     hw.host.dma_gbps, hw.host.adam_params_per_s, hw.gpu_p2p))
    assert rows == [
        ("h100x1", 1, "H100", 85_017_493_504, 135_129_059_328, 99.5, 3.91e9, True),
        ("h200x1", 1, "H200", 150_109_880_320, 135_128_870_912, 99.5, 3.91e9, True),
        ("h200x2", 2, "H200", 150_109_880_320, 270_334_464_000, 143.0, 5.9e9, True),
        ("rtx3090x4-pcie3", 4, "RTX 3090", 24 * 2**30, 192 * 2**30, 24.0, 3.5e9, False),
        ("rtx3090x8-pcie3", 8, "RTX 3090", 24 * 2**30, 384 * 2**30, 48.0, 7.0e9, False),
        ("rtx4090x1", 1, "RTX 4090", 24 * 2**30, 64 * 2**30, 50.0, 2.1e9, False),
        ("rtx4090x8-pcie4", 8, "RTX 4090", 24 * 2**30, 1024 * 2**30, 100.0, 1.02e10, False),
    ]


def test_h200x2_routes() -> None:
    """h200x2: host->gpu0 over PCIe at 55 GB/s through the host; gpu0->gpu1 over NVLink at 390 GB/s."""
    hw = load_hardware("h200x2")
    assert hw.route("host", "gpu0") == Route(
        nodes=("host", "rc0", "gpu0"), edges=(("host", "rc0"), ("rc0", "gpu0")),
        bottleneck_gbps=55.0, latency_s=5e-6, through_host=True)
    assert hw.route("gpu1", "host") == Route(
        nodes=("gpu1", "rc0", "host"), edges=(("gpu1", "rc0"), ("rc0", "host")),
        bottleneck_gbps=55.0, latency_s=5e-6, through_host=True)
    assert hw.route("gpu0", "gpu1") == Route(
        nodes=("gpu0", "gpu1"), edges=(("gpu0", "gpu1"),), bottleneck_gbps=390.0, latency_s=5e-6,
        through_host=False)


def test_rtx4090x8_routes_without_p2p_go_through_host() -> None:
    """rtx4090x8: host->gpu5 via the second socket's switch; GPU->GPU is staged through host memory."""
    hw = load_hardware("rtx4090x8-pcie4")
    assert hw.route("host", "gpu5") == Route(
        nodes=("host", "rc1", "sw1", "gpu5"), edges=(("host", "rc1"), ("rc1", "sw1"), ("sw1", "gpu5")),
        bottleneck_gbps=25.0, latency_s=5e-6, through_host=True)
    assert hw.route("gpu0", "gpu5") == Route(
        nodes=("gpu0", "sw0", "rc0", "host", "rc1", "sw1", "gpu5"),
        edges=(("gpu0", "sw0"), ("sw0", "rc0"), ("rc0", "host"), ("host", "rc1"), ("rc1", "sw1"),
               ("sw1", "gpu5")),
        bottleneck_gbps=25.0, latency_s=1e-5, through_host=True)
    # same switch, still no P2P: down to host and back up the same uplink (opposite directions)
    assert hw.route("gpu0", "gpu1").nodes == ("gpu0", "sw0", "rc0", "host", "rc0", "sw0", "gpu1")


def test_p2p_routes_use_lowest_common_switch() -> None:
    """With gpu_p2p, GPU->GPU goes through the lowest common switch, or across UPI between sockets."""
    obj = _preset_json("rtx4090x8-pcie4")
    obj["gpu_p2p"] = True
    hw = Hardware.from_json(obj, "p2p.json")
    assert hw.route("gpu0", "gpu1") == Route(
        nodes=("gpu0", "sw0", "gpu1"), edges=(("gpu0", "sw0"), ("sw0", "gpu1")),
        bottleneck_gbps=25.0, latency_s=1e-5, through_host=False)
    assert hw.route("gpu0", "gpu5").nodes == ("gpu0", "sw0", "rc0", "rc1", "sw1", "gpu5")
    assert not hw.route("gpu0", "gpu5").through_host


def test_route_is_cached_and_trivial_route() -> None:
    """A repeated route() returns the very same object; a node to itself is an empty route."""
    hw = load_hardware("rtx3090x8-pcie3")
    assert hw.route("gpu2", "gpu6") is hw.route("gpu2", "gpu6")
    assert hw.route("gpu3", "gpu3") == Route(("gpu3",), (), math.inf, 0.0, False)
    with pytest.raises(InputError, match="no node 'gpu9'"):
        hw.route("host", "gpu9")


def test_graph_attributes() -> None:
    """graph(): node kinds host | rc | switch | gpu, edges carry kind, gbps and latency_s."""
    g = load_hardware("rtx3090x4-pcie3").graph()
    assert dict(g.nodes(data="kind")) == {"host": "host", "rc0": "rc", "sw0": "switch", "gpu0": "gpu",
                                          "gpu1": "gpu", "gpu2": "gpu", "gpu3": "gpu"}
    assert g.edges["sw0", "rc0"] == {"kind": "pcie", "gbps": 12.0, "latency_s": 0.0}
    assert g.edges["gpu2", "sw0"] == {"kind": "pcie", "gbps": 12.0, "latency_s": 5e-6}
    assert g.nodes["gpu1"]["memory_bytes"] == 24 * 2**30


def test_gpu_lookup() -> None:
    """gpu(i) is the GPU named gpu{i}; an index out of range is an InputError."""
    hw = load_hardware("h200x2")
    assert hw.gpu(1).name == "gpu1"
    with pytest.raises(InputError, match="no GPU 2"):
        hw.gpu(2)


def test_unknown_name_lists_presets() -> None:
    """An unknown name is an InputError that lists the shipped presets."""
    with pytest.raises(InputError, match="unknown hardware 'dgx9'.*rtx4090x8-pcie4"):
        load_hardware("dgx9")


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda o: o["host"].__setitem__("memory_bytes", -1), r"hw\.json: host\.memory_bytes: must be >= 1"),
    (lambda o: o.pop("links"), r"hw\.json: links: missing required field"),
    (lambda o: o["gpu"].__setitem__("matmul_flops", "x"), r"hw\.json: gpu\.matmul_flops: expected a number"),
    (lambda o: o["links"][1].__setitem__("b", "sw7"), r"hw\.json: links\[1\]\.b: unknown node 'sw7'"),
    (lambda o: o["links"].append({"a": "gpu0", "b": "rc0", "kind": "pcie", "gbps": 1, "latency_s": 0}),
     r"hw\.json: links\[4\]: a second link between 'gpu0' and 'rc0'"),
    (lambda o: o["links"][3].__setitem__("kind", "ethernet"), r"hw\.json: links\[3\]\.kind: must be one of"),
    (lambda o: o.__setitem__("gpus", []), r"hw\.json: gpus: give either"),
    (lambda o: o.__setitem__("gpu_count", 10**9), r"hw\.json: gpu_count: must be <= 4096"),
])
def test_bad_fields_name_file_and_field(tmp_path: Path, mutate: Any, message: str) -> None:
    """A mistyped, negative or dangling field is a one-line InputError naming the file and the field."""
    obj = _preset_json("h200x2")
    mutate(obj)
    with pytest.raises(InputError, match=message) as info:
        load_hardware(_write(tmp_path, obj))
    assert "\n" not in str(info.value)


def test_a_gpu_keeps_the_allocators_slack(tmp_path: Path) -> None:
    """A hardware JSON's GPUs keep ALLOCATOR_SLACK_BYTES free for PyTorch's allocator unless the field says
    otherwise; it round-trips, and a slack of the whole memory is refused."""
    from tinypipe.describe.hardware import ALLOCATOR_SLACK_BYTES

    hw = load_hardware("h200x1")
    assert hw.gpus[0].allocator_slack_bytes == ALLOCATOR_SLACK_BYTES == 512 << 20
    assert hw.gpus[0].usable_bytes(24 << 30) == (24 << 30) - (512 << 20)
    assert hw.gpus[0].usable_bytes() == hw.gpus[0].memory_bytes - (512 << 20)
    obj = _preset_json("h200x2")
    obj["gpu"]["allocator_slack_bytes"] = 0
    zero = load_hardware(_write(tmp_path, obj))
    assert [g.allocator_slack_bytes for g in zero.gpus] == [0, 0]
    assert Hardware.from_json(zero.to_json()) == zero
    obj["gpu"]["allocator_slack_bytes"] = obj["gpu"]["memory_bytes"]
    with pytest.raises(InputError, match=r"gpu\.allocator_slack_bytes: must be less than memory_bytes"):
        load_hardware(_write(tmp_path, obj))


def test_unreachable_gpu_is_named(tmp_path: Path) -> None:
    """A GPU joined to the others only by NVLink, not to the host over PCIe, is an error naming it."""
    obj = _preset_json("h200x2")
    obj["links"] = [x for x in obj["links"] if x["b"] != "gpu1"]
    with pytest.raises(InputError, match=r"hw\.json: gpus\[1\]: gpu1 is not reachable from host"):
        load_hardware(_write(tmp_path, obj))


def test_malformed_json(tmp_path: Path) -> None:
    """Malformed JSON and a missing file are InputErrors naming the file."""
    p = tmp_path / "bad.json"
    p.write_text('{"name": ')
    with pytest.raises(InputError, match="bad.json: malformed JSON"):
        load_hardware(str(p))
    with pytest.raises(InputError, match="nothere.json: file not found"):
        load_hardware(str(tmp_path / "nothere.json"))


# ---- properties --------------------------------------------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**63)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
            | st.sampled_from(["host", "rc0", "sw0", "gpu0", "gpu1", "pcie", "nvlink", "measured"]))
json_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.text(max_size=8) | st.sampled_from(["name", "host", "gpus", "links", "gpu", "gpu_count"]), c,
    max_size=4), max_leaves=16)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(obj: Any, data: st.DataObject) -> Any:
    obj = copy.deepcopy(obj)
    path = data.draw(st.sampled_from(_paths(obj)[1:]))
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    op = data.draw(st.sampled_from(["delete", "replace", "negate"]))
    if op == "delete":
        del parent[path[-1]]
    elif op == "negate" and type(parent[path[-1]]) in (int, float):
        parent[path[-1]] = -parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(json_values)
    return obj


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=json_values)
def test_arbitrary_json_only_raises_input_error(tmp_path: Path, value: Any) -> None:
    """Whatever JSON a hardware file holds, loading it returns a Hardware or raises InputError."""
    try:
        load_hardware(_write(tmp_path, value))
    except InputError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(PRESETS), data=st.data())
def test_mutated_presets_only_raise_input_error(tmp_path: Path, name: str, data: st.DataObject) -> None:
    """A preset with one field deleted, negated or replaced loads cleanly or raises InputError,
    and whatever loads routes host<->GPU and GPU<->GPU."""
    obj = _mutate(_preset_json(name), data)
    try:
        hw = load_hardware(_write(tmp_path, obj))
    except InputError as exc:
        assert "\n" not in str(exc) and "hw.json" in str(exc)
        return
    for g in hw.gpus:
        assert hw.route("host", g.name).bottleneck_gbps > 0
        assert hw.route(g.name, hw.gpus[0].name).latency_s >= 0


def test_huge_integer_is_input_error(tmp_path: Path) -> None:
    """An integer too large for a float in a float field is an InputError, not an OverflowError."""
    obj = _preset_json("h200x1")
    obj["links"][0]["gbps"] = 10**400
    with pytest.raises(InputError, match="gbps"):
        load_hardware(_write(tmp_path, obj))
