"""The --configs words of verify/bench/plan: parsed one way, checked against this machine separately."""

from __future__ import annotations

import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.tools.configs import default_configs, parse_config, parse_configs, unavailable_reason

NO_GPU = not torch.cuda.is_available()


@pytest.mark.parametrize(
    "word, strategy, devices, processes, canonical",
    [
        ("dp:cpu,cpu,cpu", "dp", ("cpu", "cpu", "cpu"), 1, "dp:cpu,cpu,cpu"),
        ("dp:cuda:0,cuda:1", "dp", ("cuda:0", "cuda:1"), 1, "dp:cuda:0,cuda:1"),
        ("dp:0,1", "dp", ("cuda:0", "cuda:1"), 1, "dp:cuda:0,cuda:1"),
        ("ddp:3", "ddp", (), 3, "ddp:3"),
        ("zero1:2", "zero1", (), 2, "zero1:2"),
        ("zero2:04", "zero2", (), 4, "zero2:4"),
        ("zero3:2", "zero3", (), 2, "zero3:2"),
        ("single:cpu", "single", ("cpu",), 1, "single:cpu"),
    ],
)
def test_words(word, strategy, devices, processes, canonical):
    config = parse_config(word)
    assert (config.strategy, config.devices, config.processes, config.word) == (
        strategy,
        devices,
        processes,
        canonical,
    )
    assert config.device_count == (processes if strategy in ("ddp", "zero1", "zero2", "zero3") else len(devices))
    assert config.in_process == (strategy in ("single", "dp"))


@pytest.mark.parametrize(
    "word, message",
    [
        ("dp:cpu", "at least two devices"),
        ("dp:cpu,banana", "'banana' is not a device"),
        ("dp:cpu,cuda:0", "all be GPUs or all be the CPU"),
        ("ddp:0", "N >= 1"),
        ("ddp:two", "N >= 1"),
        ("zero2:0", "zero2:N takes a number of processes N >= 1"),
        ("zero3:x", "zero3:N takes a number of processes N >= 1"),
        ("single:cpu,cpu", "single runs on one device"),
        ("fsdp:2", "unknown configuration"),
    ],
)
def test_bad_words(word, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(word)


def test_repeats_are_dropped_and_an_empty_list_is_an_error():
    assert [c.word for c in parse_configs(["ddp:2", "ddp:2", "dp:0,1", "dp:cuda:0,cuda:1"])] == [
        "ddp:2",
        "dp:cuda:0,cuda:1",
    ]
    with pytest.raises(ConfigError, match="at least one"):
        parse_configs([])


@pytest.mark.skipif(not NO_GPU, reason="the defaults differ with GPUs")
def test_default_is_everything_a_cpu_machine_runs_up_to_three_devices():
    words = [c.word for c in default_configs()]
    assert words == ["single", "dp:cpu,cpu", "dp:cpu,cpu,cpu", "ddp:2", "ddp:3"]
    assert all(unavailable_reason(c) is None for c in default_configs())


@pytest.mark.skipif(not NO_GPU, reason="needs a machine without GPUs")
def test_gpu_configurations_are_unavailable_here_with_the_reason():
    assert unavailable_reason(parse_config("dp:cuda:0,cuda:1")) == "no CUDA device is visible on this machine"
    assert unavailable_reason(parse_config("single:cuda:0")) == "no CUDA device is visible on this machine"
