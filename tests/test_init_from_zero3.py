"""``paratrain train --strategy zero3 --init-from FILE``: each rank reads its shards from the file, a tensor at a
time, and never holds the whole model; the numbers trained are ddp's, and the whole-model path's, bit for bit.

The models come from a module the test writes into its directory (``--model zero3_nets:NAME``): a small MLP with
dropout (so that the random numbers drawn after the model is built count too), the same with a buffer outside its
state dict (which sends zero3 down the whole-model path: no file holds that buffer), and a 16.8M-parameter MLP
whose rank caps its own memory (``RLIMIT_DATA``) as it is built, the way benchmarks/bench_memory_cap.py caps it.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from paratrain.checkpoint.file import latest_checkpoint, save_checkpoint
from paratrain.checkpoint.sharded import materialize, read_plain

pytestmark = [pytest.mark.processes, pytest.mark.slow]

MIB = 2**20
# the capped MLP: 784 -> 1536 x 16 -> 10, 36.6M parameters, 139.7 MiB of fp32 weights; its body frozen, its head
# trained. A rank's data segment grew by 129 MiB at its peak uncapped (its half of the weights, 69.9 MiB, a unit
# in flight, one tensor of the file, the threads' stacks); the whole model and the shards (209.6 MiB) do not fit
WIDTH, DEPTH = 1536, 16
CAP_MIB = 170

NETS = textwrap.dedent(
    f"""
    import json, os, resource
    from pathlib import Path

    import torch
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    from paratrain.training.models import build_model


    def small(input_shape, num_classes):
        return nn.Sequential(build_model("mlp", input_shape, num_classes, width=64, depth=2), nn.Dropout(0.25))


    def small_with_a_buffer_no_file_holds(input_shape, num_classes):
        model = small(input_shape, num_classes)
        first = next(m for m in model.modules() if isinstance(m, nn.Linear))  # one with reset_parameters()
        first.register_buffer("scratch", torch.zeros(3), persistent=False)
        return model


    def _kib(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no " + field)


    def capped(input_shape, num_classes):
        rank = os.environ.get("RANK")
        if rank is not None:  # a worker (the launcher's check builds it too, on the meta device: left alone)
            with torch.device("cpu"):  # what the first step imports, before the cap (as the benchmark's warm_up)
                tiny = nn.Linear(2, 2)
                with FlopCounterMode(display=False):  # the run counts a step's FLOPs as it starts
                    tiny(torch.ones(1, 2)).sum().backward()
                torch.optim.SGD(tiny.parameters(), lr=0.1).step()
            cap = int(os.environ["CAP_BYTES"])
            before = {{"rss_before": _kib("VmRSS"), "data_before": _kib("VmData"), "cap": cap}}
            if cap:
                _, hard = resource.getrlimit(resource.RLIMIT_DATA)
                resource.setrlimit(resource.RLIMIT_DATA, (before["data_before"] + cap, hard))
        model = build_model("mlp", input_shape, num_classes, width={WIDTH}, depth={DEPTH})
        head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
        for p in model.parameters():  # a frozen body, a head to fine-tune: the rank's training state is small
            p.requires_grad_(head.weight is p or head.bias is p)
        if rank is not None:  # the high-water mark so far, at every forward (the evaluation's come last)
            out = Path(os.environ["MEMORY_OUT"], "rank" + rank + ".json")
            figures = lambda: {{**before, "hwm": _kib("VmHWM"), "data": _kib("VmData")}}
            model.register_forward_pre_hook(lambda *_: out.write_text(json.dumps(figures())) and None)
        return model
    """
)


@pytest.fixture
def nets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zero3_nets.py").write_text(NETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import zero3_nets

    return zero3_nets


def _weights(nets: Any, name: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)  # not the run's seed: weights the run would not start from
    state: dict[str, torch.Tensor] = getattr(nets, name)((1, 28, 28), 10).state_dict()
    return state


def _trained(directory: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = materialize(read_plain(latest_checkpoint(directory)))["model"]
    return state


def _train(
    strategy: str, model: str, source: Path, out: str | None, *more: str, env: dict[str, str] | None = None
) -> str:
    from processes import run_cli

    done = run_cli(
        "train",
        "--strategy",
        strategy,
        "--nproc-per-node",
        "2",
        "--model",
        f"zero3_nets:{model}",
        "--init-from",
        str(source),
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--log-every",
        "100",
        *more,
        *(["--checkpoint-dir", out] if out is not None else []),
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_zero3_from_a_file_trains_the_numbers_of_ddp_and_of_the_whole_model_path(nets: Any, tmp_path: Path) -> None:
    source = tmp_path / "init.pt"
    torch.save(_weights(nets, "small"), source)
    steps = ["--max-steps", "4", "--momentum", "0.9"]
    ddp = _train("ddp", "small", source, "ddp", *steps)
    sharded = _train("zero3", "small", source, "zero3", *steps)
    buffered = _train("zero3", "small_with_a_buffer_no_file_holds", source, "whole", *steps)
    assert f"Starting from the weights in {source} (torch state dict, 6 tensors)" in sharded.splitlines()
    assert "Starting from the weights in" in ddp and "held the whole model" not in sharded
    # a buffer no file holds (persistent=False) comes from the replayed construction: still read shard by shard
    assert f"Starting from the weights in {source} (torch state dict, 6 tensors)" in buffered.splitlines()
    a, b, c = _trained("ddp"), _trained("zero3"), _trained("whole")
    assert a.keys() == b.keys() == c.keys()
    first = next(iter(a))
    assert not torch.equal(a[first], _weights(nets, "small")[first])  # it trained: the comparisons mean something
    for key in a:
        assert torch.equal(a[key], b[key]), key  # bit for bit: ddp's numbers
        assert torch.equal(b[key], c[key]), key  # the model with a buffer outside the state dict too


@pytest.mark.parametrize("kind", ["safetensors", "dcp", "sharded", "checkpoint-file"])
def test_zero3_reads_its_shards_from_every_format(nets: Any, tmp_path: Path, kind: str) -> None:
    """A learning rate of 1e-30 moves no weight: the checkpoint after two steps holds the file's weights."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from sharded_states import save_as

    weights = _weights(nets, "small")
    if kind == "safetensors":
        pytest.importorskip("safetensors")
        from safetensors.torch import save_file

        source = tmp_path / "init.safetensors"
        save_file(weights, str(source))
    elif kind == "dcp":
        source = tmp_path / "dcp"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": weights}, checkpoint_id=str(source), no_dist=True)
    elif kind == "sharded":  # a paratrain checkpoint of 3 ranks: each rank reads only its slices
        source = save_as(3, tmp_path / "run", {"model": weights, "epoch": 1})
    else:  # a paratrain checkpoint in one file: mapped, its digest checked
        source = save_checkpoint({"model": weights, "epoch": 1}, tmp_path / "run", "one.pt")
    _train("zero3", "small", source, "ckpt", "--max-steps", "2", "--lr", "1e-30")
    after = _trained("ckpt")
    assert after.keys() == weights.keys() and all(torch.equal(after[k], weights[k]) for k in weights)


@pytest.mark.parametrize("kind", ["pt", "safetensors", "dcp"])
def test_a_zero3_rank_capped_below_the_whole_model_and_its_shards_trains_from_the_file(
    nets: Any, tmp_path: Path, kind: str
) -> None:
    """Under a cap below the whole model's fp32 weights plus the rank's shards, a rank that held the whole model
    while loading (as every rank did before the shards were read from the file) fails to allocate; this one trains.
    What its memory grew by (VmHWM at the last forward, less VmRSS at the cap) stays below that too."""
    weights = _weights(nets, "capped")
    params = sum(t.numel() for t in weights.values())
    whole, shards = 4 * params, 4 * params // 2
    assert whole + shards > CAP_MIB * MIB
    if kind == "pt":
        source = tmp_path / "init.pt"
        torch.save(weights, source)
    elif kind == "safetensors":
        pytest.importorskip("safetensors")
        from safetensors.torch import save_file

        source = tmp_path / "init.safetensors"
        save_file(weights, str(source))
    else:  # read into buffers: the old path's failure there is the whole model's, not a mapping's
        import warnings

        import torch.distributed.checkpoint as dcp

        source = tmp_path / "dcp"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": weights}, checkpoint_id=str(source), no_dist=True)
    del weights
    malloc = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}  # as bench_memory_cap.py runs
    env = {**malloc, "CAP_BYTES": str(CAP_MIB * MIB), "MEMORY_OUT": str(tmp_path)}
    said = _train("zero3", "capped", source, None, "--max-steps", "2", "--batch-size", "32", env=env)
    assert "held the whole model" not in said
    figures = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    grown = [(r["hwm"] - r["rss_before"]) / MIB for r in figures]  # resident: the file's pages read included
    data = [(r["data"] - r["data_before"]) / MIB for r in figures]  # the data segment at the last forward
    print(
        f"{kind}: model {whole / MIB:.1f} MiB fp32, shards {shards / MIB:.1f} MiB; capped at {CAP_MIB} MiB: trained; "
        f"resident memory grew by {', '.join(f'{g:.1f}' for g in grown)} MiB at its peak, the data segment by "
        f"{', '.join(f'{d:.1f}' for d in data)} MiB at the last forward"
    )
    assert all(g * MIB < whole + shards for g in grown), grown


def test_a_file_that_does_not_fit_is_the_same_one_error_in_every_process_before_training(
    nets: Any, tmp_path: Path
) -> None:
    from processes import run_cli

    weights = _weights(nets, "small")
    head, bias = list(weights)[-2:]
    weights[head], weights[bias] = weights[head][:5].clone(), weights[bias][:5].clone()  # 5 classes, not 10
    torch.save(weights, tmp_path / "misfit.pt")
    flags = ["--model", "zero3_nets:small", "--init-from", str(tmp_path / "misfit.pt"), "--checkpoint-dir", "c"]
    done = run_cli("train", "--strategy", "zero3", "--nproc-per-node", "2", *flags)
    error = (
        f"paratrain train: error: --init-from {tmp_path / 'misfit.pt'} does not fit the model: {head!r} has shape "
        f"(5, 64) there, (10, 64) in the model. Give weights of this model (the same --model, --width, --depth)"
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    # every process found it (the launcher may stop the second before it reports): the same words, each time
    told = [line for line in lines if "does not fit" in line]
    ours = {error, *(f"paratrain train: rank {r} exited with code 2: {error}" for r in range(2))}
    assert told and set(told) <= ours and error in told, done.stderr
    assert not any("Traceback" in line for line in lines), done.stderr
    assert "Training" not in done.stdout and latest_checkpoint("c") is None
