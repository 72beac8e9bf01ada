"""What a user asks before and after going parallel: verify, bench, plan (the application, not the engine).

    import paratrain
    report = paratrain.verify(model="mlp", configs=["single", "dp:cpu,cpu", "ddp:2"])   # loads this package
    assert report.ok, report.render()
    paratrain.bench(model="mlp", configs=["single", "ddp:2"]).timing("ddp:2").speedup
    paratrain.plan(model="mlp", max_world_size=8).recommended

configs.py (the ``--configs`` words), settings.py (what all three share), workload.py (model, data,
optimizer), runner.py and worker.py (a configuration here, or in launched processes), verify.py and diagnose.py,
bench.py and plot.py, plan.py, plan_measure.py (what it measures; busy.py its peer processes),
plan_model.py (the prediction: pure), plan_validate.py (--validate against bench),
allreduce_probe.py, report.py. Nothing in the engine imports this package; ``paratrain.verify`` etc. load it on
first use.
"""

from paratrain.tools.bench import BenchConfig, BenchReport, bench
from paratrain.tools.plan import PlanConfig, PlanReport, plan
from paratrain.tools.verify import VerifyConfig, VerifyReport, verify

__all__ = [
    "BenchConfig",
    "BenchReport",
    "PlanConfig",
    "PlanReport",
    "VerifyConfig",
    "VerifyReport",
    "bench",
    "plan",
    "verify",
]
