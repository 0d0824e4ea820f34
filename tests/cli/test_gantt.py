"""Plan pictures: text Gantt, Gantt chart and utilization plot on the hand-built plan (and the
utilization of the shipped plans)."""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import itertools
import os
import re
from pathlib import Path

import pytest

from spindle_cli.artifacts import Plan, load
from spindle_cli.cli.views.gantt import (
    busy_series,
    text_gantt,
    timeline,
    write_gantt,
    write_utilization,
)
from spindle_cli.errors import SpindleError
from spindle_cli.planner.simulate import simulate

PLANS = Path(__file__).resolve().parents[2] / "plans"

_spec = importlib.util.spec_from_file_location(
    "_sim_fixtures", Path(__file__).resolve().parents[1] / "planner" / "_sim_fixtures.py")
assert _spec is not None and _spec.loader is not None
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)


def sim():
    return simulate(fx.plan(), fx.graph(), fx.profile(), fx.cluster(), sync="per-wave")


def _rows(lines: list[str]) -> dict[str, str]:
    """Each rank's row ('r0': its buckets) of a text Gantt, whose rows stand for runs of
    ranks that do the same ('r0-1')."""
    rows = {}
    for line in lines:
        m = re.match(r"r(\d+)(?:-(\d+))? +(\S+)$", line)
        if m:
            first, last = int(m[1]), int(m[2] or m[1])
            rows.update({f"r{r}": m[3] for r in range(first, last + 1)})
    return rows


def test_ranks_that_do_the_same_share_a_row_and_the_width_fits_the_terminal(monkeypatch):
    # qwen-val-70b's 256 ranks printed 256 rows of 103 characters, wrapping at 80 columns
    from spindle_cli.cli._console import out

    plan = load(str(PLANS / "qwen-val-70b-a800-32x8.yaml"), Plan)
    lines = text_gantt(plan).splitlines()
    rows = _rows(lines)
    assert sorted(rows, key=lambda r: int(r[1:])) == [f"r{r}" for r in range(256)]
    labelled = [line for line in lines if re.match(r"r\d", line)]
    assert len(labelled) < 32
    # neighbouring rows differ: a row stands for every rank that does the same next to it
    assert all(a.split()[1] != b.split()[1] for a, b in itertools.pairwise(labelled))
    assert {len(line.split()[1]) for line in labelled} == {100}  # off a terminal
    monkeypatch.setattr(type(out), "is_terminal", property(lambda self: True))
    monkeypatch.setattr(type(out), "width", property(lambda self: 80))
    narrow = text_gantt(plan).splitlines()
    assert max(len(line) for line in narrow if not line.startswith("legend")) <= 80


def test_planned_text_gantt_scales_slices_to_their_time():
    # Wave 0: enc on ranks 0-1 for 12 ms; wave 1: head on ranks 2-3 for 3 ms; 15 ms in all.
    lines = text_gantt(fx.plan(), width=60).splitlines()
    rows = _rows(lines)
    assert rows["r0"] == "A" * 48 + "." * 12
    assert rows["r2"] == "." * 48 + "B" * 12
    assert lines[-1] == "legend: A=enc, B=head"
    # wave boundaries at 0 and 12 ms, above the rows' buckets, under the line saying so
    assert lines[0].strip() == "| wave start; 15.0 ms in all"
    start = lines[2].index(" ") + 1
    assert [i for i, ch in enumerate(lines[1]) if ch == "|"][:2] == [start, start + 48]


def test_simulated_text_gantt_shows_backward_and_sync():
    text = text_gantt(fx.plan(), width=65, sim=sim())
    rows = _rows(text.splitlines())
    # 65 ms over 65 characters: enc forward 0-4, backward 47-55, sync 55-65 on ranks 0-1;
    # head forward 24-25, backward 25-27, sync 27-32 on ranks 2-3.
    assert rows["r0"] == "A" * 4 + "." * 43 + "a" * 8 + "~" * 10
    assert rows["r2"] == "." * 24 + "B" + "bb" + "~" * 5 + "." * 33
    assert "~=param sync" in text


def test_compute_shows_through_a_sync_that_overlaps_it():
    # chunked buckets: enc's sync runs 51-61 ms, over its backward 47-55 on ranks 0-1
    chunked = simulate(fx.plan(), fx.graph(), fx.profile(), fx.cluster(), sync="chunked")
    assert chunked.iteration_ms == pytest.approx(61.0)
    rows = _rows(text_gantt(fx.plan(), width=61, sim=chunked).splitlines())
    assert rows["r0"] == "A" * 4 + "." * 43 + "a" * 8 + "~" * 6


@pytest.mark.parametrize("progress", ["wave", "rank"])
def test_a_forward_stalled_for_an_all_gather_is_drawn_as_a_stall_not_compute(progress):
    # enc runs layer 0 2.5-4.5 ms, stalls until 5 and runs layer 1 5-7; 60.5 ms in all
    plan, r = fx.zero1_chunked(progress)
    times, series = busy_series(timeline(plan, r))
    assert times[:4] == pytest.approx([2.5, 4.5, 5.0, 7.0])
    assert series["enc"][:4] == [2, 0, 2, 0]
    text = text_gantt(plan, width=121, sim=r)
    row = _rows(text.splitlines())["r0"]
    assert row[:14] == "....." + "AAAA" + ":" + "AAAA"
    assert ":=stalled for an all-gather" in text


def test_a_stall_narrower_than_a_character_is_not_in_the_legend():
    # multitask-clip 4 tasks on 16 GPUs stalls once, for about 0.01 ms of its 66 ms
    plan = load(str(PLANS / "multitask-clip-4-a800-2x8.yaml"), Plan)
    from spindle_cli.cli.simulate import load_plan_inputs

    inputs = load_plan_inputs(plan, str(PLANS / "multitask-clip-4-a800-2x8.yaml"))
    r = simulate(plan, inputs.graph, inputs.profile, inputs.cluster)
    assert any(s.forward_stalls for s in r.slices)
    text = text_gantt(plan, width=100, sim=r)
    assert ":" not in "".join(_rows(text.splitlines()).values())
    assert "stalled" not in text


def test_a_forward_cut_by_a_stall_is_labelled_on_its_longest_part():
    from spindle_cli.cli.views.gantt import Bar, Timeline, _label_slices

    def bar(start, end, phase):
        return Bar(rank=0, start_ms=start, end_ms=end, key="enc", label="t/enc [0:4)",
                   phase=phase, slice_id="w0.0")

    tl = Timeline(num_ranks=1, end_ms=10.0, bars=(bar(0, 1, "forward"), bar(1, 2, "stall"),
                                                   bar(2, 10, "forward")),
                  boundaries=(), flows=(), sync_start_ms=None)
    labelled = []

    class Axes:
        def text(self, x, y, text, **kwargs):
            labelled.append((x, text))

    _label_slices(Axes(), tl, width_px=1000)
    assert labelled == [(6.0, "t/enc [0:4)")]


def test_busy_series_counts_ranks_per_module():
    times, series = busy_series(timeline(fx.plan(), sim()))
    assert times == [0.0, 4.0, 24.0, 25.0, 27.0, 47.0, 55.0]
    assert series["enc"] == [2, 0, 0, 0, 0, 2, 0]
    assert series["head"] == [0, 0, 2, 2, 0, 0, 0]


@pytest.mark.parametrize("path", sorted(PLANS.glob("*.yaml")), ids=lambda p: p.name)
def test_planned_utilization_never_exceeds_the_ranks(path):
    # the recorded wave starts are rounded: a slice's end must not pass the next wave's start
    plan = load(str(path), Plan)
    times, series = busy_series(timeline(plan))
    assert max(sum(busy) for busy in zip(*series.values(), strict=True)) <= plan.num_devices


def test_planned_timeline_has_transfers_and_sync_marker():
    tl = timeline(fx.plan())
    assert tl.flows == ((0, 2, 12.0, 12.0),)
    assert tl.sync_start_ms == 15.0
    assert [name for _, name in tl.boundaries] == ["w0", "w1"]


@pytest.mark.parametrize("progress", ["wave", "rank"])
def test_simulated_sync_marker_is_where_the_backward_pass_ends(progress):
    # enc and head on all 4 ranks under ZeRO-1: the forward waits 0-15 ms for last step's
    # all-gathers, computes 15-22.5, and the 400 MB reduce-scatter runs 22.5-37.5. Behind
    # wave barriers that first wait is sync too (30 ms in all), and the marker was drawn at
    # the iteration less its sync (7.5); it belongs at 22.5.
    everyone = (0, 1, 2, 3)
    plan = fx.plan(enc_ranks=everyone, head_ranks=everyone, enc_sync_bytes=400_000_000,
                   head_sync_bytes=0)
    plan = dataclasses.replace(plan, options={**plan.options, "zero": "1"})
    r = simulate(plan, fx.graph(), fx.profile(), fx.cluster(), sync="per-wave",
                 progress=progress)
    assert r.iteration_ms == pytest.approx(37.5)
    assert timeline(plan, r).sync_start_ms == pytest.approx(22.5)


@pytest.mark.parametrize("name", ["g.svg", "g.png"])
def test_gantt_files_by_extension(tmp_path, name):
    path = tmp_path / name
    write_gantt(fx.plan(), str(path), sim=sim())
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") if name.endswith(".png") else b"<svg" in data[:2000]
    # Deterministic: the same plan draws the same bytes.
    write_gantt(fx.plan(), str(tmp_path / ("again" + path.suffix)), sim=sim())
    assert (tmp_path / ("again" + path.suffix)).read_bytes() == data



def test_every_bar_of_the_timeline_is_drawn_where_it_lies(monkeypatch):
    """The bars are drawn as one collection of rectangles per style (a patch per bar took
    minutes for a plan of 512 ranks): each at its rank's row, from its start to its end."""
    from spindle_cli.cli.views import gantt

    drawn = []
    monkeypatch.setattr(gantt, "save_figure", lambda fig, path: drawn.append(fig))
    plan = load(str(PLANS / "multitask-clip-4-a800-2x8.yaml"), Plan)
    from spindle_cli.cli.simulate import load_plan_inputs

    inputs = load_plan_inputs(plan, str(PLANS / "multitask-clip-4-a800-2x8.yaml"))
    result = simulate(plan, inputs.graph, inputs.profile, inputs.cluster)
    write_gantt(plan, "unused.png", sim=result)
    from matplotlib.collections import PolyCollection

    boxes = sorted((round(float(e.x0), 9), round(float(e.x1), 9), round(float(e.y0 + e.y1) / 2))
                   for c in drawn[0].axes[0].collections if isinstance(c, PolyCollection)
                   for e in (path.get_extents() for path in c.get_paths()))
    bars = sorted((round(b.start_ms, 9), round(b.end_ms, 9), b.rank)
                  for b in timeline(plan, result).bars)
    assert len(boxes) == len(bars) > plan.num_devices
    assert boxes == bars

def test_svg_gantt_labels_slices_and_waves(tmp_path):
    path = tmp_path / "g.svg"
    write_gantt(fx.plan(), str(path))
    svg = path.read_text()
    assert "t/enc [0:2)" in svg and "w1" in svg and "param sync" in svg


def test_utilization_plot(tmp_path):
    path = tmp_path / "u.png"
    write_utilization(fx.plan(), str(path), sim=sim())
    assert path.read_bytes().startswith(b"\x89PNG")


def test_an_image_is_written_through_a_symlink_and_keeps_the_mode_it_replaces(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "g.svg"
    target.write_text("old")
    target.chmod(0o600)
    link = tmp_path / "g.svg"
    link.symlink_to(target)
    write_gantt(fx.plan(), str(link))
    assert link.is_symlink()
    assert b"<svg" in target.read_bytes()[:2000]
    assert (target.stat().st_mode & 0o777) == 0o600
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["g.svg"]
    # refused before drawing, like any output the command cannot write
    target.chmod(0o444)
    with pytest.raises(SpindleError, match=f"^{link}: cannot write: read-only file$"):
        write_gantt(fx.plan(), str(link))


def test_bad_image_paths_are_user_errors(tmp_path):
    with pytest.raises(SpindleError, match="unknown image type"):
        write_gantt(fx.plan(), str(tmp_path / "g.jpg"))
    with pytest.raises(SpindleError, match="does not exist"):
        write_utilization(fx.plan(), str(tmp_path / "missing" / "u.png"))
    assert list(tmp_path.iterdir()) == []


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("step", ["savefig", "replace"])
def test_a_full_disk_is_a_user_error_and_leaves_no_temp_file(tmp_path, monkeypatch, step):
    import matplotlib.figure

    if step == "savefig":
        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", _disk_full)
    else:
        monkeypatch.setattr(os, "replace", _disk_full)
    with pytest.raises(SpindleError, match="u.png: cannot write: No space left on device"):
        write_utilization(fx.plan(), str(tmp_path / "u.png"))
    assert list(tmp_path.iterdir()) == []
