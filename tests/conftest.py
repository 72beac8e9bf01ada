"""Shared helpers: the oracle comparison of a parallel run against the plain single-device run; the unit-test guard.

Tests that start processes (the ``paratrain`` command, torchrun, gloo ranks, any subprocess) carry
``@pytest.mark.processes``; ``make unit`` runs the others. An unmarked test that starts a process fails, saying
so, so the quick loop stays quick and honest.
"""

from __future__ import annotations

import copy
import multiprocessing.process
import resource
import subprocess
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import nn

CPU = torch.device("cpu")


def cpu_devices(n: int) -> list[str]:
    return ["cpu"] * n


def grads_of(model: nn.Module) -> list[torch.Tensor | None]:
    out = []
    for p in model.parameters():
        g = p.grad
        out.append(None if g is None else (g.to_dense() if g.is_sparse else g).clone())
    return out


def assert_close_lists(a: Sequence[Any], b: Sequence[Any], atol: float = 1e-5, rtol: float = 1e-4) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            assert x is None and y is None, f"entry {i}: {x} vs {y}"
            continue
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol, msg=lambda m, i=i: f"entry {i}: {m}")


def train_steps(
    model: nn.Module,
    batches: Sequence[tuple[tuple[Any, ...], dict[str, Any], Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    lr: float = 0.1,
) -> tuple[list[Any], list[list[torch.Tensor | None]]]:
    """SGD over the batches; returns each step's output and gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    outputs, grads = [], []
    for args, kwargs, target in batches:
        optimizer.zero_grad(set_to_none=True)
        out = model(*args, **kwargs)
        loss_fn(out, target).backward()
        outputs.append(_detach(out))
        grads.append(grads_of(model))
        optimizer.step()
    return outputs, grads


def _detach(out: Any) -> Any:
    from paratrain.tree import map_tensors

    return map_tensors(lambda x: x.detach().clone(), out)


def assert_same_training(
    make_model: Callable[[], nn.Module],
    wrap: Callable[[nn.Module], nn.Module],
    batches: Sequence[tuple[tuple[Any, ...], dict[str, Any], Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    lr: float = 0.1,
    atol: float = 1e-5,
) -> None:
    """The oracle: outputs, gradients and parameters after every step equal the plain run's."""
    torch.manual_seed(0)
    plain = make_model()
    parallel_inner = copy.deepcopy(plain)
    parallel = wrap(parallel_inner)
    initial = [p.detach().clone() for p in plain.parameters()]
    out_a, grads_a = train_steps(plain, batches, loss_fn, lr)
    out_b, grads_b = train_steps(parallel, batches, loss_fn, lr)
    from paratrain.tree import flatten

    for step, (oa, ob) in enumerate(zip(out_a, out_b, strict=True)):
        la, sa = flatten(oa)
        lb, sb = flatten(ob)
        assert sa == sb, f"step {step}: output structures differ: {sa} vs {sb}"
        assert_close_lists(
            [x for x in la if isinstance(x, torch.Tensor)],
            [x for x in lb if isinstance(x, torch.Tensor)],
            atol,
        )
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert_close_lists(ga, gb, atol)
    assert_close_lists(
        [p.detach() for p in plain.parameters()], [p.detach() for p in parallel_inner.parameters()], atol
    )
    # the run really moved the parameters, so the equality above is not trivially true
    moved = [not torch.equal(a, p.detach()) for a, p in zip(initial, plain.parameters(), strict=True)]
    assert any(moved), "training did not change any parameter; the comparison proves nothing"


def assert_image_split(data: Any, n: int) -> None:
    """A dataset split of ``n`` normalised 28x28 images with labels 0..9."""
    assert data.inputs.shape == (n, 1, 28, 28) and data.inputs.dtype == torch.float32
    assert data.targets.shape == (n,) and data.targets.dtype == torch.int64
    assert len(data) == n
    assert data.inputs.min() >= -1.0 and data.inputs.max() <= 1.0
    assert data.targets.min() >= 0 and data.targets.max() <= 9


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``paratrain ARGS`` in this process: its exit code (argparse's SystemExit too), stdout and stderr."""
    from paratrain.cli import main

    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's own errors (types, choices) exit from inside the parser
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- the guard: a test that is not marked `processes` may not start one ----------------------------------------------

_unit_test: list[str] = []  # the node id of the unmarked test running now, if any


def _guarded(start: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _unit_test:
            raise AssertionError(
                f"{_unit_test[0]} starts a process ({type(self).__name__}): mark it @pytest.mark.processes, or keep "
                f"it in this process (cli.main([...]) instead of the command, say)"
            )
        return start(self, *args, **kwargs)

    return guarded


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "processes: starts processes (the command, torchrun, gloo ranks); `make unit` leaves these out"
    )
    config.addinivalue_line(
        "markers",
        "slow: a long process test beyond the one oracle per path `make test` keeps (world-3 suites, resume matrices, "
        "faults, launcher edges, plan/bench/verify end to end); `make test` leaves them to `make slow`; CI runs both",
    )
    subprocess.Popen.__init__ = _guarded(subprocess.Popen.__init__)  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = _guarded(multiprocessing.process.BaseProcess.start)  # type: ignore[method-assign]


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("processes") is None:
        _unit_test[:] = [item.nodeid]


def pytest_runtest_teardown(item: pytest.Item) -> None:
    _unit_test.clear()


def one_rank_group(backend: str = "gloo") -> Iterator[object]:
    """A one-rank process group of ``backend`` in this process (a HashStore: no port, no other process), for the
    length of a fixture."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo process group in this process, for a module."""
    yield from one_rank_group()


@pytest.fixture
def restored_limit() -> Iterator[None]:
    """RLIMIT_DATA as it was before the test (tests that cap a process's memory in this one)."""
    before = resource.getrlimit(resource.RLIMIT_DATA)
    yield
    resource.setrlimit(resource.RLIMIT_DATA, before)
