"""SLURM's compressed host lists: ``node[01-04,07]`` is node01, node02, node03, node04 and node07.

    expand_hostlist("node[01-04,07],gpu-a")   # ['node01', 'node02', 'node03', 'node04', 'node07', 'gpu-a']
    expand_hostlist("rack[1-2]-n[1-2]")       # ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']

Hosts are separated by commas outside brackets; each bracket holds numbers and ranges, a range keeps its
zero-padding (``[08-10]``: 08, 09, 10), and several brackets in one host multiply. What does not parse raises a
:class:`~paratrain.errors.ConfigError` quoting the list.
"""

from __future__ import annotations

import itertools
import re

from paratrain.errors import ConfigError

__all__ = ["expand_hostlist"]

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_hostlist(hostlist: str, what: str = "the host list") -> list[str]:
    """Every host of ``hostlist`` in order (``what``: the variable it came from, for the error)."""
    if not hostlist.strip():
        raise _unparsable(hostlist, what, "it is empty")
    return [host for part in _split(hostlist, what) for host in _expand(part, hostlist, what)]


def _split(hostlist: str, what: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(hostlist):
        if char == "[":
            depth += 1
            if depth > 1:
                raise _unparsable(hostlist, what, f"a bracket opens inside another at position {i}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _unparsable(hostlist, what, f"a bracket closes at position {i} that never opened")
        elif char == "," and depth == 0:
            parts.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise _unparsable(hostlist, what, "a bracket never closes")
    parts.append(hostlist[start:])
    if any(not part.strip() for part in parts):
        raise _unparsable(hostlist, what, "it has an empty host between commas")
    return [part.strip() for part in parts]


def _expand(host: str, hostlist: str, what: str) -> list[str]:
    pieces = re.split(r"\[([^\]]*)\]", host)  # text, bracket, text, bracket, ..., text
    choices: list[list[str]] = []
    for i, piece in enumerate(pieces):
        choices.append(_numbers(piece, hostlist, what) if i % 2 else [piece])
    return ["".join(parts) for parts in itertools.product(*choices)]


def _numbers(bracket: str, hostlist: str, what: str) -> list[str]:
    found: list[str] = []
    for item in bracket.split(","):
        match = _RANGE.fullmatch(item.strip())
        if match is None:
            raise _unparsable(hostlist, what, f"[{bracket}] holds {item!r}, which is neither a number nor a range a-b")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise _unparsable(hostlist, what, f"the range {item!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        found += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return found


def _unparsable(hostlist: str, what: str, why: str) -> ConfigError:
    return ConfigError(
        f"{what}={hostlist!r} does not parse as a SLURM host list ({why}); expected hosts such as "
        f"'node[01-04,07],gpu-a'. Set MASTER_ADDR to the first host to skip reading it"
    )
