"""Run each replica in its own persistent worker thread, with the caller's autograd and autocast state.

PyTorch keeps grad mode, inference mode and autocast per thread, so a worker thread starts with defaults
that are not the caller's. :class:`ThreadState` captures the caller's state and re-enters it in the worker.
Failures are collected from every replica and raised once, naming each failing replica and its device.

    pool = WorkerPool()
    outputs = parallel_apply(replicas, shares, pool, ThreadState.capture({"cpu"}))
    pool.close()
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.dp.scatter_gather import Scattered
from paratrain.errors import ReplicaError
from paratrain.tree import flatten

__all__ = ["ReplicaFailure", "ThreadState", "WorkerPool", "parallel_apply", "raise_failures"]


@dataclass(frozen=True)
class ThreadState:
    """The thread-local PyTorch state a replica must run under: grad mode, inference mode, autocast."""

    grad_enabled: bool
    inference_mode: bool
    # (device type, enabled, dtype) for each device type the replicas use
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool

    @classmethod
    def capture(cls, device_types: Iterable[str]) -> ThreadState:
        """The calling thread's state, for the given device types (``"cpu"``, ``"cuda"``)."""
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            autocast=tuple(
                (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in sorted(set(device_types))
            ),
            autocast_cache=torch.is_autocast_cache_enabled(),
        )

    @contextmanager
    def applied(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
        """Enter this state (and, for CUDA, the replica's device and stream) in the current thread."""
        with ExitStack() as stack:
            if self.inference_mode:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, enabled, dtype in self.autocast:
                if device_type == device.type:
                    stack.enter_context(
                        torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache)
                    )
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                if stream is not None:
                    stack.enter_context(torch.cuda.stream(stream))
            yield


@dataclass
class ReplicaFailure:
    """What one replica raised, with the traceback text from its own thread."""

    index: int
    device: torch.device
    error: BaseException
    traceback: str


class _KeyErrorMessage(str):
    """KeyError reprs its message; this keeps the multi-line text readable."""

    def __repr__(self) -> str:
        return str(self)


def raise_failures(failures: Sequence[ReplicaFailure]) -> None:
    """Raise one exception for all failed replicas, of the first failure's type when it can be rebuilt."""
    if not failures:
        return
    parts = [
        f"Caught {type(f.error).__name__} in replica {f.index} on device {f.device}.\n"
        f"Original traceback (replica {f.index}):\n{f.traceback.rstrip()}"
        for f in failures
    ]
    which = ", ".join(f"{f.index} ({f.device})" for f in failures)
    message = f"{len(failures)} replica(s) failed: {which}\n\n" + "\n\n".join(parts)
    first = failures[0].error
    exc_type = type(first)
    try:
        error: BaseException = exc_type(_KeyErrorMessage(message) if exc_type is KeyError else message)
    except Exception:  # the type's constructor wants other arguments
        error = ReplicaError(message)
    raise error from first


_Job = tuple[int, Callable[[], Any], "queue.SimpleQueue[tuple[int, Any, BaseException | None, str]]"]


def _run_one(fn: Callable[[], Any]) -> tuple[Any, BaseException | None, str]:
    try:
        return fn(), None, ""
    except BaseException as exc:
        return None, exc, traceback.format_exc()


def _worker_loop(inbox: queue.SimpleQueue[_Job | None]) -> None:
    while True:
        job = inbox.get()
        if job is None:
            return
        index, fn, done = job
        # drop our references before signalling, so nothing from this call outlives it in this thread
        del job
        result, error, text = _run_one(fn)
        del fn
        done.put((index, result, error, text))
        del result, error, done


class WorkerPool:
    """Persistent worker threads, one per replica slot, started on first use and reused for every call."""

    def __init__(self, name: str = "paratrain-replica") -> None:
        self._name = name
        self._inboxes: list[queue.SimpleQueue[_Job | None]] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self._threads)

    def _ensure(self, n: int) -> None:
        with self._lock:
            while len(self._threads) < n:
                inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=_worker_loop, args=(inbox,), name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._inboxes.append(inbox)
                self._threads.append(thread)

    def run(self, fns: Sequence[Callable[[], Any]]) -> list[tuple[Any, BaseException | None, str]]:
        """Run ``fns[i]`` on worker ``i``; wait for all; return (result, error, traceback text) for each."""
        self._ensure(len(fns))
        done: queue.SimpleQueue[tuple[int, Any, BaseException | None, str]] = queue.SimpleQueue()
        for i, fn in enumerate(fns):
            self._inboxes[i].put((i, fn, done))
        outcomes: list[tuple[Any, BaseException | None, str]] = [(None, None, "")] * len(fns)
        for _ in fns:
            index, result, error, text = done.get()
            outcomes[index] = (result, error, text)
        return outcomes

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        with self._lock:
            for inbox in self._inboxes:
                inbox.put(None)
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join(timeout=5)
            self._inboxes.clear()
            self._threads.clear()


def _call(
    module: nn.Module, share: Scattered, state: ThreadState, stream: torch.cuda.Stream | None
) -> Callable[[], Any]:
    def call() -> Any:
        with state.applied(share.device, stream):
            return module(*share.args, **share.kwargs)

    return call


def parallel_apply(
    modules: Sequence[nn.Module],
    shares: Sequence[Scattered],
    pool: WorkerPool,
    state: ThreadState,
    streams: Sequence[torch.cuda.Stream | None] | None = None,
) -> list[Any]:
    """Call ``modules[i](*shares[i].args, **shares[i].kwargs)`` in worker ``i``; all run concurrently.

    ``streams[i]``, when given, is a side CUDA stream for replica ``i`` (several replicas on one GPU): it
    waits for the caller's stream before running, and the caller's stream waits for it afterwards.
    """
    if len(modules) != len(shares):
        raise ValueError(f"{len(modules)} modules but {len(shares)} inputs")
    side = list(streams) if streams is not None else [None] * len(modules)
    for share, stream in zip(shares, side, strict=True):
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(share.device))
    outcomes = pool.run([_call(m, s, state, st) for m, s, st in zip(modules, shares, side, strict=True)])
    failures = [
        ReplicaFailure(i, share.device, error, text)
        for i, ((_, error, text), share) in enumerate(zip(outcomes, shares, strict=True))
        if error is not None
    ]
    raise_failures(failures)
    outputs = [result for result, _, _ in outcomes]
    for output, share, stream in zip(outputs, shares, side, strict=True):
        if stream is not None:
            _join_stream(output, share.device, stream)
    return outputs


def _join_stream(output: Any, device: torch.device, stream: torch.cuda.Stream) -> None:
    main = torch.cuda.current_stream(device)
    main.wait_stream(stream)
    # the outputs were allocated on the side stream but are read on the main one from here on
    leaves, _ = flatten(output)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            leaf.record_stream(main)
