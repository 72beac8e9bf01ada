"""torchrun's variables are read in one module, into one frozen object."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import paratrain
from paratrain.environment import ClusterEnvironment, launched_by_torchrun
from paratrain.errors import ConfigError

PACKAGE = Path(paratrain.__file__).parent
VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
)  # fmt: skip
LAUNCHED = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip


def test_a_launched_worker_sees_where_it_sits():
    env = ClusterEnvironment.detect({**LAUNCHED, "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job"})
    assert env == ClusterEnvironment(
        launched=True, rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
        master_addr="10.0.0.1", master_port=29500, restart_count=2, run_id="job", agent_store=False,
    )  # fmt: skip
    assert launched_by_torchrun(LAUNCHED) and not launched_by_torchrun({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 0  # type: ignore[misc]


def test_without_a_launcher_it_is_rank_0_of_1_and_keeps_the_elastic_ids():
    env = ClusterEnvironment.detect({"TORCHELASTIC_RUN_ID": "job-1", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert not env.launched and (env.rank, env.world_size) == (0, 1)
    assert env.run_id == "job-1" and env.restart_count == 1


@pytest.mark.parametrize(
    "override, message", [({"RANK": "x"}, "RANK='x' is not an integer"), ({"RANK": "4"}, "outside WORLD_SIZE=4")]
)
def test_broken_variables_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        ClusterEnvironment.detect({**LAUNCHED, **override})


def test_the_variables_are_read_in_one_module_only():
    """No other module of paratrain names torchrun's variables: they all receive the environment object."""
    names = re.compile(r"[\"'](" + "|".join(VARIABLES) + r")[\"']")
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "environment.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if names.search(line)
    ]
    assert found == [], found
    assert len(names.findall((PACKAGE / "environment.py").read_text())) >= len(VARIABLES)  # the test can see reads
