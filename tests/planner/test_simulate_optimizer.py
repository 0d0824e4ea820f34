"""The optimizer step in the simulator (Profile.optimizer), on the hand-built plan of
_sim_fixtures: enc's group (ranks 0, 1) synchronizes 1 GB of bf16 gradients (5e8 parameters)
and ends at 65 ms, head's (ranks 2, 3) 0.5 GB (2.5e8) at 32 ms."""

from __future__ import annotations

import dataclasses

import _sim_fixtures as fx
import pytest

from spindle_cli.artifacts.profile import OptimizerCost
from spindle_cli.planner.simulate import simulate

COST = OptimizerCost(ms_per_tensor=1.0, ms_per_million_params=0.01)


def run(plan=None, cost: OptimizerCost | None = COST):
    profile = dataclasses.replace(fx.profile(), optimizer=cost)
    return simulate(plan or fx.plan(), fx.graph(), profile, fx.cluster(), sync="per-wave")


def test_each_rank_steps_after_its_own_groups_sync():
    r = run()
    # ranks 0, 1: 1 tensor + 500 M parameters = 6 ms after 65 ms; ranks 2, 3: 3.5 ms after 32
    assert r.iteration_ms == pytest.approx(71.0)
    assert r.sync_ms == pytest.approx(10.0)
    assert r.optimizer_ms == pytest.approx(6.0)
    assert r.compute_ms + r.transfer_ms + r.sync_ms + r.optimizer_ms == pytest.approx(71.0)


def test_zero_shards_the_parameters_a_rank_steps():
    plan = dataclasses.replace(fx.plan(), options={**fx.plan().options, "zero": "1"})
    # 250 M of enc's parameters per rank: 1 + 2.5 ms
    assert run(plan).iteration_ms == pytest.approx(68.5)


def test_a_rank_steps_one_tensor_per_rank_set():
    # enc and head on the same two ranks: two groups, one bucket (one tensor), 750 M parameters
    plan = fx.plan(enc_ranks=(0, 1), head_ranks=(0, 1))
    base = run(plan, None)
    assert run(plan).iteration_ms == pytest.approx(base.iteration_ms + 1.0 + 7.5)


def test_no_cost_without_a_profiled_optimizer():
    r = run(cost=None)
    assert r.optimizer_ms == 0.0 and r.iteration_ms == pytest.approx(65.0)
