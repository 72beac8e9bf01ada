"""The training job behind ``paratrain train``, written only against :class:`~paratrain.parallel.Parallel`.

    paratrain train                                          # the tutorial's job: SimpleNet, digits, 5 epochs
    paratrain train --strategy dp --devices cpu,cpu,cpu      # the same run split over three CPU replicas
    paratrain train --devices cuda:0,cuda:1 --metrics-out m.json
    paratrain train --checkpoint-dir runs/a && paratrain train --checkpoint-dir runs/a --resume
    paratrain train --precision bf16-mixed --accumulate 4 --optimizer adamw --lr-schedule cosine --log-dir runs/b

From Python: ``train(TrainConfig(epochs=1, quiet=True))`` returns a :class:`~paratrain.training.results.TrainResult`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.checkpoint.file import check_writable
from paratrain.environment import ClusterEnvironment
from paratrain.errors import TrainingError, TrainingInterrupted
from paratrain.files import is_stdout, remove_stale_temporaries
from paratrain.launch.config import LaunchConfig
from paratrain.loop.prepared import idle_processes
from paratrain.parallel import Parallel, seed_everything
from paratrain.strategies import resolve_devices, resolve_strategy
from paratrain.strategies.fully_sharded import Zero3Strategy
from paratrain.training.config import TrainConfig
from paratrain.training.data import TensorData, parse_input_shape
from paratrain.training.datasets import load_dataset
from paratrain.training.flops import peak_flops, step_flops
from paratrain.training.initial_weights import initial_model
from paratrain.training.interrupt import StopRequest, interrupted_message
from paratrain.training.loader import DeviceLoader
from paratrain.training.log_line import StepMeter, peak_memory_of_ranks
from paratrain.training.logs import RunLog
from paratrain.training.model_spec import build_model_spec
from paratrain.training.optimizers import apply_settings, build_optimizer, build_scheduler, optimizer_settings
from paratrain.training.progress import Progress
from paratrain.training.recovery import ProgressLog
from paratrain.training.results import TrainResult, fingerprint, write_metrics
from paratrain.training.resume import plan_start
from paratrain.training.run_record import Invocation, environment
from paratrain.training.state import Position, RunRecord, restore, save
from paratrain.training.stepper import LossMeter, StepOutcome, Stepper
from paratrain.training.threads import MachineLoad, choose_threads, using_threads
from paratrain.training.timing import StepTimer, time_breakdown
from paratrain.training.trackers import open_trackers
from paratrain.training.tracking import Tracker
from paratrain.training.user_data import load_user_data

__all__ = ["evaluate", "train"]


def evaluate(par: Parallel, model: nn.Module, data: TensorData, batch_size: int = 1024) -> float:
    """Accuracy on ``data``; each process scores its own share, and the counts are summed across processes."""
    was_training = model.training
    model.eval()
    device = par.device
    indices = par.shard(torch.arange(len(data)))
    correct = torch.zeros((), dtype=torch.int64, device=device)
    # every process runs as many forwards (zero3's gather the weights, a collective): chunks of its share, as many
    # as the largest share needs
    largest = -(-len(data) // par.world_size)
    with torch.no_grad():
        for chunk in indices.tensor_split(max(1, -(-largest // batch_size))):
            x = data.inputs[chunk].to(device, non_blocking=True)
            y = data.targets[chunk].to(device, non_blocking=True)
            correct += (model(x).argmax(dim=1) == y).sum()
    counts = par.all_reduce(torch.stack([correct, torch.tensor(indices.numel(), device=device)]), "sum")
    model.train(was_training)
    total = int(counts[1])
    return float(counts[0]) / total if total else 0.0


def train(
    config: TrainConfig, *, log: Callable[[str], None] | None = None, launcher: LaunchConfig | None = None
) -> TrainResult:
    """Run the training job described by ``config``; see the module docstring for examples.

    ``log`` receives every line the main process would print (default: stdout). ``launcher``: the settings that
    started this run's processes, when ``paratrain train`` launched them (recorded with the run, so that its
    saved settings start as many processes again). The run computes with the CPU
    threads :func:`~paratrain.training.threads.choose_threads` picks (torch's setting is restored afterwards).

    Raises:
        ConfigError: settings no run can use, a checkpoint directory holding another run's checkpoints, or a
            model that does not take the data; before the first step.
        TrainingInterrupted: Ctrl-C stopped the run after a step (its checkpoint saved with --checkpoint-dir).
    """
    config.check()
    environment = ClusterEnvironment.detect()
    strategy = resolve_strategy(config.strategy, config.devices, environment)
    devices = resolve_devices(config.devices) if strategy == "dp" else []
    threads = choose_threads(strategy, devices, launched=environment.launched)
    with (
        using_threads(threads),
        Parallel(
            config.strategy,
            config.devices,
            timeout=config.timeout,
            precision=config.precision,
            hang_report=config.hang_report_path(),
            find_unused_parameters=config.find_unused_parameters,
            static_graph=config.static_graph,
            bucket_cap_mb=config.bucket_cap_mb,
        ) as par,
    ):
        return _Run(config, par, log, launcher).run()


class _Run:
    """One training run: set-up, the epochs, checkpoints, and the result."""

    def __init__(
        self, config: TrainConfig, par: Parallel, log: Callable[[str], None] | None, launcher: LaunchConfig | None
    ) -> None:
        self.config = config
        self.launcher = launcher
        self.par = par
        self.wall_start = time.perf_counter()
        self.load_at_start = MachineLoad.now()
        self.progress = Progress(
            enabled=par.is_main,
            bar=False if config.quiet else config.progress_bar,
            log=log,
            stderr=config.metrics_out is not None and is_stdout(config.metrics_out),  # keep the JSON parseable
        )
        self.checkpoints = Path(config.checkpoint_dir) if config.checkpoint_dir else None
        if par.is_main:  # the main process writes every output: each is checked before the first step
            config.check_outputs()
            if self.checkpoints is not None:
                check_writable(self.checkpoints)
                remove_stale_temporaries(self.checkpoints)  # left by writers killed mid-write
        self.recovery = ProgressLog(self.checkpoints, enabled=par.is_main, run_id=par.environment.run_id)
        # a restart after a failure, or the group re-formed (a node joined or left) while this launch's run was
        # unfinished; the main process keeps the record, so its answer holds in every process
        restarted = par.environment.restart_count > 0
        continuing = torch.tensor([int(restarted or self.recovery.interrupted())], dtype=torch.int64)
        self.continuing = bool(par.broadcast(continuing)[0])
        self.start = plan_start(config, self.checkpoints, self.continuing)
        self.resume_path = self.start.path
        shape = parse_input_shape(config.input_shape) if config.input_shape is not None else None
        if config.data is not None:
            self.splits = load_user_data(config.data)
        else:
            self.splits = load_dataset(
                config.dataset_name,
                config.data_dir,
                verify=config.verify_data,
                input_shape=shape,
                num_classes=config.num_classes,
                seed=config.seed,
            )
        seed_everything(config.seed)  # the same initial weights in every process and every strategy
        from_file = config.init_from if self.resume_path is None else None
        start = initial_model(
            lambda: build_model_spec(
                config.model, self.splits.input_shape, self.splits.num_classes, width=config.width, depth=config.depth
            ),
            from_file,
            par.strategy_name,
            self.splits.train.inputs[:2],
            input_shape=self.splits.input_shape,
            spec=config.model,
        )
        model = start.model
        if start.said is not None:
            self.say(start.said)
        elif config.init_from is not None and from_file is None:  # the checkpoint's weights replace any: not read
            self.say(f"Not reading --init-from {config.init_from}: the run continues its checkpoint {self.resume_path}")
        # the optimizer's parameters by name, in the order of its indices (it is built over model.parameters()):
        # recorded in every checkpoint, so an export keys the optimizer's state by name (checkpoint export)
        self.parameter_names = [name for name, _ in model.named_parameters()]
        optimizer = build_optimizer(
            model.parameters(),
            config.optimizer,
            lr=config.lr,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
            betas=config.betas,
        )
        loader = DeviceLoader(self.splits.train, config.batch_size, shuffle=True, seed=config.seed)
        # prepared before anything is restored into them: under zero1/zero2 the optimizer becomes one over this
        # process's shard, which the schedule must drive and which reads only its slices of a checkpoint
        self.model, self.optimizer, self.loader = par.prepare(model, optimizer, loader)
        if start.weights is not None:  # zero3: each process copies its shards from the file, a tensor at a time
            self.say(start.fill(par, self.model) or "")
        optimizer = self.optimizer
        # built before a resume restores the optimizer: building a schedule sets the learning rate
        self.scheduler = build_scheduler(
            optimizer, config.lr_schedule, warmup_steps=config.warmup_steps, total_steps=config.epochs * len(loader)
        )
        self.pos = Position()
        self.record = RunRecord(config.epochs, config.metrics_out)
        if self.resume_path is not None:
            self.pos, self.record = restore(self.resume_path, config, par, self.model, optimizer, self.scheduler)
            # settings a resumed run may change (learning rate, momentum, weight decay, betas) take effect: the
            # checkpoint's optimizer state brought back the old ones
            apply_settings(
                optimizer,
                self.scheduler,
                config.optimizer,
                lr=config.lr,
                momentum=config.momentum,
                weight_decay=config.weight_decay,
                betas=config.betas,
            )
            again = " after a restart" if self.continuing else ""
            if not self.start.complete:
                self.say(f"Resuming{again} from {self.resume_path} (epoch {self.pos.epoch}, batch {self.pos.batch})")
        self.recovery.start(self.pos.global_step, continuing=self.continuing)
        # where this invocation started, as the main process (which keeps the record) knows it: every rank must
        # stop at the same step
        started = torch.tensor([self.recovery.run_started_at], dtype=torch.int64)
        self.run_started_at = int(par.broadcast(started)[0])
        self.timer = StepTimer(par.device)
        self.stepper = Stepper(
            par,
            self.model,
            self.optimizer,
            self.scheduler,
            accumulate=config.accumulate,
            clip_grad_norm=config.clip_grad_norm,
            timer=self.timer,
        )
        self.step_meter = self._step_meter(self.model)
        self.logged_steps: list[dict[str, Any]] = []  # the log line's values, for the metrics file
        self.tracker = None
        if config.log_dir is not None:  # every process takes part in the logged values; the main one writes
            # the rows of every step the checkpoint covers (step indices 0 .. global_step - 1) are kept
            resumed_at = self.pos.global_step - 1 if self.resume_path is not None else None
            run_log = None
            if par.is_main:
                tensorboard, plot = config.writes_tensorboard, config.plot
                run_log = RunLog(config.log_dir, tensorboard=tensorboard, plot=plot, resume_step=resumed_at)
                note = run_log.missing_note()
                if note is not None:  # metrics.csv is written all the same; said once, by the main process
                    print(f"paratrain train: note: {note}", file=sys.stderr, flush=True)
            trackers = []
            if par.is_main and config.trackers:
                trackers = open_trackers(config.trackers, config.log_dir, config=config.to_dict(), name=config.log_dir)
            self.tracker = Tracker(par, run_log, trackers)
        self.steps = self.samples = 0
        self.eval_seconds = self.checkpoint_seconds = 0.0
        self.epoch_losses: list[float] = []
        self.epoch_accuracy: list[float] = []
        self.stop: StopRequest | None = None
        self.interrupted = False
        self.loop_start = 0.0
        self.invocation: Invocation | None = None

    def _model_state(self) -> Iterable[tuple[str, Any]]:
        """The trained model's state dict items; under zero3 gathered one unit at a time, never the whole model."""
        strategy = self.par.strategy
        if isinstance(strategy, Zero3Strategy):
            return strategy.wrapper_of(self.model, "the model's fingerprint").full_state_items()
        return self.par.unwrap(self.model).state_dict().items()

    def say(self, line: str) -> None:
        if not self.config.quiet:
            self.progress.write(line)

    def run(self) -> TrainResult:
        config, splits, par = self.config, self.splits, self.par
        if self.start.complete:  # nothing to train: say where the finished run's results are
            self.say(self.start.complete_message())
            if self.tracker is not None:
                self.tracker.close()
            return self._result(0.0)
        per_process = ""
        if par.world_size > 1:
            low, high = config.batch_size // par.world_size, -(-config.batch_size // par.world_size)
            per_process = f" ({low}{f' or {high}' if high != low else ''} per process)"
        idle = idle_processes(config.batch_size, par.world_size)
        if idle is not None and par.is_main:  # it trains correctly, but the idle processes only cost
            print(
                f"paratrain train: warning: {idle}: give --batch-size {par.world_size} or more, or start at most "
                f"{config.batch_size} processes",
                file=sys.stderr,
                flush=True,
            )
        epochs = f"{config.epochs} epoch{'s' * (config.epochs != 1)}"
        self.say(
            f"Training {config.model} on {config.dataset_name} ({len(splits.train)} train / {len(splits.test)} test) "
            f"with {par.describe()}, global batch {config.batch_size}{per_process}, {epochs}"
        )
        self._write_run_record()
        self.loop_start = time.perf_counter()
        try:
            with StopRequest(par) as self.stop:
                for epoch in range(self.pos.epoch, config.epochs):
                    # a restart after the last step (a worker killed while the run was ending) trains no further
                    if self._reached_max_steps() or not self._epoch(epoch):
                        break
            if self.interrupted:
                pos = self.pos
                self.progress.write(interrupted_message(pos.global_step, pos.epoch, pos.batch, self.checkpoints))
                raise TrainingInterrupted
            loop_seconds = max(time.perf_counter() - self.loop_start, 1e-9)
            self.recovery.finish(self.pos.global_step)
            result = self._result(loop_seconds)
        finally:
            if self.tracker is not None:
                self.tracker.close()
        if self.par.is_main:
            if config.metrics_out:
                write_metrics(result, config.metrics_out)
            finished = self.pos.epoch >= config.epochs
            where = "Done: " if finished else f"Stopped at epoch {self.pos.epoch}, batch {self.pos.batch}: "
            self.progress.write(where + result.summary())
        return result

    def _step_meter(self, model: nn.Module) -> StepMeter:
        """The log line's meter, with one count of a step's FLOPs (main process: the one that prints)."""
        device_count = len(self.par.world_devices())  # a collective under ddp: every process asks
        # zero3's forward gathers the weights (a collective): every process then runs the counted forward
        if not self.par.is_main and self.par.strategy_name != "zero3":
            return StepMeter(self.par.device, None, None)
        config, data = self.config, self.splits.train
        # FLOPs grow with the batch: count one process's share (or less) and scale to the global batch
        share = min(-(-config.batch_size // self.par.world_size), len(data))
        counted = step_flops(self.par.unwrap(model), data.inputs[:share].to(self.par.device))
        if not self.par.is_main:
            return StepMeter(self.par.device, None, None)
        flops = counted * config.batch_size / share if counted else None
        peak = peak_flops(self.par.device, config.precision)
        return StepMeter(self.par.device, flops, peak * device_count if peak is not None else None)

    def _write_run_record(self) -> None:
        """This invocation's settings and environment, beside the run's logs and checkpoints (main process)."""
        resumed = str(self.resume_path) if self.resume_path is not None else None
        self.invocation = Invocation.now(
            self.config, self.par, resumed_from=resumed, start_step=self.pos.global_step, launcher=self.launcher
        )
        if self.par.is_main:
            for directory in dict.fromkeys((self.config.log_dir, self.config.checkpoint_dir)):
                if directory is not None:
                    self.invocation.write(directory)

    def _epoch(self, epoch: int) -> bool:
        """Train one epoch (from ``pos.batch`` on); False when ``max_steps`` stopped the run."""
        config, par, pos, loader = self.config, self.par, self.pos, self.loader
        loader.set_epoch(epoch)
        loader.skip(pos.batch)
        self.progress.start_epoch(epoch, config.epochs, len(loader), pos.batch)
        # the epoch's loss so far, summed over this process's samples; read back only when needed (a GPU sync).
        # A resumed position holds every process's sum so far: only one process carries it on, or the sum over
        # processes would count it once per process
        carried = par.is_main
        meter = LossMeter(par.device, pos.loss_sum if carried else 0.0, pos.loss_count if carried else 0)
        reached = False
        for i, batch in enumerate(self.timer.data(loader), start=pos.batch):
            logged = i % config.log_every == 0
            step = self.stepper(batch, measure_grad_norm=logged)
            meter.add(step.loss, step.samples)
            global_batch = loader.share.total
            self.samples += global_batch
            self.steps += 1
            self.step_meter.add(global_batch)
            pos.global_step += 1
            self.recovery.step(pos.global_step)
            shown = self._logged_loss(step) if logged and not config.quiet else None
            self.progress.step(i, global_batch, step.loss if par.world_size == 1 else shown)
            if self.tracker is not None:
                self.tracker.add(step)
            if logged:
                self.timer.flush()  # on a GPU: read the step timer's events (the loss above synchronised anyway)
                entry = self.step_meter.log(
                    step=pos.global_step - 1,  # the index of the step just done: epoch 0's equals Step below
                    epoch=epoch,
                    batch=i,
                    loss=shown,
                    lr=step.lr,
                    grad_norm=float(step.grad_norm) if step.grad_norm is not None else None,
                    seconds=self.timer.elapsed,
                )
                if shown is not None:
                    self.say(entry.line())
                self.logged_steps.append({"step": entry.step, "epoch": epoch, "loss": shown, **entry.values()})
                if self.tracker is not None:
                    self.tracker.log_step(
                        step=entry.step, epoch=epoch, skipped_steps=par.precision.skipped_steps, values=entry.values()
                    )
            reached = self._reached_max_steps()
            assert self.stop is not None
            self.interrupted = self.interrupted or self.stop.due(pos.global_step, self.loop_start, self.steps)
            halt = reached or self.interrupted
            if i + 1 == len(loader):
                break  # the end-of-epoch checkpoint below covers this point
            periodic = bool(config.checkpoint_every) and pos.global_step % config.checkpoint_every == 0
            if halt or (self.checkpoints is not None and periodic):
                pos.epoch, pos.batch = epoch, i + 1
                pos.loss_sum, pos.loss_count = _reduced_loss(par, *meter.totals())
                self._save()
            if halt:
                self.timer.stop()
                self.progress.end_epoch()
                return False
        self.timer.stop()
        self.progress.end_epoch()
        total, count = _reduced_loss(par, *meter.totals())
        self.epoch_losses.append(total / max(count, 1))
        if not math.isfinite(self.epoch_losses[-1]):
            raise TrainingError(
                f"the training loss became {self.epoch_losses[-1]} in epoch {epoch}: the run diverged (a learning "
                f"rate of {config.lr:g} may be too high; --clip-grad-norm or --precision 32 can help). Stopping "
                f"instead of training on to a meaningless model"
            )
        self.epoch_accuracy.append(self._evaluate())
        self.record.epoch_losses.append(self.epoch_losses[-1])
        self.record.epoch_test_accuracy.append(self.epoch_accuracy[-1])
        self.pos = Position(epoch + 1, 0, pos.global_step)
        self.say(
            f"Epoch {epoch} done: train loss {self.epoch_losses[-1]:.4f}, test accuracy {self.epoch_accuracy[-1]:.2%}"
        )
        if self.tracker is not None:
            self.tracker.log_epoch(
                step=pos.global_step - 1,  # the index of the epoch's last step
                epoch=epoch,
                train_loss=self.epoch_losses[-1],
                test_accuracy=self.epoch_accuracy[-1],
            )
        self._save()
        return not (reached or self.interrupted)

    def _logged_loss(self, step: StepOutcome) -> float:
        """The step's loss over the whole global batch: every process's samples (one small all-reduce under ddp,
        only at logged steps); in one process the loss the step computed."""
        if self.par.world_size == 1:
            return float(step.loss.item())
        count = torch.tensor(float(step.samples), dtype=torch.float64, device=step.loss_sum.device)
        total, samples = self.par.all_reduce(torch.stack([step.loss_sum, count]), "sum").tolist()
        return total / samples if samples else float("nan")

    def _reached_max_steps(self) -> bool:
        # counted from where this invocation started, so a restarted attempt stops where the first would have
        limit = self.config.max_steps
        return limit is not None and self.pos.global_step - self.run_started_at >= limit

    def _evaluate(self) -> float:
        started = time.perf_counter()
        try:
            return evaluate(self.par, self.model, self.splits.test, self.config.eval_batch_size)
        finally:
            self.eval_seconds += time.perf_counter() - started

    def _save(self) -> None:
        if self.checkpoints is not None:
            started = time.perf_counter()
            extra = {
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "precision": self.par.precision.state_dict(),
                "parameter_names": self.parameter_names,
            }
            save(self.par, self.checkpoints, self.config, self.model, self.optimizer, self.pos, self.record, extra)
            self.checkpoint_seconds += time.perf_counter() - started

    def _result(self, loop_seconds: float) -> TrainResult:
        config, par, pos = self.config, self.par, self.pos
        history = self.record  # every epoch since the run began, this invocation's included
        # the training steps alone: the loop less evaluation and checkpoint writes, which have their own figures
        train_seconds = max(loop_seconds - self.eval_seconds - self.checkpoint_seconds, 1e-9)
        if self.epoch_losses:
            train_loss = self.epoch_losses[-1]
        elif pos.loss_count:  # stopped inside the first epoch of this invocation: the partial epoch's mean
            train_loss = pos.loss_sum / pos.loss_count
        else:  # nothing trained here (the run was complete): its last epoch's
            train_loss = history.epoch_losses[-1] if history.epoch_losses else float("nan")
        if history.epoch_test_accuracy and pos.batch == 0:  # at an epoch's end, which was evaluated
            test_accuracy = history.epoch_test_accuracy[-1]
        else:
            test_accuracy = self._evaluate()
        load = MachineLoad.busiest(self.load_at_start, MachineLoad.now())
        return TrainResult(
            test_accuracy=test_accuracy,
            train_loss=train_loss,
            epochs=config.epochs,
            samples_per_second=self.samples / train_seconds if self.samples else 0.0,
            wall_seconds=time.perf_counter() - self.wall_start,
            strategy=par.strategy_name,
            devices=par.world_devices(),
            seed=config.seed,
            model_fingerprint=fingerprint(self._model_state()),
            model=config.model,
            dataset=config.dataset_name,
            batch_size=config.batch_size,
            lr=config.lr,
            world_size=par.world_size,
            steps=self.steps,
            samples=self.samples,
            resumed_from=str(self.resume_path) if self.resume_path is not None else None,
            restarts=len(self.recovery.recoveries),
            steps_redone=sum(r.steps_redone for r in self.recovery.recoveries),
            recovery_seconds=sum(r.recovery_seconds for r in self.recovery.recoveries),
            recoveries=[asdict(r) for r in self.recovery.recoveries],
            epoch_losses=list(history.epoch_losses),  # every epoch of the run, those before a resume included
            epoch_test_accuracy=list(history.epoch_test_accuracy),
            precision=par.precision.name,
            accumulate=config.accumulate,
            optimizer=config.optimizer,
            optimizer_settings=optimizer_settings(self.optimizer),
            lr_schedule=config.lr_schedule,
            warmup_steps=config.warmup_steps,
            clip_grad_norm=config.clip_grad_norm,
            skipped_steps=par.precision.skipped_steps,
            train_seconds=train_seconds,
            eval_seconds=self.eval_seconds,
            checkpoint_seconds=self.checkpoint_seconds,
            time_breakdown=time_breakdown(par, self.timer),
            peak_memory_mib=peak_memory_of_ranks(par),
            threads=torch.get_num_threads(),
            cores=load.cores,
            load_average=load.load_average,
            config=self.config.to_dict(),
            environment=self.invocation.environment if self.invocation is not None else environment(par),
            start_step=self.invocation.start_step if self.invocation is not None else pos.global_step,
            step_flops=self.step_meter.step_flops,
            logged_steps=self.logged_steps,
        )


def _reduced_loss(par: Parallel, loss_sum: torch.Tensor, count: int) -> tuple[float, int]:
    both = par.all_reduce(
        torch.stack([loss_sum, torch.tensor(float(count), dtype=torch.float64, device=loss_sum.device)]), "sum"
    )
    return float(both[0]), int(both[1])
