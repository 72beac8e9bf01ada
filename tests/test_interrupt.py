"""Ctrl-C in one process, with real signals: the first asks for a stop after the step in progress, the second
leaves now; the handler is the process's own again afterwards. (Every rank stopping after the same step under
ddp is driven with a real launcher in test_faults.py.)"""

from __future__ import annotations

import os
import signal
import time

import pytest

from paratrain import Parallel
from paratrain.training.interrupt import StopRequest, interrupted_message


def _signal_self() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # Python runs the handler at the next bytecode boundary


def test_the_first_ctrl_c_stops_after_this_step_and_the_second_leaves_now():
    previous = signal.getsignal(signal.SIGINT)
    with Parallel("single", "cpu") as par, StopRequest(par) as stop:
        started = time.perf_counter()
        assert not stop.due(7, started, 7)  # nothing asked: a flag read, no more
        _signal_self()
        assert stop.signalled and stop.due(8, started, 8) and stop.stop_after == 8  # one process: after this step
        with pytest.raises(KeyboardInterrupt):
            _signal_self()
    assert signal.getsignal(signal.SIGINT) is previous


def test_what_an_interrupted_run_says(tmp_path):
    (tmp_path / "epoch-0001-step-000007.pt").write_bytes(b"")  # the checkpoint the stop just wrote
    saved = interrupted_message(30, 1, 7, tmp_path)
    assert saved == (
        f"Interrupted: stopped after step 30 (epoch 1, batch 7) and saved {tmp_path}/epoch-0001-step-000007.pt; "
        "the same command with --resume continues from there"
    )
    assert "nothing was saved (no --checkpoint-dir)" in interrupted_message(30, 1, 7, None)


def test_an_interrupted_sharded_run_names_its_checkpoint_directory(tmp_path):
    """zero1/zero2 save a directory of every rank's slices: the message names it, not a .pt file beside it."""
    sharded = tmp_path / "epoch-0000-step-000364.pt"
    sharded.mkdir()
    (sharded / "index.pt").write_bytes(b"")
    assert f"and saved {sharded};" in interrupted_message(364, 0, 364, tmp_path)
