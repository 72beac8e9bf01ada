"""How many CPU threads a run computes with, chosen on purpose, and whether the machine was busy.

    threads = choose_threads("dp", [cpu, cpu], launched=False)   # 1 on 2 cores: one per replica, as torchrun does
    with using_threads(threads): ...                             # torch's intra-op threads, restored afterwards
    load = MachineLoad.now()                                     # cores and load average, for the summary

torch's default is one OpenMP thread per core in every process and every thread that computes. Replicas or
processes sharing the cores then run several times as many threads as there are cores, and OpenMP threads spin
while they wait for cores they do not get: on a loaded machine a single-process run with the default ran ten
times slower than with one thread. So each run decides: ``OMP_NUM_THREADS`` when the user set it (the launcher
sets it for ddp's workers: cores // processes, as torchrun does); otherwise the cores this process may use for one
device, or cores // replicas for dp's CPU replicas, which compute at the same time. The count is kept in the
metrics, and the summary says when the load average exceeded the cores, which makes every timing slower.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["MachineLoad", "available_cores", "choose_threads", "using_threads"]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this system
        return max(1, os.cpu_count() or 1)


def choose_threads(strategy: str, devices: Sequence[torch.device], *, launched: bool) -> int:
    """The intra-op threads for a run (see the module docstring).

    ``launched``: a process started by a launcher, which set ``OMP_NUM_THREADS`` (torch read it at start-up).
    """
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if launched or (given.isdigit() and int(given) > 0):
        return torch.get_num_threads()
    cores = available_cores()
    cpu_replicas = sum(d.type == "cpu" for d in devices) if strategy == "dp" else 1
    return max(1, cores // max(1, cpu_replicas))


@contextmanager
def using_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` inside the block, and put back after it."""
    previous = torch.get_num_threads()
    if count != previous:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)


@dataclass(frozen=True)
class MachineLoad:
    """The machine's cores and its load average over the last minute (None where the system has none)."""

    cores: int
    load_average: float | None

    @classmethod
    def now(cls) -> MachineLoad:
        try:
            load: float | None = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = None
        return cls(max(1, os.cpu_count() or 1), load)

    @property
    def oversubscribed(self) -> bool:
        """More work was runnable than there are cores: every process got less than it asked for."""
        return self.load_average is not None and self.load_average > self.cores

    @staticmethod
    def busiest(*loads: MachineLoad) -> MachineLoad:
        """The highest load of several readings (a run's start and end)."""
        known = [x for x in loads if x.load_average is not None]
        return max(known, key=lambda x: x.load_average or 0.0) if known else loads[0]
