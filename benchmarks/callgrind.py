"""Count what a piece of a Python program executes, by valgrind's callgrind: numbers that load does not move.

    marks = Marks.build(tmp)           # marks.library, or marks.missing: why not (no valgrind, header or compiler)
    counts = run_counted([python, script, "--child", str(marks.library)], tmp)   # {label: Counts}
    # in the child, around each region to count:
    lib = ctypes.CDLL(library); lib.marks_begin(); ...; lib.marks_end(b"label")

On this shared 2-core VM a loop's wall time moves by 25% and more between invocations, and the hardware counters
are not exposed (``perf stat -e instructions`` says "not supported"). Callgrind simulates the CPU instead: the
instructions a region executes are the same in every run, whatever else the machine does, and its cache and
branch simulation gives an estimate of the cycles they cost (KCachegrind's "cycle estimation": each instruction
one cycle, each first-level miss and mispredicted branch 10 more, each last-level miss 100 more). A region is
marked by two calls into a small library compiled here from valgrind's own header (``valgrind/callgrind.h``): the
program runs uninstrumented (about 5x slower) until the first mark and is counted (about 100x slower) only inside
its regions.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Counts", "Marks", "run_counted"]

MARKS_C = """\
#include <valgrind/callgrind.h>
void marks_begin(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void marks_end(const char *label) { CALLGRIND_DUMP_STATS_AT(label); CALLGRIND_STOP_INSTRUMENTATION; }
"""
HEADER = Path("/usr/include/valgrind/callgrind.h")


@dataclass(frozen=True)
class Counts:
    """What one marked region executed: instructions, and the cycles the cache and branch simulation estimate."""

    instructions: int
    cycles: int


@dataclass(frozen=True)
class Marks:
    """The compiled marking library (``library``), or why there is none (``missing``)."""

    library: Path | None
    missing: str | None = None

    @classmethod
    def build(cls, directory: Path) -> Marks:
        valgrind, cc = shutil.which("valgrind"), shutil.which("cc") or shutil.which("gcc")
        if valgrind is None:
            return cls(None, "valgrind is not installed (Debian: apt-get install valgrind)")
        if cc is None:
            return cls(None, "no C compiler (cc or gcc) to build the marking library")
        if not HEADER.exists():
            return cls(None, f"{HEADER} is missing (Debian ships it with valgrind)")
        source, library = directory / "marks.c", directory / "libmarks.so"
        source.write_text(MARKS_C)
        built = subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], capture_output=True)
        if built.returncode != 0:
            return cls(None, f"the marking library did not compile: {built.stderr.decode().strip()[:200]}")
        return cls(library)


def _counts(dump: str) -> tuple[str, Counts] | None:
    """The label and counts of one dump file's region (None for the dump at the program's end)."""
    label = re.search(r"^desc: Trigger: Client Request: (.+)$", dump, re.M)
    events = re.search(r"^events: (.+)$", dump, re.M)
    summary = re.search(r"^summary: (.+)$", dump, re.M)
    if label is None or events is None or summary is None:
        return None
    found = dict(zip(events.group(1).split(), map(int, summary.group(1).split()), strict=True))
    first = found.get("I1mr", 0) + found.get("D1mr", 0) + found.get("D1mw", 0)
    last = found.get("ILmr", 0) + found.get("DLmr", 0) + found.get("DLmw", 0)
    branches = found.get("Bcm", 0) + found.get("Bim", 0)
    cycles = found["Ir"] + 10 * (first + branches) + 100 * last
    return label.group(1).strip(), Counts(found["Ir"], cycles)


def run_counted(command: list[str], directory: Path, env: dict[str, str] | None = None) -> dict[str, Counts]:
    """Run ``command`` under callgrind, counting only its marked regions; each region's counts by label."""
    out = directory / "callgrind.out"
    valgrind = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--cache-sim=yes",
        "--branch-sim=yes",
        f"--callgrind-out-file={out}",
    ]
    done = subprocess.run(valgrind + command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the counted run failed ({done.returncode}): {done.stderr.strip()[-600:]}")
    regions = {}
    for dump in sorted(directory.glob("callgrind.out.*")):
        found = _counts(dump.read_text(errors="replace"))
        if found is not None:
            regions[found[0]] = found[1]
    return regions
