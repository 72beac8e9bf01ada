"""A training step's FLOPs, counted once with torch's FLOP counter, and the peaks of the GPUs we know.

    flops = step_flops(par.unwrap(model), images)            # forward + backward of one batch; None if uncountable
    peak = peak_flops(torch.device("cuda:0"), "bf16-mixed") # dense tensor-core FLOP/s; None where not known

The count runs the model once without gradients (so the run's weights, gradients and buffers are untouched) with
the random generators put back afterwards, so the run is the same with it. FLOPs grow linearly with the batch,
so one count of a few samples, scaled, holds for every step of a batch size, micro-batches or not. The peaks are the
vendors' dense figures (no sparsity); a GPU that is not in the table has no MFU, rather than a guessed one.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["PEAK_FLOPS", "peak_flops", "step_flops"]

# dense FLOP/s per GPU by (name fragment, precision class): the vendors' data sheets (SXM parts unless named)
PEAK_FLOPS: dict[tuple[str, str], float] = {
    ("A100", "half"): 312e12,
    ("A100", "float32"): 19.5e12,
    ("H100 PCIe", "half"): 756e12,
    ("H100 PCIe", "float32"): 51e12,
    ("H100", "half"): 989e12,
    ("H100", "float32"): 67e12,
    ("H200", "half"): 989e12,
    ("H200", "float32"): 67e12,
}


def step_flops(model: nn.Module, inputs: torch.Tensor) -> int | None:
    """FLOPs of one training step of ``model`` on ``inputs``: its forward, counted, and the backward as twice that.

    The forward runs without gradients in eval mode (no running statistics updated), with the random generators
    put back afterwards, so the run is the same with it. The backward of a layer costs about twice its forward
    (a gradient for the inputs and one for the weights): the usual ``6 * parameters * tokens`` rule, which the
    counter agrees with for linear and convolutional models. Returns None when the forward cannot be counted.
    """
    devices = [inputs.device] if inputs.device.type == "cuda" else []
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=devices), FlopCounterMode(display=False) as counter:
            model(inputs)
        return 3 * int(counter.get_total_flops())
    except Exception:  # an operation the counter cannot handle: no figure, rather than a wrong one
        return None
    finally:
        model.train(was_training)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The dense peak FLOP/s of the GPU ``device`` is at ``precision``; None for a CPU or a GPU not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    kind = "float32" if precision == "32" else "half"
    for (fragment, of), peak in PEAK_FLOPS.items():
        if fragment in name and of == kind:
            return peak
    return None
