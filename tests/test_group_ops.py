"""The one check of the backend (comm/ops.py): a group's backend for the device its tensors are on, a group that
names one backend per device type (``cpu:gloo,cuda:nccl``, what ``init_process_group()`` makes with no backend)
judged by the device, never by the whole string."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import one_rank_group
from paratrain.comm.collectives import CollectiveMonitor
from paratrain.comm.ops import GroupOps, serving_backend
from paratrain.errors import DistributedError


@pytest.fixture(scope="module")
def per_device_group():
    """A one-rank group whose backend string names one backend per device type, as a mixed group does."""
    yield from one_rank_group("cpu:gloo,cuda:gloo")


def test_each_device_type_is_served_by_its_own_backend(per_device_group):
    assert dist.get_backend(per_device_group) == "cpu:gloo,cuda:gloo"  # the string a check on it used to compare
    assert serving_backend(per_device_group, "cpu") == "gloo"
    assert serving_backend(per_device_group, torch.device("cuda", 0)) == "gloo"
    assert serving_backend(None, "cpu") == "gloo"  # None: the default group


def test_the_sharded_collectives_and_the_monitor_decide_by_the_device(per_device_group):
    # on gloo the reduce-scatter is an all-reduce in place, and the host waits: judged for the CPU, not as "not gloo"
    assert GroupOps(per_device_group, torch.device("cpu")).reduces_in_place
    monitor = CollectiveMonitor(per_device_group, 5.0, namespace="ops-test", device="cpu")
    try:
        assert monitor.host_waits
    finally:
        monitor.close()


def test_a_device_type_the_group_serves_not_is_named(per_device_group):
    cpu_only = dist.new_group([0], backend="cpu:gloo")
    assert serving_backend(cpu_only, "cpu") == "gloo"
    with pytest.raises(DistributedError, match=r"serve no cuda tensors.*cpu:gloo,cuda:nccl"):
        serving_backend(cpu_only, "cuda")
