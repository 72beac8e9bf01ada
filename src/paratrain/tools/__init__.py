"""What a user asks before and after going parallel: verify, bench, plan (the application, not the engine).

    from paratrain.tools import verify, bench, plan       # or paratrain.verify(...), loaded on first use
    report = verify(model="mlp", configs=["single", "dp:cpu,cpu", "ddp:2"])
    assert report.ok, report.render()

configs.py (the ``--configs`` words), settings.py (shared settings), workload.py (model, data, optimizer),
runner.py and worker.py (a configuration here or in launched processes), verify.py and diagnose.py,
bench.py and plot.py, plan.py (measuring) and plan_model.py (the pure prediction), report.py.
"""

from .verify import VerifyConfig, VerifyReport, verify

__all__ = ["VerifyConfig", "VerifyReport", "verify"]
