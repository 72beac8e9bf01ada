"""Start a script on many processes and machines, delegating to torch's own launcher (torchrun).

One machine::

    paratrain launch train.py --epochs 3                        # one process per GPU; one process without a GPU
    paratrain launch --nproc-per-node 4 train.py --epochs 3     # four processes on this machine

Two machines, two processes each; 10.0.0.1 is one of them and hosts the rendezvous; the same line on both::

    paratrain launch --nnodes 2 --nproc-per-node 2 --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job42 train.py

Two machines with fixed node ranks (static rendezvous: node 0 at 10.0.0.1 listens on port 29500)::

    paratrain launch --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 train.py
    paratrain launch --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 train.py

Elastic, between 1 and 4 machines, each restarting its workers up to 3 times (run on every machine)::

    paratrain launch --nnodes 1:4 --max-restarts 3 --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job42 train.py

The workers see torchrun's usual variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT), so a script written for torchrun runs unchanged.
``python -m paratrain launch ...`` is the same command.

paratrain builds the argument list for ``python -m torch.distributed.run`` with :func:`torchrun_args` (pure,
but for counting GPUs when asked for ``auto``) and runs it in a child process with :func:`launch`. torchrun's
command line is its documented, stable interface, while ``torch.distributed.run.run(args)`` takes an argparse
namespace whose fields, defaults and side effects (``--standalone`` rewriting, ``OMP_NUM_THREADS`` set in
``os.environ``, signal handlers, ``@record`` error files) have changed between releases. A child process also
keeps the caller safe: torchrun's signal handlers, environment changes, crashes and kills stay in the child,
and the caller can stop it after a timeout.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Sequence

from paratrain.diagnostics.flight_recorder import small_buffer_unless_set
from paratrain.errors import ConfigError, DistributedError
from paratrain.launch.config import (
    EXIT_PORT_TAKEN,
    EXIT_RENDEZVOUS_FAILED,
    LaunchConfig,
    local_world_size,
    parse_endpoint,
)
from paratrain.launch.supervise import supervise

__all__ = ["LaunchConfig", "launch", "local_world_size", "torchrun_args"]


def _loopback_addr(host: str) -> str | None:
    """The address to use for ``host`` when it is this machine's loopback; None for any other host."""
    if host == "localhost":
        return "127.0.0.1"  # "localhost" may resolve to ::1 first
    try:
        return host if ipaddress.ip_address(host).is_loopback else None
    except ValueError:
        return None


def torchrun_args(
    config: LaunchConfig, script: str, script_args: Sequence[str] = (), *, module: bool = False
) -> list[str]:
    """The argument list for ``python -m torch.distributed.run`` that runs ``script`` as ``config`` says.

    Args:
        config: the launch settings; validated here.
        script: the script's path, or a module name when ``module`` is true.
        script_args: passed to every worker unchanged, after the script.
        module: run ``script`` as ``python -m script``.

    Raises:
        ConfigError: from :meth:`LaunchConfig.validate`, or for a script name starting with ``-``.
    """
    config.check()
    if not script or script.startswith("-"):
        raise ConfigError(f"expected a script path or module name, found {script!r}")
    args = [
        f"--nnodes={str(config.nnodes).strip()}",
        f"--nproc-per-node={local_world_size(config.nproc_per_node)}",
        f"--max-restarts={config.max_restarts}",
        f"--monitor-interval={config.monitor_interval:g}",
    ]
    timeout_key: str | None = None  # the rendezvous's name for "how long to wait for the other nodes"
    if config.rdzv_endpoint is not None:  # c10d rendezvous
        host, _ = parse_endpoint(config.rdzv_endpoint, allow_zero_port=config.is_single_node)
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={config.rdzv_endpoint.strip()}"]
        timeout_key = "join_timeout"
        # all on this machine: its host name may not resolve (containers), the loopback address always does
        local_addr = config.local_addr or _loopback_addr(host)
    elif config.master_port is not None:  # static rendezvous
        args += [
            f"--master-addr={config.master_addr or '127.0.0.1'}",
            f"--master-port={config.master_port}",
            f"--node-rank={config.node_rank}",
        ]
        timeout_key, local_addr = "timeout", None
    else:  # one node: torchrun binds a port of the OS's choosing, so no other program can take it first
        args.append("--standalone")  # sets its own rendezvous id; there are no other nodes to wait for
        local_addr = config.local_addr or config.master_addr or "127.0.0.1"
    if timeout_key is not None:
        if config.rdzv_id is not None:
            args.append(f"--rdzv-id={config.rdzv_id}")
        conf = _rendezvous_conf(config, timeout_key)
        if conf:
            args.append(f"--rdzv-conf={','.join(conf)}")
    if local_addr is not None:
        args.append(f"--local-addr={local_addr}")
    if module:
        args.append("--module")
    return [*args, script, *script_args]


def _rendezvous_conf(config: LaunchConfig, timeout_key: str) -> list[str]:
    """torchrun's ``--rdzv-conf`` entries: the join timeout, and quick failure detection for elastic jobs."""
    conf = []
    if config.rdzv_timeout is not None:
        conf.append(f"{timeout_key}={config.rdzv_timeout}")
        if timeout_key == "join_timeout":  # c10d: also bounds reaching an endpoint that no one answers
            conf.append(f"read_timeout={config.rdzv_timeout}")
    low, high = config.node_range()
    if low != high:
        # a node that vanishes is dropped after 3 missed 1 s keep-alives instead of 3 missed 5 s ones, and a round
        # closes 3 s (not 30 s) after enough nodes have joined: the survivors resume within seconds
        conf += ["keep_alive_interval=1", "keep_alive_max_attempt=3", "last_call_timeout=3"]
    return conf


def _wrapper_args(config: LaunchConfig, name: str) -> list[str]:
    """The options of paratrain.launch.torchrun (see there): one grace, a fresh store per round, loopback for one node,
    and the command its report names."""
    args = [f"--grace={config.shutdown_timeout}", "--fresh-store", f"--name={name}"]
    if config.is_single_node:
        args.append("--bind=127.0.0.1")  # nothing outside this machine needs to reach a job that runs on it
    return args


def _worker_env(config: LaunchConfig) -> dict[str, str]:
    """The environment for torchrun: the caller's, plus a fair share of CPU threads per worker.

    torchrun sets OMP_NUM_THREADS=1 for every worker when it is unset (and says so in a banner); sharing
    the cores out instead keeps CPU training from running single-threaded on a machine with cores to spare.
    """
    env = dict(os.environ)
    if config.is_single_node and "lo" in {name for _, name in socket.if_nameindex()}:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own connections: on loopback too, not the LAN address
    small_buffer_unless_set(
        env
    )  # torch's Flight Recorder: cheap to read when ranks disagree (paratrain.diagnostics.mismatch)
    if "OMP_NUM_THREADS" not in env:
        cores = os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // max(1, local_world_size(config.nproc_per_node))))
    return env


def launch(
    config: LaunchConfig,
    script: str,
    script_args: Sequence[str] = (),
    *,
    module: bool = False,
    timeout: float | None = None,
    name: str = "paratrain launch",
) -> int:
    """Run ``script`` under torchrun in a child process and return torchrun's exit code.

    Output is not captured: the workers' output appears on this process's stdout and stderr. A failed job ends
    with one line per failed rank (its exit code or signal, and its error's last line: each worker runs its
    script through :mod:`paratrain.launch.script`, which records the error), then the path of torchrun's full report,
    and the first failed rank's exit code is returned.

    Signals are handled like torchrun handles its own workers: torchrun runs in its own session, and the first
    SIGINT, SIGTERM, SIGHUP or SIGQUIT this process gets is forwarded to it once, after which torchrun stops
    its workers (killing them after its 30 s shutdown timeout). After a forwarded SIGINT this function raises
    ``KeyboardInterrupt``; after the others, or when torchrun itself is killed, it returns 128 + the signal's
    number. Signals are only forwarded when called from the main thread.

    Args:
        config: the launch settings.
        script: the script's path, or a module name when ``module`` is true.
        script_args: passed to every worker unchanged.
        module: run ``script`` as ``python -m script``.
        timeout: seconds to wait for the whole job; ``None`` waits as long as it runs.
        name: the command the report lines name (``paratrain train`` for its ranks).

    Raises:
        ConfigError: for invalid settings, a script file that does not exist, or a port node 0 cannot listen on
            because another program holds it (before any worker started).
        DistributedError: when the job ran past ``timeout`` (it is stopped first).
    """
    torchrun_args(config, script, script_args, module=module)  # checked as given, then run through the recorder
    args = torchrun_args(
        config, "paratrain.launch.script", [*(["-m"] if module else []), script, *script_args], module=True
    )
    if not module and not os.path.isfile(script):
        where = "" if os.path.isabs(script) else f" (relative to {os.getcwd()})"
        raise ConfigError(
            f"expected a Python script to launch, found no file at {script!r}{where}; check the path, or pass "
            "-m/--module to run a module"
        )
    command = [sys.executable, "-m", "paratrain.launch.torchrun", *_wrapper_args(config, name), "--", *args]
    try:
        code = supervise(command, env=_worker_env(config), timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DistributedError(
            f"the job did not finish within {timeout:g} s, so torchrun and its workers were stopped; "
            "look for a rank that hangs in a collective above, or raise the timeout"
        ) from None
    if code == EXIT_RENDEZVOUS_FAILED:
        raise DistributedError(_rendezvous_failed(config))
    if code == EXIT_PORT_TAKEN:
        raise ConfigError(_port_taken(config))
    return code


def _port_taken(config: LaunchConfig) -> str:
    """Node 0 could not listen on its port: which one, and what to pass instead."""
    if config.rdzv_endpoint is not None:
        host, port = parse_endpoint(config.rdzv_endpoint, allow_zero_port=config.is_single_node)
        return (
            f"--rdzv-endpoint {config.rdzv_endpoint}: port {port} on {host} is in use by another program (another "
            f"job?); give another port, the same on every machine"
        )
    instead = (
        "give another --master-port, or leave it out (a free one is then chosen)"
        if config.is_single_node
        else "give another --master-port, the same on every machine"
    )
    return (
        f"--master-port {config.master_port}: port {config.master_port} on {config.master_addr or '127.0.0.1'} is "
        f"in use by another program (another job?); {instead}"
    )


def _rendezvous_failed(config: LaunchConfig) -> str:
    if config.rdzv_endpoint is not None:
        where = f"the c10d rendezvous at {config.rdzv_endpoint}"
    elif config.master_port is not None:
        where = f"node 0 at {config.master_addr or '127.0.0.1'}:{config.master_port}"
    else:
        where = "the one-node rendezvous on this machine"
    waited = (
        f"within --rdzv-timeout {config.rdzv_timeout} s (torch tries to connect twice, so up to twice that)"
        if config.rdzv_timeout is not None
        else "within torch's default wait (600 s for c10d, 900 s for the static rendezvous; --rdzv-timeout sets it)"
    )
    return (
        f"the nodes did not meet: {where} did not answer, or not every node joined, {waited}. Start the node that "
        f"hosts it, check the address, the port and any firewall between the machines, and that --nnodes is "
        f"the number of machines you start"
    )
