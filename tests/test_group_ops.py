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


def _gathers(rank: int, world_size: int) -> dict:
    """Each rank's part gathered over the world and over a subgroup of ranks 0 and 2, by GroupOps on gloo."""
    from paratrain.comm.ops import Works

    pair = dist.new_group([0, 2])  # every rank makes every group, in the same order
    found: dict = {}
    for name, group, members in (("world", dist.group.WORLD, list(range(world_size))), ("pair", pair, [0, 2])):
        if rank not in members:
            continue
        ops = GroupOps(group, "cpu", broadcast_gather_bytes=0)  # these tiny parts by broadcasts too
        small = GroupOps(group, "cpu")  # below the size: gloo's own all-gather
        monitor = CollectiveMonitor(group, 30.0, namespace=f"gather-{name}", device="cpu")
        try:
            me = members.index(rank)
            expected = torch.cat([torch.arange(5.0) + 10 * r for r in members])
            # a part of its own, and a part that is already this rank's slice of the buffer (zero1's buckets)
            buffer = torch.full((5 * len(members),), float("nan"))
            work = ops.all_gather(buffer, torch.arange(5.0) + 10 * rank)
            monitor.wait(work, monitor.launched(), "gather of separate parts")
            in_place = torch.full((5 * len(members),), float("nan"))
            in_place.narrow(0, 5 * me, 5).copy_(torch.arange(5.0) + 10 * rank)
            again = ops.all_gather(in_place, in_place.narrow(0, 5 * me, 5))
            monitor.wait(again, monitor.launched(), "gather into place")
            plain = torch.full((5 * len(members),), float("nan"))
            once = small.all_gather(plain, torch.arange(5.0) + 10 * rank)
            monitor.wait(once, monitor.launched(), "gather by gloo's all-gather")
            found[name] = {
                "plain": torch.equal(plain, expected) and not isinstance(once, Works),
                "separate": torch.equal(buffer, expected),
                "in_place": torch.equal(in_place, expected),
                "broadcasts": len(work) if isinstance(work, Works) else None,
            }
        finally:
            monitor.close()
    return found


@pytest.mark.processes
def test_a_gather_on_gloo_is_one_broadcast_per_rank_in_place_over_any_group(tmp_path):
    from processes import run_ranks

    results = run_ranks(_gathers, 3, tmp_path, timeout=120)
    for rank, found in enumerate(results):
        assert found["world"] == {"plain": True, "separate": True, "in_place": True, "broadcasts": 3}
        if rank in (0, 2):  # a subgroup: its ranks 0 and 1 are the world's 0 and 2
            assert found["pair"] == {"plain": True, "separate": True, "in_place": True, "broadcasts": 2}
        else:
            assert "pair" not in found
