"""The CPU threads each run computes with: chosen per strategy, restored afterwards, recorded, and a busy machine
said in the summary."""

from __future__ import annotations

import os

import pytest
import torch

from paratrain.training import TrainConfig, train
from paratrain.training.results import TrainResult
from paratrain.training.threads import MachineLoad, available_cores, choose_threads, using_threads

CPU = torch.device("cpu")


def test_each_strategy_gets_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = available_cores()
    assert choose_threads("single", [CPU], launched=False) == cores
    assert choose_threads("dp", [CPU] * 2, launched=False) == max(1, cores // 2)  # replicas compute together
    assert choose_threads("dp", [CPU] * (cores + 1), launched=False) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's choice (torch read it when it started)
    assert choose_threads("single", [CPU], launched=False) == torch.get_num_threads()


def test_a_run_computes_with_its_threads_records_them_and_puts_torchs_back(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    with using_threads(before):  # restored however the test exits
        result = train(TrainConfig(strategy="dp", devices="cpu,cpu", epochs=1, max_steps=2, quiet=True))
        assert result.threads == max(1, available_cores() // 2) and result.cores == os.cpu_count()
        assert torch.get_num_threads() == before
        assert result.load_average is None or result.load_average >= 0
        assert f"{result.threads} CPU thread" in result.summary()


def _result(load: float | None) -> TrainResult:
    return TrainResult(0.9, 0.3, 1, 1e3, 1.0, "single", ["cpu"], 0, "f", threads=2, cores=2, load_average=load)


@pytest.mark.parametrize("load, busy", [(1.5, False), (2.0, False), (3.1, True), (None, False)])
def test_the_summary_says_when_the_machine_was_oversubscribed(load, busy):
    summary = _result(load).summary()
    assert ("oversubscribed, load average 3.1 on 2 cores: timings are slower" in summary) is busy
    assert "\n" not in summary  # still the one summary line
    assert MachineLoad(2, load).oversubscribed is busy
