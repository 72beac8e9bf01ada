"""Torch's own DistributedDataParallel tests, run against torch's class and against ours (CPU, gloo, 2 ranks).

    pip install expecttest                               # torch's test helpers need it (in paratrain's dev extra)
    python scripts/torch_ddp_suite.py                    # every DDP test of torch's suite, under both classes
    python scripts/torch_ddp_suite.py -k no_sync -k join # tests whose name holds one of the words
    python scripts/torch_ddp_suite.py --impl ours --json ddp_suite.json --log ddp_suite.log

The tests are torch's ``DistributedTest._DistTestBase`` (shipped in every wheel, in
``torch/testing/_internal/distributed/distributed_test.py``), run as torch's ``test_distributed_spawn.py`` runs
them: each test in two freshly spawned processes over gloo. For the ``ours`` runs, every spawned rank replaces
torch's class by ``paratrain.DistributedDataParallel`` under each name the tests use before the test starts, and
counts the constructions and forwards of either class, so the report shows the swap took effect.

Prints one line per test: torch's result and ours (PASS, FAIL with the first line of the error, SKIP with the
reason), or OUT OF SCOPE for the tests that exercise torch-private internals (never counted as passed). Exits 1
when a test that passes under torch's class does not pass under ours.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import re
import sys
import tempfile
import time
import unittest
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# torch's suite reads these when it is imported; spawned ranks inherit them
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())  # torch's setUp makes a fresh one per test

import torch
from torch import nn

try:
    from torch.testing._internal import common_distributed
    from torch.testing._internal.distributed import distributed_test
except ModuleNotFoundError as exc:  # expecttest, which torch's test helpers import
    sys.exit(f"torch's test suite needs {exc.name!r}: pip install {exc.name} (or pip install -e '.[dev]')")

IMPLEMENTATIONS = ("torch", "ours")

# Tests that exercise torch-private internals rather than DDP's public contract; run, but never counted as passed.
OUT_OF_SCOPE = {
    "test_compute_bucket_assignment_by_size_sparse_error_with_logger": "dist._compute_bucket_assignment_by_size",
    "test_compute_bucket_assignment_by_size_sparse_error_without_logger": "dist._compute_bucket_assignment_by_size",
    "test_verify_model_across_rank_with_logger": "dist._verify_params_across_processes, the C++ logger",
    "test_verify_model_across_rank_without_logger": "dist._verify_params_across_processes",
    "test_ddp_logging_data_cpu": "_get_ddp_logging_data (the C++ logger)",
    "test_ddp_logging_data_gpu": "_get_ddp_logging_data (the C++ logger)",
    "test_ddp_comm_hook_logging": "_get_ddp_logging_data (the C++ logger)",
    "test_ddp_python_error_logged": "the C++ logger",
    "test_sync_bn_logged": "_get_ddp_logging_data (the C++ logger)",
    "test_detect_ddp_is_actually_static": "_get_ddp_logging_data (the C++ logger)",
    "test_ddp_build_debug_param_to_name_mapping": "_build_debug_param_to_name_mapping",
    "test_ddp_build_debug_param_to_name_mapping_requires_grad": "_build_debug_param_to_name_mapping",
    "test_ddp_remove_autograd_hooks": "_remove_autograd_hooks",
    "test_ddp_sink_noclone": "_set_ddp_sink_clone, _DDPSink",
    "test_ddp_has_finalized": "the C++ reducer's internal state",
    "test_ddp_bucket_cap_mb_list": "_BucketCapacityConfig, bucket_cap_mb as a list",
    "test_ddp_broadcast_buffer_via_hook": "_register_buffer_comm_hook",
    "test_ddp_buffer_hook_allreduce": "_register_buffer_comm_hook",
    "test_ddp_buffer_hook_allreduce_return_future": "_register_buffer_comm_hook",
    "test_ddp_native_mixed_precision_ignored_params": "mixed_precision=_MixedPrecision",
    "test_ddp_native_mixed_precision_grad_as_bucket_view_no_set_grad_none": "mixed_precision=_MixedPrecision",
    "test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none": "mixed_precision=_MixedPrecision",
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none": "mixed_precision=_MixedPrecision",
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_set_grad_to_none": "mixed_precision=_MixedPrecision",
    "test_ddp_apply_optim_in_backward": "_apply_optimizer_in_backward",
    "test_ddp_apply_optim_in_backward_grad_as_bucket_view_false": "_apply_optimizer_in_backward",
    "test_ddp_apply_optim_in_backward_ignored_params": "_apply_optimizer_in_backward",
    "test_static_graph_api_cpu": "_set_static_graph's error as the C++ logger records it",
}


@dataclass
class Outcome:
    """One test under one class: PASS, FAIL or SKIP, why, and what each rank saw of the swap."""

    result: str
    detail: str = ""
    seconds: float = 0.0
    ranks: list[dict[str, Any]] = field(default_factory=list)


# -- what runs in every spawned rank ------------------------------------------------------------------------------


def _install(implementation: str) -> type[nn.Module]:
    """Bind the names torch's tests use for DDP to the implementation under test; returns its class."""
    if implementation == "torch":
        return torch.nn.parallel.distributed.DistributedDataParallel
    import paratrain

    # the tests write torch.nn.parallel.DistributedDataParallel, nn.parallel.DistributedDataParallel and
    # DistributedDataParallel (imported into the suite's module); torch.nn.parallel.distributed keeps torch's
    # class, which torch's own helpers (Join's hooks, _DDPSink) refer to
    torch.nn.parallel.DistributedDataParallel = paratrain.DistributedDataParallel  # type: ignore[misc]
    distributed_test.DistributedDataParallel = paratrain.DistributedDataParallel  # type: ignore[attr-defined]
    return paratrain.DistributedDataParallel


def _count_calls(counts: dict[str, int]) -> None:
    """Count the constructions and forwards of torch's class and of ours (a wrapper around each method).

    Not a global forward hook: some tests call ``model.forward(x)`` directly, which bypasses hooks.
    """
    import paratrain

    for key, cls in (
        ("torch", torch.nn.parallel.distributed.DistributedDataParallel),
        ("ours", paratrain.DistributedDataParallel),
    ):
        for method in ("__init__", "forward"):
            setattr(cls, method, _counted(getattr(cls, method), counts, f"{key} {method.strip('_')}"))


def _counted(fn: Any, counts: dict[str, int], key: str) -> Any:
    counts[key] = 0

    @functools.wraps(fn)
    def counting(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return fn(*args, **kwargs)

    return counting


def _report_path(file_name: str, rank: int) -> Path:
    return Path(f"{file_name}.paratrain-rank{rank}.json")


class _Suite(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):  # type: ignore[misc]
    implementation = "torch"

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
        installed = _install(cls.implementation)
        counts: dict[str, int] = {}
        _count_calls(counts)
        try:
            super()._run(rank, test_name, file_name, pipe, **kwargs)  # ends the process with sys.exit
        finally:
            resolved = {
                "torch.nn.parallel.DistributedDataParallel": torch.nn.parallel.DistributedDataParallel,
                "distributed_test.DistributedDataParallel": distributed_test.DistributedDataParallel,
            }
            report = {
                "rank": rank,
                "installed": f"{installed.__module__}.{installed.__qualname__}",
                "resolved": {name: f"{c.__module__}.{c.__qualname__}" for name, c in resolved.items()},
                "calls": counts,
            }
            _report_path(file_name, rank).write_text(json.dumps(report))

    def collect_reports(self) -> list[dict[str, Any]]:
        reports: list[dict[str, Any]] = []
        if not hasattr(self, "file_name"):
            return reports  # skipped before setUp: no rank was started
        for rank in range(int(self.world_size)):
            path = _report_path(self.file_name, rank)
            if path.exists():
                reports.append(json.loads(path.read_text()))
                path.unlink()
        return reports


class TorchDDP(_Suite):
    implementation = "torch"


class OursDDP(_Suite):
    implementation = "ours"


SUITES = {"torch": TorchDDP, "ours": OursDDP}


# -- the parent: choose the tests, run each under each class, report ---------------------------------------------


def ddp_tests() -> list[str]:
    """The suite's tests that build a DistributedDataParallel, in their own body or in a helper they call."""
    base = distributed_test.DistributedTest._DistTestBase
    seen_source: dict[str, str] = {}

    def source(name: str) -> str:
        if name not in seen_source:
            fn = getattr(base, name, None)
            try:
                seen_source[name] = inspect.getsource(inspect.unwrap(fn)) if callable(fn) else ""
            except (OSError, TypeError):
                seen_source[name] = ""
        return seen_source[name]

    def builds_ddp(name: str, visited: set[str]) -> bool:
        if name in visited:
            return False
        visited.add(name)
        text = source(name)
        if "DistributedDataParallel" in text:
            return True
        return any(builds_ddp(helper, visited) for helper in set(re.findall(r"self\.(_\w+)\(", text)))

    return sorted(n for n in dir(base) if n.startswith("test_") and builds_ddp(n, set()))


class _Recorder(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.outcome = Outcome("PASS")

    def addError(self, test: Any, err: Any) -> None:
        self.outcome = Outcome("FAIL", _first_line(self._exc_info_to_string(err, test)))

    def addFailure(self, test: Any, err: Any) -> None:
        self.outcome = Outcome("FAIL", _first_line(self._exc_info_to_string(err, test)))

    def addSkip(self, test: Any, reason: str) -> None:
        self.outcome = Outcome("SKIP", reason.strip().splitlines()[0] if reason.strip() else "")


def _first_line(text: str) -> str:
    """The telling line of a failure: the last exception a rank raised, or else the parent's last line."""
    _, marker, rank_part = text.rpartition("exited with error code")
    lines = [line.strip() for line in (rank_part if marker else text).splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", line)]
    found = raised[-1] if raised else (lines[-1] if lines else "")
    return found[:240]


@contextlib.contextmanager
def _output_to(log: Any) -> Iterator[None]:
    """Send this process's (and so its spawned ranks') stdout and stderr to ``log`` inside the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


_GPU_DECORATORS = ("@skip_if_lt_x_gpu(", "@skip_if_no_gpu")


def gpu_only(name: str) -> str | None:
    """The decorator that makes a test skip itself without GPUs, if it has one: such a test is not started here."""
    fn = getattr(distributed_test.DistributedTest._DistTestBase, name)
    try:
        head = inspect.getsource(fn).split(f"def {name}(")[0]
    except (OSError, TypeError):
        return None
    return next((d.strip("@(") for d in _GPU_DECORATORS if d in head), None)


def run_one(name: str, implementation: str, log: Any) -> Outcome:
    decorator = gpu_only(name) if not torch.cuda.is_available() else None
    if decorator is not None:
        return Outcome("SKIP", f"needs GPUs ({decorator}); not started, as it would skip itself")
    case = SUITES[implementation](name)
    recorder = _Recorder()
    start = time.monotonic()
    log.write(f"\n===== {name} [{implementation}] =====\n")
    log.flush()
    with _output_to(log):
        case.run(recorder)
    outcome = recorder.outcome
    outcome.seconds = time.monotonic() - start
    outcome.ranks = case.collect_reports()
    if outcome.result == "PASS" and implementation == "ours" and not _went_through_ours(outcome.ranks):
        outcome.result, outcome.detail = "FAIL", "the swap did not take effect: torch's class was built or run"
    return outcome


def _went_through_ours(ranks: list[dict[str, Any]]) -> bool:
    return all(r["calls"]["torch init"] == 0 and r["calls"]["torch forward"] == 0 for r in ranks)


def verdict(name: str, outcomes: dict[str, Outcome]) -> str:
    """What the pair of results means: ok, a regression of ours, or neither counted."""
    if name in OUT_OF_SCOPE:
        return "out of scope"
    torch_result = outcomes.get("torch")
    ours = outcomes.get("ours")
    if torch_result is None or ours is None:
        return ""
    if torch_result.result != "PASS":
        return "not counted"
    return "ok" if ours.result == "PASS" else "REGRESSION"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", action="append", default=[], help="run the tests whose name holds this (repeatable)")
    parser.add_argument("--impl", choices=(*IMPLEMENTATIONS, "both"), default="both")
    parser.add_argument("--timeout", type=int, default=120, help="seconds one test may take (torch's default: 300)")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("--log", type=Path, help="the ranks' output (default: a temporary file, named at the end)")
    parser.add_argument("--list", action="store_true", help="list the tests and stop")
    args = parser.parse_args(argv)

    names = [n for n in ddp_tests() if not args.k or any(k in n for k in args.k)]
    if args.list:
        print("\n".join(names))
        return 0
    if not names:
        print(f"no DDP test of torch's suite matches {args.k}", file=sys.stderr)
        return 2
    common_distributed.TIMEOUT_DEFAULT = args.timeout
    common_distributed.TIMEOUT_OVERRIDE.clear()
    implementations = IMPLEMENTATIONS if args.impl == "both" else (args.impl,)
    log_path = args.log or Path(tempfile.mkstemp(prefix="torch_ddp_suite-", suffix=".log")[1])

    results: dict[str, dict[str, Outcome]] = {}
    width = max(len(n) for n in names)
    print(f"torch {torch.__version__}, gloo, world size {os.environ['WORLD_SIZE']}: {len(names)} tests")
    print(f"{'test':<{width}}  {'torch':<6} {'ours':<6} verdict / detail", flush=True)
    with log_path.open("w") as log:
        for name in names:
            results[name] = {impl: run_one(name, impl, log) for impl in implementations}
            print(_line(name, results[name], width), flush=True)

    print(_summary(results))
    print(f"ranks' output: {log_path}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    n: {"verdict": verdict(n, o), **{impl: asdict(out) for impl, out in o.items()}}
                    for n, o in results.items()
                },
                indent=1,
            )
        )
    return 1 if any(verdict(n, o) == "REGRESSION" for n, o in results.items()) else 0


def _line(name: str, outcomes: dict[str, Outcome], width: int) -> str:
    cells = [outcomes[impl].result if impl in outcomes else "-" for impl in IMPLEMENTATIONS]
    judged = verdict(name, outcomes)
    details = []
    if name in OUT_OF_SCOPE:
        details.append(f"tests {OUT_OF_SCOPE[name]}")
    for impl, outcome in outcomes.items():
        if outcome.result != "PASS" and outcome.detail:
            details.append(f"{impl}: {outcome.detail}")
    detail = "; ".join(details)
    return f"{name:<{width}}  {cells[0]:<6} {cells[1]:<6} {judged}{': ' + detail if detail else ''}"


def _summary(results: dict[str, dict[str, Outcome]]) -> str:
    verdicts = [verdict(n, o) for n, o in results.items()]
    in_scope = [o for n, o in results.items() if n not in OUT_OF_SCOPE]

    def count(impl: str, result: str) -> int:
        return sum(1 for o in in_scope if impl in o and o[impl].result == result)

    lines = [f"{len(results)} tests, {len(results) - len(in_scope)} out of scope (torch-private internals):"]
    for impl in IMPLEMENTATIONS:
        if any(impl in o for o in results.values()):
            lines.append(
                f"  {impl:<5}: {count(impl, 'PASS')} pass, {count(impl, 'FAIL')} fail, {count(impl, 'SKIP')} skip"
            )
    if all(len(o) == len(IMPLEMENTATIONS) for o in results.values()):
        lines.append(
            f"  of the {verdicts.count('ok') + verdicts.count('REGRESSION')} in-scope tests that pass under torch's "
            f"class, ours passes {verdicts.count('ok')}; {verdicts.count('REGRESSION')} regression(s)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
