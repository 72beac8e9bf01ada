from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from paratrain.dp.parallel_apply import ThreadState, WorkerPool, parallel_apply
from paratrain.dp.scatter_gather import Scattered
from paratrain.errors import ReplicaError

CPU = torch.device("cpu")


class Recorder(nn.Module):
    """Records the thread-local state each replica runs under."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def forward(self, x):
        self.seen.append(
            {
                "thread": threading.current_thread().name,
                "grad": torch.is_grad_enabled(),
                "inference": torch.is_inference_mode_enabled(),
                "autocast": torch.is_autocast_enabled("cpu"),
                "dtype": torch.get_autocast_dtype("cpu"),
            }
        )
        return x


def _shares(n: int) -> list[Scattered]:
    return [Scattered(i, CPU, (torch.ones(1),), {}, 1) for i in range(n)]


def _run(pool, modules, state):
    return parallel_apply(modules, _shares(len(modules)), pool, state)


@pytest.mark.parametrize(
    "context, expected",
    [
        (torch.enable_grad, {"grad": True, "inference": False, "autocast": False}),
        (torch.no_grad, {"grad": False, "inference": False, "autocast": False}),
        (torch.inference_mode, {"grad": False, "inference": True, "autocast": False}),
        (
            lambda: torch.autocast("cpu", dtype=torch.bfloat16),
            {"grad": True, "inference": False, "autocast": True, "dtype": torch.bfloat16},
        ),
        (
            lambda: torch.autocast("cpu", dtype=torch.float16),
            {"grad": True, "inference": False, "autocast": True, "dtype": torch.float16},
        ),
    ],
    ids=["grad", "no_grad", "inference_mode", "autocast-bf16", "autocast-fp16"],
)
def test_workers_run_under_the_callers_state(context, expected):
    seen: list = []
    pool = WorkerPool()
    with context():
        state = ThreadState.capture(["cpu"])
        _run(pool, [Recorder(seen) for _ in range(3)], state)
    pool.close()
    assert len(seen) == 3
    for record in seen:
        assert record["thread"].startswith("paratrain-replica")
        for key, value in expected.items():
            assert record[key] == value, (key, record)


def test_autocast_actually_applies_in_workers():
    lin = nn.Linear(4, 4)
    pool = WorkerPool()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = parallel_apply(
            [lin, lin],
            [Scattered(i, CPU, (torch.ones(2, 4),), {}, 2) for i in range(2)],
            pool,
            ThreadState.capture(["cpu"]),
        )
    pool.close()
    assert all(o.dtype == torch.bfloat16 for o in outs)


def test_threads_are_persistent_one_per_replica():
    seen: list = []
    pool = WorkerPool()
    state = ThreadState.capture(["cpu"])
    modules = [Recorder(seen) for _ in range(3)]
    before = threading.active_count()
    _run(pool, modules, state)
    names_first = sorted(r["thread"] for r in seen)
    seen.clear()
    for _ in range(5):
        _run(pool, modules, state)
    assert pool.size == 3
    assert threading.active_count() == before + 3
    assert sorted({r["thread"] for r in seen}) == names_first
    pool.close()
    assert pool.size == 0


class Boom(nn.Module):
    def __init__(self, fail: bool, exc: Exception):
        super().__init__()
        self.fail = fail
        self.exc = exc

    def forward(self, x):
        if self.fail:
            raise self.exc
        return x


def test_failures_name_every_failing_replica_and_keep_the_type():
    pool = WorkerPool()
    modules = [
        Boom(False, ValueError()),
        Boom(True, ValueError("bad shape")),
        Boom(True, ValueError("again")),
    ]
    with pytest.raises(ValueError) as info:
        _run(pool, modules, ThreadState.capture(["cpu"]))
    pool.close()
    text = str(info.value)
    assert "2 replica(s) failed: 1 (cpu), 2 (cpu)" in text
    assert "Caught ValueError in replica 1 on device cpu" in text
    assert "Caught ValueError in replica 2 on device cpu" in text
    assert "bad shape" in text and "again" in text
    assert "in forward" in text and "raise self.exc" in text  # the replica's own traceback
    assert isinstance(info.value.__cause__, ValueError)


def test_keyerror_message_stays_readable():
    pool = WorkerPool()
    with pytest.raises(KeyError) as info:
        _run(pool, [Boom(True, KeyError("missing"))], ThreadState.capture(["cpu"]))
    pool.close()
    assert "\n" in str(info.value) and "\\n" not in str(info.value)


def test_exception_types_that_cannot_be_rebuilt_become_replica_error():
    class Picky(Exception):
        def __init__(self, a, b):
            super().__init__(a, b)

    pool = WorkerPool()
    with pytest.raises(ReplicaError, match=r"Caught Picky in replica 0") as info:
        _run(pool, [Boom(True, Picky(1, 2))], ThreadState.capture(["cpu"]))
    pool.close()
    assert isinstance(info.value.__cause__, Picky)


def test_pool_survives_a_failure():
    pool = WorkerPool()
    state = ThreadState.capture(["cpu"])
    with pytest.raises(RuntimeError):
        _run(pool, [Boom(True, RuntimeError("x")), Boom(False, RuntimeError())], state)
    out = _run(pool, [Boom(False, RuntimeError()), Boom(False, RuntimeError())], state)
    pool.close()
    assert len(out) == 2
