"""A wrapper's state dict under its module's own keys: what a model that ``Parallel.prepare`` returned saves and loads.

torch's wrappers (``DataParallel``, ``DistributedDataParallel``) put ``module.`` before every key, so
``torch.save(model.state_dict())`` of a wrapped model does not load into the plain model. A model prepared by
:class:`paratrain.Parallel` gives the user's own keys under every strategy, as Lightning Fabric's wrapper does
(whole tensors under zero1 and zero2, where weights are whole; zero3 gathers them), and loads either form. The raw
wrappers keep torch's keys: their ``user_keys`` stays False unless ``Parallel`` sets it.

    model = par.prepare(model)
    torch.save(model.state_dict(), "w.pt")          # {"0.weight": ..., ...}, not {"module.0.weight": ...}
    plain.load_state_dict(torch.load("w.pt"))       # the plain model takes it
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["PREFIX", "UserKeys"]

PREFIX = "module."


class UserKeys:
    """Mixin for an ``nn.Module`` wrapper holding the user's model as ``self.module``.

    With ``user_keys`` set, the wrapper's own ``state_dict()`` is its module's, and ``load_state_dict`` takes the
    module's keys (or the ``module.``-prefixed ones a torch wrapper wrote). A parent module holding the wrapper
    still sees ``module.`` keys: only the call on the wrapper itself changes.
    """

    user_keys: bool = False
    module: nn.Module

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        if not self.user_keys:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)  # type: ignore[misc]
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        if self.user_keys and state_dict and not all(key.startswith(PREFIX) for key in state_dict):
            return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]
