"""Checkpoint/resume and failures inside the run, on gloo ranks through the harness."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import RanksFailed, run_distributed

from plans import hand_plan
from spindle_cli.artifacts import MetaOpGraph, ModelSpec, Plan, load
from spindle_cli.planner.graph import build_graph

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]


def train_rank(rank: int, world: int, plan: Plan, graph: MetaOpGraph, model: ModelSpec,
               opts_kwargs: dict[str, Any]) -> tuple[int, list[dict[str, float]], dict]:
    import torch as t

    from spindle_cli.runtime.dist import World
    from spindle_cli.runtime.options import TrainOptions
    from spindle_cli.runtime.program import build_program
    from spindle_cli.runtime.training import train

    w = World(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
              backend="gloo", device=t.device("cpu"))
    result = train(plan, graph, model, build_program(plan, graph, model), w,
                   TrainOptions(**{"seed": 3, "lr": 1e-2, **opts_kwargs}))
    return result.start_step, result.losses, result.params


@pytest.fixture(scope="module")
def setup() -> tuple[Plan, MetaOpGraph, ModelSpec]:
    model = load(str(REPO / "models" / "tiny-clip.yaml"), ModelSpec)
    graph = build_graph(model, dtype="fp32")
    place = {m.id: [(0, m.num_layers, ((0,), (1,), (0, 1))[i % 3])]
             for i, m in enumerate(graph.metaops)}
    return hand_plan(graph, place, 2), graph, model


def _holders(plan: Plan, graph: MetaOpGraph, name: str) -> tuple[int, ...]:
    """The ranks that run the layer of parameter `module.layer.param`."""
    module, layer = name.split(".")[:2]
    return tuple(sorted({r for w in plan.waves for s in w.slices
                         for m in [graph.metaop(s.metaop)]
                         if m.module == module
                         and m.first_layer + s.first <= int(layer) < m.first_layer + s.last
                         for r in s.ranks}))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("zero", "dtype"), [("0", "fp32"), ("1", "fp32"), ("2", "fp32"),
                                             ("1", "bf16")])
def test_resumed_run_ends_with_the_same_parameters(setup: Any, tmp_path: Path, zero: str,
                                                   dtype: str) -> None:
    """Also in bf16, whose checkpoint keeps the fp32 masters AdamW steps (the bf16 weights
    alone would resume from rounded values)."""
    plan, graph, model = setup
    # under ZeRO-1/2 each rank's checkpoint holds the optimizer state of its shards only
    plan = replace(plan, options={**plan.options, "zero": zero})
    straight = run_distributed(train_rank, 2, plan, graph, model, {"steps": 4, "dtype": dtype})
    ckpt = str(tmp_path / "ckpt")
    first = run_distributed(train_rank, 2, plan, graph, model,
                            {"steps": 2, "checkpoint_dir": ckpt, "checkpoint_every": 1,
                             "dtype": dtype})
    assert sorted(p.name for p in Path(ckpt).iterdir()) == ["step-000001", "step-000002"]
    for rank in range(2):
        saved = torch.load(Path(ckpt) / "step-000002" / f"rank-{rank:05d}.pt")
        held = sum(v.numel() for v in saved["params"].values())
        moments = sum(st["exp_avg"].numel() for st in saved["optimizer"]["state"].values())
        # the layers on ranks (0, 1) are sharded in two under ZeRO-1/2 (each shard padded to
        # at most one element more)
        shared = sum(p.numel() for n, p in saved["params"].items()
                     if _holders(plan, graph, n) == (0, 1))
        assert shared > 0
        if zero != "0":
            assert held - shared + shared / 2 <= moments <= held - shared + shared / 2 + 1
        else:
            assert moments == held
        masters = saved["masters"]
        assert sum(m.numel() for m in masters) == (moments if dtype == "bf16" else 0)
        assert all(m.dtype == torch.float32 for m in masters)
    resumed = run_distributed(train_rank, 2, plan, graph, model,
                              {"steps": 4, "checkpoint_dir": ckpt, "resume": True,
                               "dtype": dtype})
    for rank in range(2):
        start, losses, params = resumed[rank]
        assert start == 2
        # the data position is restored too: steps 3 and 4 see the same batches
        assert first[rank][1] + losses == straight[rank][1]
        assert params.keys() == straight[rank][2].keys()
        for name, value in params.items():
            assert torch.equal(value, straight[rank][2][name]), name


@pytest.mark.timeout(120)
def test_a_run_keeps_its_newest_checkpoints_and_resumes_from_them(setup: Any,
                                                                  tmp_path: Path) -> None:
    """--keep-checkpoints 2 with a checkpoint every step: after 4 steps steps 3 and 4 are
    left, and a resumed run goes on from step 4 and keeps steps 5 and 6. Its --metrics file
    keeps the lines of steps 1-4 and drops those written after the checkpoint it resumes
    from (a crash's step 5 and a line cut short), so it holds each step once."""
    plan, graph, model = setup
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    options = {"checkpoint_dir": str(ckpt), "checkpoint_every": 1, "keep_checkpoints": 2,
               "metrics_path": str(metrics)}
    first = run_distributed(train_rank, 2, plan, graph, model, {"steps": 4, **options})
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000003", "step-000004"]
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 5, "steps": 8, "loss": 1.0}) + '\n{"step": 6, "lo')
    resumed = run_distributed(train_rank, 2, plan, graph, model,
                              {"steps": 6, "resume": True, **options})
    assert [start for start, _, _ in resumed] == [4, 4]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000005", "step-000006"]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r["steps"]) for r in lines] == [(s, 4) for s in range(1, 5)] + [
        (5, 6), (6, 6)]
    assert [r["losses"] for r in lines] == first[0][1] + resumed[0][1]
    assert all(r["loss"] == sum(r["losses"].values()) and r["step_ms"] > 0 for r in lines)


@pytest.mark.timeout(120)
def test_a_resumed_run_trains_at_its_own_learning_rate(setup: Any, tmp_path: Path) -> None:
    """--lr is not part of a checkpoint's configuration: a run resumed with another learning
    rate steps at that one. AdamW's update from a given state is linear in the learning rate
    (weight decay included), so step 3 at lr 1e-3 moves every parameter a tenth as far as
    step 3 at the checkpoint's 1e-2."""
    plan, graph, model = setup
    ckpt = tmp_path / "ckpt"
    first = run_distributed(train_rank, 2, plan, graph, model,
                            {"steps": 2, "checkpoint_dir": str(ckpt), "dtype": "fp64"})
    # each resumed run saves its step 3 into a copy of the checkpoints
    resumed = []
    for lr, copy in ((1e-2, tmp_path / "same"), (1e-3, tmp_path / "lower")):
        shutil.copytree(ckpt, copy)
        resumed.append(run_distributed(train_rank, 2, plan, graph, model,
                                       {"steps": 3, "checkpoint_dir": str(copy),
                                        "resume": True, "dtype": "fp64", "lr": lr}))
    same, lower = resumed
    for rank in range(2):
        before, at_same, at_lower = first[rank][2], same[rank][2], lower[rank][2]
        for name, value in before.items():
            torch.testing.assert_close(at_lower[name] - value, (at_same[name] - value) / 10,
                                       rtol=1e-6, atol=1e-12, msg=name)


@pytest.mark.timeout(120)
def test_resume_refuses_a_checkpoint_of_another_run(setup: Any, tmp_path: Path) -> None:
    plan, graph, model = setup
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train_rank, 2, plan, graph, model,
                    {"steps": 1, "checkpoint_dir": ckpt, "checkpoint_every": 1})
    with pytest.raises(RanksFailed) as info:
        run_distributed(train_rank, 2, plan, graph, model,
                        {"steps": 2, "checkpoint_dir": ckpt, "resume": True, "dtype": "fp64"})
    assert set(info.value.errors) == {0, 1}
    assert all("dtype='fp32'" in m for m in info.value.errors.values())


@pytest.mark.timeout(120)
def test_resume_refuses_a_directory_whose_checkpoints_are_all_incomplete(
        setup: Any, tmp_path: Path) -> None:
    """A worker started by a plain torchrun makes the check `spindle run` makes before launch:
    when a rank's file is missing from every checkpoint (a directory not shared by all nodes),
    the run fails naming it instead of training from step 0 over the checkpoints."""
    plan, graph, model = setup
    ckpt = tmp_path / "ckpt"
    run_distributed(train_rank, 2, plan, graph, model,
                    {"steps": 1, "checkpoint_dir": str(ckpt)})
    (ckpt / "step-000001" / "rank-00001.pt").unlink()
    with pytest.raises(RanksFailed) as info:
        run_distributed(train_rank, 2, plan, graph, model,
                        {"steps": 2, "checkpoint_dir": str(ckpt), "resume": True})
    assert set(info.value.errors) == {0, 1}
    assert all("checkpoint lacks rank-00001.pt" in m for m in info.value.errors.values())
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000001"]


def narrow_data_rank(rank: int, world: int, plan: Plan, graph: MetaOpGraph,
                     model: ModelSpec) -> None:
    import os

    os.environ["RANK"] = str(rank)
    train_rank(rank, world, plan, graph, model,
               {"steps": 2, "dataset": "faulty_data:narrow_features_on_rank_zero"})


@pytest.mark.timeout(120)
def test_shape_mismatch_fails_every_rank_naming_the_cause(setup: Any) -> None:
    plan, graph, model = setup
    with pytest.raises(RanksFailed) as info:
        run_distributed(narrow_data_rank, 2, plan, graph, model, pg_timeout_s=10)
    errors = info.value.errors
    assert set(errors) == {0, 1}
    assert "ShapeMismatch" in errors[0] and "expected float features" in errors[0]
    # the first step, numbered as the loss lines number it, and the rows() call that failed
    assert "at step 1 (rows(" in errors[0] and ", 0, 0, " in errors[0], errors[0]
    # rank 1 fails because rank 0 left, well before the harness deadline
    peer_lost = ("Connection closed", "Connection reset", "Broken pipe", "Timed out")
    assert any(s in errors[1] for s in peer_lost), errors[1]


def _check_shared_in(rank: int, world: int, dirs: list[str]) -> None:
    from spindle_cli.runtime import checkpoint

    checkpoint.check_shared(dirs[rank], rank=rank, world_size=world)


def _save_in(rank: int, world: int, dirs: list[str]) -> None:
    from spindle_cli.runtime import checkpoint

    checkpoint.save(dirs[rank], 1, rank=rank, world_size=world, state={"step": 1}, meta={})


@pytest.mark.timeout(120)
def test_a_checkpoint_directory_not_shared_by_every_rank_is_refused(tmp_path: Path) -> None:
    """Node-local directories let a run finish with exit code 0 and checkpoints none of which
    would load (rank 1's file was in the other directory), found only at --resume: the run
    checks before its first step, and rank 0 before it commits a checkpoint."""
    shared = str(tmp_path / "shared")
    run_distributed(_check_shared_in, 2, [shared, shared])
    assert list(Path(shared).iterdir()) == []  # no probe left behind
    apart = [str(tmp_path / "a"), str(tmp_path / "b")]
    # rank 1's probe, as a killed run left it where the directory was shared: not this run's
    Path(apart[0]).mkdir()
    (Path(apart[0]) / ".probe-rank-00001").write_text("1\n")
    with pytest.raises(RanksFailed) as e:
        run_distributed(_check_shared_in, 2, apart, pg_timeout_s=5)
    assert (f"SpindleError: --checkpoint-dir {apart[0]}: rank 0 does not see the files rank(s) "
            "1 wrote there: the directory is not shared by every node") in e.value.errors[0]
    # rank 1 lost rank 0 in the check, and says so (gloo's own line, 'GLHF!', was the error)
    assert "PeerLost: lost contact with rank(s) 0 in the check of --checkpoint-dir" in \
        e.value.errors[1]
    assert [list(Path(d).iterdir()) for d in apart] == [[], []]
    with pytest.raises(RanksFailed) as e:
        run_distributed(_save_in, 2, apart, pg_timeout_s=5)
    assert "after every rank wrote its file, the checkpoint lacks rank-00001.pt" in \
        e.value.errors[0]
    assert not list(Path(apart[0]).glob("step-*"))  # nothing committed


def _lose_rank_zero_before(rank: int, world: int, collective: str) -> None:
    """Rank 0 leaves; the others enter `collective` (a name in `train`'s run) without it."""
    import os
    import time

    import torch as t

    from spindle_cli.runtime.dist import World
    from spindle_cli.runtime.options import TrainOptions
    from spindle_cli.runtime.timings import gather_timings
    from spindle_cli.runtime.trace import Tracer
    from spindle_cli.runtime.training import check_finite_weights

    if rank == 0:
        time.sleep(0.5)
        os._exit(9)

    class Stepped:
        held: dict[str, int] = {}

        def finite(self) -> bool:
            return True

    w = World(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
              backend="gloo", device=t.device("cpu"))
    if collective == "finite":
        check_finite_weights(3, Stepped(), w, TrainOptions(steps=5))
    else:
        gather_timings(Tracer(enabled=False, rank=rank), [1.0], Stepped(), w)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("collective", "where"), [
    ("finite", "the check that the weights are finite"),
    ("timings", "the gather of the ranks' timings")])
def test_a_rank_lost_in_the_runs_own_collectives_is_named(collective: str, where: str) -> None:
    """The check before a checkpoint and the gather after the last step are collectives of
    every rank too: a peer lost there is a secondary failure naming the lost rank (gloo's own
    line, 'Connection reset by peer ... GLHF!', was put first as the cause of the run's end)."""
    with pytest.raises(RanksFailed) as e:
        run_distributed(_lose_rank_zero_before, 3, collective, pg_timeout_s=10)
    assert "exit code 9" in e.value.errors[0]
    for r in (1, 2):
        assert f"PeerLost: lost contact with rank(s) 0, {3 - r} in {where}" in e.value.errors[r]



def _steps_to_nan_on_rank_one(rank: int, world: int, plan: Plan, graph: MetaOpGraph,
                              model: ModelSpec, opts_kwargs: dict[str, Any]) -> None:
    """`train_rank`, with rank 1's optimizer step leaving a NaN in its first stepped value (a
    finite loss can come with a non-finite gradient)."""
    from spindle_cli.runtime.executor import Executor

    step = Executor._step

    def step_to_nan(self: Executor) -> None:
        step(self)
        if rank == 1:
            with torch.no_grad():
                (self.masters or self.stepped)[0].view(-1)[0] = float("nan")

    Executor._step = step_to_nan  # type: ignore[method-assign]
    train_rank(rank, world, plan, graph, model, opts_kwargs)


@pytest.mark.timeout(120)
def test_weights_a_step_left_non_finite_are_not_checkpointed(setup: Any, tmp_path: Path) -> None:
    """Step 1's loss is finite; the values rank 1 steps are not. Every rank stops before that
    step's checkpoint (the check's unit test called it directly: a mutation dropping the call
    from the training loop, or making every executor report finite weights, survived the
    suite); step 1 is never committed."""
    plan, graph, model = setup
    ckpt = tmp_path / "ckpt"
    with pytest.raises(RanksFailed) as info:
        run_distributed(_steps_to_nan_on_rank_one, 2, plan, graph, model,
                        {"steps": 2, "checkpoint_dir": str(ckpt), "checkpoint_every": 1})
    assert set(info.value.errors) == {0, 1}
    assert all("step 1/2: the weights are not finite after the step" in m
               for m in info.value.errors.values()), info.value.errors
    assert not list(ckpt.glob("step-*"))
