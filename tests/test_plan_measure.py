"""What plan measures on the CPU beside real peer processes (paratrain.tools.busy), and their clean-up."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.tools.plan_measure import contention, measure_beside, measure_profiles, running_beside
from paratrain.tools.settings import RunSettings
from paratrain.tools.workload import Workload
from processes import descendants

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


def test_peers_run_the_model_during_the_measurement_and_are_gone_after():
    work = Workload.load(TINY)
    with running_beside(work, batch=6, threads=1, others=2):
        running = _busy_children()
        assert len(running) == 2  # both printed "ready": they built the model and stepped it
    assert _busy_children() == []
    for pid in running:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_contention_is_measured_once_per_number_of_peers():
    work = Workload.load(TINY)
    shapes = {1: (12, 1, 1.0), 2: (6, 1, 1.0), 3: (4, 1, 1.5)}
    profiles = measure_profiles(work, torch.device("cpu"), [(b, t) for b, t, _ in shapes.values()], steps=2, warmup=1)
    factors = contention(work, profiles, shapes, per_node=3, cores=2, steps=2, warmup=1)
    assert factors[1] == 1.0  # alone
    assert factors[2] >= 1.0 and factors[3] == factors[2]  # 2 cores: one peer beside each process, then time-sharing
    profile = measure_beside(work, (6, 1), others=1, steps=2, warmup=1)
    assert profile.batch == 6 and profile.forward > 0 and profile.backward > 0


def test_a_peer_that_cannot_start_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")
    work = Workload.load(TINY)
    with (
        pytest.raises(ConfigError, match=r"beside plan's measurement .* exited with code 1"),
        running_beside(work, batch=6, threads=1, others=1),
    ):
        pass
