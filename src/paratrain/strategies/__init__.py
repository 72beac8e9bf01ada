"""Ways of running a training loop, each a small class behind :class:`Strategy`, and the one rule for ``auto``.

strategy = select_strategy("auto", "cpu,cpu,cpu")    # -> dp over three CPU replicas
strategy = select_strategy("single", "cuda:1")

``auto`` means the same everywhere (``Parallel("auto")``, ``paratrain train``, ``verify``/``bench``), decided by
:func:`resolve_strategy` in this order:

1. in a process started by a launcher (``paratrain launch``, torchrun): ``ddp``;
2. ``devices`` ``auto`` or ``cuda`` while several GPUs are visible: ``ddp``, one process per GPU (the fast way
   to use several GPUs). ``paratrain train`` then starts the processes itself; a script using ``Parallel`` is
   told to start through ``paratrain launch`` (or to ask for ``dp`` explicitly);
3. an explicit list of several devices (``cpu,cpu,cpu``, ``cuda:0,cuda:1``): ``dp``, in this process;
4. otherwise (one GPU, or the CPU): ``single``.

``zero1``, ``zero2`` (sharded data parallel, :mod:`paratrain.strategies.zero`) and ``zero3`` (fully sharded,
:mod:`paratrain.strategies.fully_sharded`) run like ``ddp``, one process per device under a launcher, and are
chosen by name only.

DDP's options (:class:`~paratrain.ddp.options.DDPOptions`: ``find_unused_parameters``, ``static_graph``,
``bucket_cap_mb``, ``gradient_as_bucket_view``, a communication hook) go to the process strategies, which honour
each or refuse it by name. ``single`` and ``dp`` refuse any option set (they have no gradients to send across
processes); ``auto`` passes them on when it picks ``ddp`` and leaves them unused when it picks ``single`` or
``dp``, as it does ``timeout``, so one script runs alone and under a launcher.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paratrain.ddp.options import DDPOptions, Refusal
from paratrain.devices import DeviceLike, parse_device_list, parse_devices_arg, visible_gpus
from paratrain.environment import ClusterEnvironment
from paratrain.errors import ConfigError
from paratrain.strategies.base import ReduceOp, Strategy
from paratrain.strategies.ddp import DDP_DEVICES, DistributedStrategy
from paratrain.strategies.dp import DataParallelStrategy
from paratrain.strategies.fully_sharded import Zero3Strategy
from paratrain.strategies.single import SingleDevice
from paratrain.strategies.zero import Zero1Strategy, Zero2Strategy, ZeroStrategy

__all__ = [
    "PROCESS_STRATEGIES",
    "STRATEGY_NAMES",
    "DDPOptions",
    "DataParallelStrategy",
    "DistributedStrategy",
    "ReduceOp",
    "SingleDevice",
    "Strategy",
    "Zero1Strategy",
    "Zero2Strategy",
    "Zero3Strategy",
    "ZeroStrategy",
    "check_ddp_devices",
    "honouring",
    "refusal_of",
    "resolve_devices",
    "resolve_strategy",
    "select_strategy",
]

STRATEGY_NAMES = ("auto", "single", "dp", "ddp", "zero1", "zero2", "zero3")
PROCESS_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")  # one process per device, started by a launcher
_BY_NAME: dict[str, type[DistributedStrategy]] = {
    "ddp": DistributedStrategy,
    "zero1": Zero1Strategy,
    "zero2": Zero2Strategy,
    "zero3": Zero3Strategy,
}

Devices = str | Sequence[DeviceLike] | None


def resolve_devices(devices: Devices) -> list[torch.device]:
    """``auto``/None: every GPU, or the CPU without one; otherwise the devices given, checked to exist."""
    if devices is None:
        parsed = None
    elif isinstance(devices, str):
        parsed = parse_devices_arg(devices)
    else:
        parsed = parse_device_list(devices, what="devices")
    if parsed is None:
        parsed = visible_gpus() or [torch.device("cpu")]
    return parsed


def resolve_strategy(name: str, devices: Devices, environment: ClusterEnvironment | None = None) -> str:
    """The strategy ``name`` stands for on ``devices``: ``auto`` resolved by the rule in the module docstring.

    ``environment``: where a launcher put this process (default: read from the launcher's variables).

    Raises:
        ConfigError: an unknown name.
    """
    if name not in STRATEGY_NAMES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGY_NAMES)}")
    if name != "auto":
        return name
    env = environment if environment is not None else ClusterEnvironment.detect()
    if env.launched:
        return "ddp"
    if _means_every_gpu(devices) and len(visible_gpus()) > 1:
        return "ddp"
    return "dp" if len(resolve_devices(devices)) > 1 else "single"


def _means_every_gpu(devices: Devices) -> bool:
    return devices is None or (isinstance(devices, str) and devices.strip() in ("auto", "cuda"))


def check_ddp_devices(devices: Devices, flag: str = "devices", strategy_name: str = "ddp") -> str:
    """The device type ddp's (or zero1's, zero2's, zero3's) processes use (``auto``, ``cpu`` or ``cuda``): the one rule.

    Raises:
        ConfigError: a list of devices (each process uses one: its local rank's GPU, or the CPU).
    """
    device_type = devices.strip() if isinstance(devices, str) else None
    if device_type not in DDP_DEVICES:
        cli = flag.startswith("--")  # the command line's words, or the Python API's
        named = strategy_name
        strategy, dp = (f"--strategy {named}", "--strategy dp") if cli else (f"strategy {named!r}", "strategy='dp'")
        raise ConfigError(
            f"{strategy} runs one process per device and takes {flag} {', '.join(DDP_DEVICES)} (each process uses "
            f"its local rank's GPU, or the CPU); found {devices!r}. For a list of devices in one process use {dp}; "
            f"for N processes, start N (--nproc-per-node N)"
        )
    return device_type


def refusal_of(strategy: str, option: str) -> Refusal | None:
    """Why process strategy ``strategy`` refuses the DDP option ``option``, or None where it honours it."""
    return _BY_NAME[strategy].refused_options.get(option)


def honouring(option: str) -> list[str]:
    """The process strategies that honour the DDP option ``option``, in :data:`PROCESS_STRATEGIES` order."""
    return [name for name in PROCESS_STRATEGIES if refusal_of(name, option) is None]


def _refuse_in_one_process(strategy: str, options: DDPOptions) -> None:
    """DDP's options set for ``single`` or ``dp``, which would ignore them: refused, naming the fix."""
    given = options.given()
    if given:
        shown = ", ".join(options.shown(n) for n in given)
        raise ConfigError(
            f"DDP options apply to ddp and zero1, zero2, zero3 (how gradients cross processes); found strategy "
            f"{strategy!r} with {shown}, which runs in one process and would ignore them: drop "
            f"{', '.join(given)}, or run strategy 'ddp' under `paratrain launch`"
        )


def select_strategy(
    name: str = "auto",
    devices: Devices = "auto",
    *,
    timeout: float | None = None,
    environment: ClusterEnvironment | None = None,
    hang_report: str | None = None,
    options: DDPOptions | None = None,
) -> Strategy:
    """The strategy called ``name`` on ``devices`` (``auto``: see :func:`resolve_strategy`).

    ``ddp`` takes ``devices`` ``auto`` (this process's GPU, or the CPU), ``cpu`` or ``cuda``. ``timeout`` (seconds
    a collective may wait for the other ranks) and ``options`` (DDP's) apply to ``ddp`` and the ``zero``
    strategies; with ``auto`` they apply if ``auto`` picks ``ddp``, and naming ``single`` or ``dp`` with either is
    an error. ``environment`` is where a launcher put this process (default: read from the launcher's
    variables); ``hang_report`` where ddp's report of a hang goes.

    Raises:
        ConfigError: an unknown name, devices the strategy cannot use, a ``timeout`` or DDP option for a strategy
            without collectives, an option the strategy refuses, or ``auto`` choosing ``ddp`` in a process that no
            launcher started.
    """
    env = environment if environment is not None else ClusterEnvironment.detect()
    resolved = resolve_strategy(name, devices, env)
    if resolved in PROCESS_STRATEGIES:
        if name == "auto" and not env.launched:
            raise ConfigError(
                f"strategy 'auto' chose ddp because {len(visible_gpus())} GPUs are visible, and ddp runs one "
                f"process per GPU: start this script with `paratrain launch script.py` (or torchrun), or pass "
                f"strategy='dp' to use them all from this process, or devices='cuda:0' for one"
            )
        device_type = check_ddp_devices(devices, strategy_name=resolved)
        return _BY_NAME[resolved](
            device_type,
            environment=env,
            hang_report=hang_report,
            options=options,
            **({} if timeout is None else {"timeout": timeout}),
        )
    if options is not None and name != "auto":
        _refuse_in_one_process(resolved, options)
    if timeout is not None and name != "auto":
        raise ConfigError(
            f"timeout is for strategy 'ddp' (and zero1, zero2, zero3: how long a collective waits for the other "
            f"processes); strategy {resolved!r} runs in one process and has no collectives: drop timeout"
        )
    chosen = resolve_devices(devices)
    if resolved == "single":
        if len(chosen) != 1:
            raise ConfigError(
                f"strategy 'single' runs on one device but {len(chosen)} were given "
                f"({', '.join(map(str, chosen))}); pass one device or use --strategy dp"
            )
        return SingleDevice(chosen[0])
    return DataParallelStrategy(chosen)
