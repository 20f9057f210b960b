"""The host's stolen CPU time (`backends/rank/cpustat.py`), from /proc/stat's first line."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from tinypipe.backends.rank.cpustat import Steal, cpu_jiffies  # noqa: E402

# user nice system idle iowait irq softirq steal guest guest_nice
LINE = "cpu  {u} 0 {s} {i} 0 0 0 {st} 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"


def test_steal_is_the_stolen_share_of_all_cpu_time_between_two_reads(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(LINE.format(u=100, s=10, i=1000, st=5))
    assert cpu_jiffies(stat) == (1115, 5)  # guest time is inside user already: not added again
    meter = Steal(stat)
    stat.write_text(LINE.format(u=170, s=20, i=1110, st=25))  # +70 +10 +110 +20 = 210 ticks, 20 stolen
    assert meter.share() == pytest.approx(20 / 210)


def test_steal_is_unknown_without_proc_stat_or_elapsed_ticks(tmp_path: Path) -> None:
    assert cpu_jiffies(tmp_path / "missing") is None
    assert Steal(tmp_path / "missing").share() is None
    stat = tmp_path / "stat"
    stat.write_text("intr 1 2 3\n")
    assert cpu_jiffies(stat) is None
    stat.write_text(LINE.format(u=1, s=1, i=1, st=0))
    assert Steal(stat).share() is None  # no time passed between the two reads
