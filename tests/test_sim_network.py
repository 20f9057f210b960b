"""Fluid copies: latency then bytes at a max-min fair share of every capacity crossed (sim/network.py).

Every test drives the Network directly with literal capacities and asserts a literal event log:
`<time in µs> end <copy>` lines and `<time in µs> rates <copy>=<GB/s> ...` probes.
"""

from __future__ import annotations

from collections.abc import Mapping

import simpy

from tinypipe.sim.network import Flow, Network, max_min_rates

GB = 1e9


def run(capacity: Mapping[str, float], copies: list[tuple[str, float, float, float, tuple[str, ...]]],
        probes: tuple[float, ...] = ()) -> list[str]:
    """Start each copy (name, start_s, bytes, latency_s, capacities) at its time; log ends and rate probes."""
    env = simpy.Environment()
    net = Network(env, {k: v * GB for k, v in capacity.items()})
    log: list[tuple[float, int, str]] = []

    def start(name: str, t: float, nbytes: float, lat: float, links: tuple[str, ...]):  # type: ignore[no-untyped-def]
        yield env.timeout(t)
        done = net.copy(nbytes, lat, links, label=name)
        done.callbacks.append(lambda _e: log.append((env.now, len(log), f"end {name}")))

    def probe(t: float):  # type: ignore[no-untyped-def]
        yield env.timeout(t)
        rates = " ".join(f"{k}={v / GB:g}" for k, v in sorted(net.rates().items()))
        log.append((env.now, len(log), f"rates {rates}"))

    for c in copies:
        env.process(start(*c))
    for t in probes:
        env.process(probe(t))
    env.run()
    return [f"{t * 1e6:.3f} {what}" for t, _, what in sorted(log)]


def test_one_copy_ends_at_latency_plus_bytes_over_bandwidth() -> None:
    """B bytes over a link of β bytes/s with latency α end at α + B/β (5 µs + 1 GB / 25 GB/s)."""
    assert run({"l": 25}, [("a", 0.0, 1e9, 5e-6, ("l",))]) == ["40005.000 end a"]


def test_two_concurrent_copies_share_a_link_equally() -> None:
    """Two 1 GB copies started together on a 25 GB/s link each get 12.5 GB/s and end together at 80 ms."""
    log = run({"l": 25}, [("a", 0.0, 1e9, 0.0, ("l",)), ("b", 0.0, 1e9, 0.0, ("l",))], probes=(0.01,))
    assert log == ["10000.000 rates a=12.5 b=12.5", "80000.000 end a", "80000.000 end b"]


def test_a_later_copy_gets_its_share_from_its_start() -> None:
    """a (1 GB) runs alone for 20 ms (0.5 GB moved), shares until it ends at 60 ms, then b runs alone to 80 ms."""
    log = run({"l": 25}, [("a", 0.0, 1e9, 0.0, ("l",)), ("b", 0.02, 1e9, 0.0, ("l",))],
              probes=(0.01, 0.03, 0.07))
    assert log == ["10000.000 rates a=25", "30000.000 rates a=12.5 b=12.5", "60000.000 end a",
                   "70000.000 rates b=25", "80000.000 end b"]


def test_latency_uses_no_bandwidth() -> None:
    """While b waits out its 10 ms latency, a keeps the whole link; they share only after."""
    log = run({"l": 25}, [("a", 0.0, 1e9, 0.0, ("l",)), ("b", 0.0, 0.25e9, 0.01, ("l",))], probes=(0.005,))
    # a: 0.25 GB alone by 10 ms; then 12.5 GB/s each: b's 0.25 GB take 20 ms (ends 30 ms), a has
    # 0.5 GB left at 30 ms, alone at 25 GB/s: 20 ms more.
    assert log == ["5000.000 rates a=25", "30000.000 end b", "50000.000 end a"]


def test_switch_uplink_is_shared_and_other_switch_is_not() -> None:
    """gpu0 and gpu1 sit under sw0 (25 GB/s uplink), gpu2 under sw1: the first two split the uplink."""
    cap = {"host->sw0": 25, "sw0->gpu0": 25, "sw0->gpu1": 25, "host->sw1": 25, "sw1->gpu2": 25}
    log = run(cap, [("g0", 0.0, 1e9, 0.0, ("host->sw0", "sw0->gpu0")),
                    ("g1", 0.0, 1e9, 0.0, ("host->sw0", "sw0->gpu1")),
                    ("g2", 0.0, 1e9, 0.0, ("host->sw1", "sw1->gpu2"))], probes=(0.001,))
    assert log == ["1000.000 rates g0=12.5 g1=12.5 g2=25", "40000.000 end g2", "80000.000 end g0",
                   "80000.000 end g1"]


def test_host_dma_cap_limits_the_sum_max_min_fairly() -> None:
    """A 30 GB/s DMA cap over two uploads: one held to 10 GB/s by its own link, the other gets the 20 left."""
    cap = {"dma": 30, "h->gpu0": 10, "h->gpu1": 25}
    log = run(cap, [("slow", 0.0, 1e9, 0.0, ("h->gpu0", "dma")), ("fast", 0.0, 1e9, 0.0, ("h->gpu1", "dma"))],
              probes=(0.001, 0.06))
    # fast: 1 GB at 20 GB/s ends at 50 ms; slow has 0.5 GB left, still 10 GB/s: ends at 100 ms.
    assert log == ["1000.000 rates fast=20 slow=10", "50000.000 end fast", "60000.000 rates slow=10",
                   "100000.000 end slow"]


def test_both_directions_count_against_the_dma_cap() -> None:
    """Upload and download on separate directed edges still share a 30 GB/s DMA cap: 15 GB/s each."""
    cap = {"dma": 30, "h->g": 25, "g->h": 25}
    log = run(cap, [("up", 0.0, 0.3e9, 0.0, ("h->g", "dma")), ("down", 0.0, 0.3e9, 0.0, ("g->h", "dma"))],
              probes=(0.001,))
    assert log == ["1000.000 rates down=15 up=15", "20000.000 end up", "20000.000 end down"]


def test_a_copy_crossing_a_capacity_twice_uses_it_twice() -> None:
    """A GPU-to-GPU copy staged through host crosses the DMA cap twice: alone under 30 GB/s it gets 15."""
    cap = {"dma": 30, "g0->h": 25, "h->g1": 25}
    assert run(cap, [("x", 0.0, 0.3e9, 0.0, ("g0->h", "dma", "h->g1", "dma"))], probes=(0.001,)) == [
        "1000.000 rates x=15", "20000.000 end x"]


def test_zero_byte_copy_costs_its_latency() -> None:
    assert run({"l": 25}, [("a", 0.0, 0.0, 5e-6, ("l",))]) == ["5.000 end a"]


def test_max_min_rates_textbook_example() -> None:
    """Links 0 (capacity 1) and 1 (capacity 2); f1 on A, f2 on A+B, f3 on B."""
    env = simpy.Environment()
    flows = [Flow(n, links, 1.0, env.event()) for n, links in (("f1", (0,)), ("f2", (0, 1)), ("f3", (1,)))]
    max_min_rates(flows, [1.0, 2.0])
    assert [f.rate for f in flows] == [0.5, 0.5, 1.5]
