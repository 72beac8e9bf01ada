"""How many processes to start, on how many machines, and how they meet: :class:`LaunchConfig`, checked.

    config = LaunchConfig(nproc_per_node=2, nnodes="1:4", rdzv_endpoint="10.0.0.1:29400", max_restarts=3)
    config.check()                     # ConfigError saying what was expected, what was found, what to pass
    local_world_size("auto")           # one process per GPU, one without a GPU

The fields are also the launcher flags of ``paratrain launch`` and ``paratrain train`` (their help is each
field's metadata); :mod:`paratrain.launch.launcher` turns a config into torchrun's command line.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.errors import ConfigError
from paratrain.settings import Settings, setting

__all__ = ["EXIT_PORT_TAKEN", "EXIT_RENDEZVOUS_FAILED", "LaunchConfig", "local_world_size", "parse_endpoint"]

EXIT_RENDEZVOUS_FAILED = 75  # paratrain.launch.torchrun's exit when the nodes never met; launch() names the endpoint
EXIT_PORT_TAKEN = 76  # paratrain.launch.torchrun's exit when node 0's --master-port is in use; launch() says so


@dataclass(frozen=True)
class LaunchConfig(Settings):
    """How many processes to start, on how many machines, and how they find each other.

    Three ways for the nodes to meet, chosen by the fields given:

    * one node, no ``master_port`` and no ``rdzv_endpoint``: torchrun's ``--standalone`` rendezvous on a port
      the operating system picks (no race for a free port); workers see ``MASTER_ADDR=master_addr``
      (default ``127.0.0.1``).
    * ``master_addr`` and ``master_port`` (static rendezvous): node ``node_rank`` of ``nnodes``; node 0 listens
      at ``master_addr:master_port``. Node ranks are the ones given, so ``GROUP_RANK == node_rank``.
    * ``rdzv_endpoint`` (c10d rendezvous, needed for elastic ``MIN:MAX`` node counts): the machine whose address
      is the endpoint's host hosts the rendezvous, the others connect to it, and the rendezvous numbers the
      nodes (torchrun ignores ``node_rank`` here).

    Each field's help (its metadata) is also the help of its ``paratrain launch`` / ``paratrain train`` flag.
    """

    nproc_per_node: int | str = setting(
        "auto",
        "processes on this machine, or auto: one per GPU, and one without a GPU (torchrun's own auto "
        "would start one per CPU core)",
        metavar="N|auto",
    )
    nnodes: int | str = setting(
        "1",
        "number of machines, N or MIN:MAX (elastic; needs --rdzv-endpoint)",
        metavar="N|MIN:MAX",
    )
    node_rank: int = setting(
        0,
        "this machine's rank, 0 .. nnodes - 1 (static rendezvous)",
        metavar="R",
    )
    master_addr: str | None = setting(
        None,
        "address of node 0 (static rendezvous; required with several nodes)",
        metavar="ADDR",
    )
    master_port: int | None = setting(
        None,
        "port on node 0 (static rendezvous; one node: picked for you)",
        metavar="PORT",
    )
    rdzv_endpoint: str | None = setting(
        None,
        "HOST:PORT of the c10d rendezvous, the same on every machine; it numbers the nodes ([::1]:29400 for IPv6)",
        metavar="HOST:PORT",
    )
    rdzv_id: str | None = setting(
        None,
        "a job id shared by the nodes of one job",
        metavar="ID",
    )
    rdzv_timeout: int | None = setting(
        None,
        "seconds a node waits for the others to join (torchrun's default 600)",
        metavar="SECONDS",
    )
    local_addr: str | None = setting(
        None,
        "the address other machines reach this one at (default: the host name; loopback when the "
        "whole job is on this machine)",
        metavar="ADDR",
    )
    max_restarts: int = setting(
        0,
        "restart the workers up to K times after a failure",
        metavar="K",
    )
    monitor_interval: float = setting(
        0.1,
        "seconds between torchrun's checks of its workers",
        metavar="SECONDS",
    )
    shutdown_timeout: int = setting(
        5,
        "seconds torchrun gives the other workers to exit after one fails (or the job is interrupted) "
        "before SIGKILL; torchrun's own default is 30, and a stopped or hung worker only goes with SIGKILL",
        metavar="SECONDS",
    )

    def node_range(self) -> tuple[int, int]:
        """The minimum and maximum number of nodes, from ``nnodes``."""
        text = str(self.nnodes).strip()
        parts = text.split(":")
        try:
            if len(parts) > 2:
                raise ValueError(text)
            low, high = int(parts[0]), int(parts[-1])
        except ValueError:
            raise ConfigError(
                f"nnodes: expected a node count N or a range MIN:MAX such as 2 or 1:4, found {self.nnodes!r}"
            ) from None
        if not 1 <= low <= high:
            raise ConfigError(
                f"nnodes: expected 1 <= MIN <= MAX, found {self.nnodes!r}; give e.g. --nnodes 2 or --nnodes 1:4"
            )
        return low, high

    @property
    def is_single_node(self) -> bool:
        """True when the job runs on this machine only (``nnodes`` is 1)."""
        return self.node_range()[1] == 1

    def check_group(self) -> None:
        """Check every field and how they combine.

        Raises:
            ConfigError: saying which value was expected, what was found, and what to pass instead.
        """
        _checked_nproc(self.nproc_per_node)  # "auto" is resolved only when the arguments are built
        low, high = self.node_range()
        elastic = low != high
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) or self.node_rank < 0:
            raise ConfigError(f"node_rank: expected an integer >= 0, found {self.node_rank!r}")
        if self.node_rank >= high:
            raise ConfigError(
                f"node_rank: expected 0 .. {high - 1} for {high} node(s), found {self.node_rank}; "
                "number the machines from 0 and pass --nnodes with their count"
            )
        if self.master_port is not None:
            _check_port(self.master_port, "master_port", allow_zero=False)
        for name in ("master_addr", "local_addr", "rdzv_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{name}: expected a non-empty string or None, found {value!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"max_restarts: expected an integer >= 0, found {self.max_restarts!r}")
        if not self.monitor_interval > 0:
            raise ConfigError(
                f"monitor_interval: expected a positive number of seconds, found {self.monitor_interval!r}"
            )
        if (
            isinstance(self.shutdown_timeout, bool)
            or not isinstance(self.shutdown_timeout, int)
            or self.shutdown_timeout < 1
        ):
            raise ConfigError(
                f"shutdown_timeout: expected a positive whole number of seconds, found {self.shutdown_timeout!r}"
            )
        if self.rdzv_timeout is not None and (not isinstance(self.rdzv_timeout, int) or self.rdzv_timeout < 1):
            raise ConfigError(f"rdzv_timeout: expected a positive whole number of seconds, found {self.rdzv_timeout!r}")

        if self.rdzv_endpoint is not None:
            parse_endpoint(self.rdzv_endpoint, allow_zero_port=high == 1)
            if self.master_addr is not None or self.master_port is not None:
                raise ConfigError(
                    "expected either --rdzv-endpoint (c10d rendezvous) or --master-addr/--master-port (static "
                    f"rendezvous), found both: rdzv_endpoint={self.rdzv_endpoint!r}, "
                    f"master_addr={self.master_addr!r}, master_port={self.master_port!r}; drop one of them"
                )
            return
        if elastic:
            raise ConfigError(
                f"nnodes={self.nnodes!r} is elastic (MIN:MAX) and needs the c10d rendezvous; "
                "pass --rdzv-endpoint HOST:PORT (the same on every machine), or a fixed --nnodes N"
            )
        if high > 1 and (self.master_addr is None or self.master_port is None):
            raise ConfigError(
                f"{high} nodes need to know where to meet, found master_addr={self.master_addr!r}, "
                f"master_port={self.master_port!r}; pass --master-addr and --master-port of node 0 (static "
                "rendezvous), or --rdzv-endpoint HOST:PORT, the same on every machine"
            )


def local_world_size(nproc_per_node: int | str) -> int:
    """The number of processes to start on this machine for ``nproc_per_node``.

    ``"auto"`` is the number of GPUs (or other accelerators), or 1 on a machine without any.

    Raises:
        ConfigError: for anything but a positive integer or ``"auto"``.
    """
    checked = _checked_nproc(nproc_per_node)
    return (_accelerator_count() or 1) if isinstance(checked, str) else checked


def _checked_nproc(nproc_per_node: int | str) -> int | str:
    """A positive int, or "auto"; digit strings become ints."""
    value = nproc_per_node
    if isinstance(value, str):
        value = value.strip().lower()
        if value == "auto":
            return value
        value = int(value) if value.isdigit() else nproc_per_node
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"nproc_per_node: expected a positive integer or 'auto' (one per GPU, one without), found {value!r}"
        )
    return value


def _accelerator_count() -> int:
    import torch  # only here, so that building a parser stays cheap

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6: CUDA, ROCm, XPU, MPS, ...
    if accelerator is not None:
        return int(accelerator.device_count()) if accelerator.is_available() else 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_port(port: object, name: str, *, allow_zero: bool) -> int:
    low = 0 if allow_zero else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        raise ConfigError(f"{name}: expected a port number {low}..65535, found {port!r}")
    return port


def parse_endpoint(endpoint: str, *, allow_zero_port: bool) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[V6]:PORT``) -> (host, port)."""
    host, sep, port_text = endpoint.strip().rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if not sep or not host or (":" in host and not bracketed):
        raise ConfigError(
            f"rdzv_endpoint: expected HOST:PORT such as 10.0.0.1:29400 or [::1]:29400, found {endpoint!r}; "
            "the port is needed because every node must connect to the same one"
        )
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"rdzv_endpoint: expected a numeric port after ':', found {endpoint!r}") from None
    return host, _check_port(port, "rdzv_endpoint port", allow_zero=allow_zero_port)
