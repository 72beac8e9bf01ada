"""What plan measures on the CPU beside real peer processes (paratrain.tools.busy), and their clean-up."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pytest

from paratrain.errors import ConfigError
from paratrain.tools import plan_measure
from paratrain.tools.plan_measure import measure_contention, running_beside
from paratrain.tools.settings import RunSettings
from paratrain.tools.workload import Workload
from processes import descendants

pytestmark = pytest.mark.slow  # `make slow` (and CI) runs these; `make test` leaves them


TINY = RunSettings(model="mlp", width=16, depth=1, input_shape="6", num_classes=3, batch_size=12)


def _busy_children() -> list[int]:
    found = []
    for pid in descendants(os.getpid()):
        try:
            if b"paratrain.tools.busy" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


@pytest.mark.processes
def test_peers_run_the_model_during_the_measurement_and_are_gone_after():
    work = Workload.load(TINY)
    with running_beside(work, batch=6, threads=1, others=2):
        running = _busy_children()
        assert len(running) == 2  # both printed "ready": they built the model and stepped it
    assert _busy_children() == []
    for pid in running:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _state(pid: int, wanted: str) -> str:
    """The process's state letter, polled for up to 5 s until it is one of ``wanted`` (signals are asynchronous)."""
    deadline = time.monotonic() + 5
    while True:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in wanted or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


@pytest.mark.processes
def test_peers_are_stopped_and_continued_between_the_measured_steps():
    with running_beside(Workload.load(TINY), batch=6, threads=1, others=1) as peers:
        (pid,) = _busy_children()
        peers.run(False)
        assert _state(pid, "T") == "T"  # stopped: the next step is measured alone
        peers.run(True)
        assert _state(pid, "RS") in "RS"


@pytest.mark.processes
def test_contention_is_measured_once_per_number_of_peers(monkeypatch):
    """2 cores, one thread each: world sizes 2 and 3 both have one peer beside each process (3 also time-shares),
    so one measurement, at world size 2's shape, with real peers, serves both."""
    calls = []

    def counted(work, shape, others, steps, warmup):
        calls.append((shape, others))
        return measure_contention(work, shape, others, steps, warmup)

    monkeypatch.setattr(plan_measure, "measure_contention", counted)
    shapes = {1: (12, 1, 1.0), 2: (6, 1, 1.0), 3: (4, 1, 1.5)}
    factors = plan_measure.contention(Workload.load(TINY), shapes, per_node=3, cores=2, steps=2, warmup=1)
    assert calls == [((6, 1), 1)]
    assert factors[1] == 1.0 and factors[3] == factors[2]
    assert math.isfinite(factors[2])


@pytest.mark.processes
def test_a_peer_that_cannot_start_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")
    work = Workload.load(TINY)
    with (
        pytest.raises(ConfigError, match=r"beside plan's measurement .* exited with code 1"),
        running_beside(work, batch=6, threads=1, others=1),
    ):
        pass
