"""How ranks move through the waves of a simulated iteration (`simulate`'s `progress`): waves
as barriers, the planner's model (`run_barriers`), or each rank on its own, as the executor
runs (`run_ranks`). Both drive one `iteration.Iteration` from its first forward wave to its
last backward wave and return when each rank is through; `Iteration.timeline` ends the
iteration. `simulate`'s module docstring describes the model.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

import numpy as np

from spindle_cli.artifacts.plan import Slice
from spindle_cli.planner.iteration import FlowKind, Iteration, RankTimes, bucket_label
from spindle_cli.planner.network import GaveUp, passes


def run_barriers(it: Iteration) -> tuple[list[float], None]:
    """Waves as barriers (`Progress` 'wave'). Gives up (`give_up_ms`) as soon as the
    iteration must outlast it: a wave lasts at least its longest slice, and every rank
    steps its optimizer after the last backward, so the iteration lasts at least the
    waves still to compute, and the longest optimizer step, past any wave's start or
    end."""
    plan, costs = it.plan, it.costs
    fwd_ms = [max([costs[s.id].forward_ms for s in w.slices], default=0.0)
              for w in plan.waves]
    bwd_ms = [max([costs[s.id].backward_ms for s in w.slices], default=0.0)
              for w in plan.waves]
    # the least the iteration lasts past the start of wave k's forward (fwd_rest[k]) or
    # backward (bwd_rest[k]), and past their ends (index k + 1 and k)
    bwd_rest = list(itertools.accumulate(bwd_ms, initial=max(it.optimizer_ms, default=0.0)))
    fwd_rest = list(itertools.accumulate(reversed(fwd_ms), initial=bwd_rest[-1]))[::-1]
    now_ms = _forward_barriers(it, fwd_rest)
    now_ms = _backward_barriers(it, now_ms, bwd_rest)
    return [now_ms] * plan.num_devices, None


def _give_up_past(it: Iteration, now_ms: float, rest_ms: float) -> None:
    if passes(now_ms + rest_ms, it.give_up_ms):
        raise GaveUp(now_ms + rest_ms)


def _forward_barriers(it: Iteration, fwd_rest: list[float]) -> float:
    """The forward waves as barriers (`run_barriers`); when the last one ends."""
    plan, net, costs, starts = it.plan, it.net, it.costs, it.starts
    now_ms = 0.0
    ready = [0.0] * plan.num_devices
    prefetched = {0: it.issue_gathers(0, 0.0)}
    for w in plan.waves:
        inputs = it.issue_boundary(w.index, False, ready).get(w.index, [])
        net.tail_s = fwd_rest[w.index] / 1e3
        start_ms = it.wait_for(now_ms, inputs, prefetched.pop(w.index))
        prefetched[w.index + 1] = it.issue_gathers(w.index + 1, start_ms)
        end_ms = computed_ms = start_ms
        for s in w.slices:
            it.run_forward(s, start_ms, fwd_rest[w.index + 1])
            end_ms = max(end_ms, starts[s.id][1])
            computed_ms = max(computed_ms, start_ms + costs[s.id].forward_ms)
        it.stalled_ms += end_ms - computed_ms
        ready = it.reached(w, start_ms, 1)
        it.fwd_timing.append((start_ms, end_ms, start_ms - now_ms))
        now_ms = end_ms
        _give_up_past(it, now_ms, fwd_rest[w.index + 1])
    return now_ms


def _backward_barriers(it: Iteration, now_ms: float, bwd_rest: list[float]) -> float:
    """The backward waves as barriers (`run_barriers`), from the forward's end at `now_ms`;
    when the last one ends."""
    plan, net, costs, starts = it.plan, it.net, it.costs, it.starts
    # a rank waits for the messages of a boundary before its next compute (the
    # executor's batch wait): a gradient message is waited for by the first wave below
    # its boundary with a slice on either of its ranks (wave 0, the last, where neither
    # computes again), not by a wave its ranks take no part in
    computes_in: list[list[int]] = [[] for _ in range(plan.num_devices)]
    for w in plan.waves:
        for s in w.slices:
            for r in s.ranks:
                computes_in[r].append(w.index)

    def waiter(below: int) -> Callable[[int, int], int]:
        def first_below(src: int, dst: int) -> int:
            return max((waves[k - 1] for waves in (computes_in[src], computes_in[dst])
                        if (k := bisect.bisect_left(waves, below))), default=0)
        return first_below

    waiting: dict[int, list[int]] = {}
    prefetched = {len(plan.waves) - 1: it.issue_gathers(len(plan.waves) - 1, now_ms)}
    for w in reversed(plan.waves):
        net.tail_s = bwd_rest[w.index + 1] / 1e3
        start_ms = it.wait_for(now_ms, waiting.pop(w.index, []), prefetched.pop(w.index))
        prefetched[w.index - 1] = it.issue_gathers(w.index - 1, start_ms)
        end_ms = start_ms
        for s in w.slices:
            starts[s.id][2] = start_ms
            starts[s.id][3] = start_ms + costs[s.id].backward_ms
            end_ms = max(end_ms, starts[s.id][3])
        for below, ids in it.issue_boundary(w.index, True, it.reached(w, start_ms, 3),
                                            waiter(w.index)).items():
            waiting.setdefault(below, []).extend(ids)
        # every rank starts the wave's backward at start_ms; a rank issues its buckets of
        # several ranks in their one global order (the executor's queue)
        issued_at: dict[int, float] = {}
        for b in it.due_in_wave.get(w.index, []):
            at = max([start_ms, *(issued_at.get(r, start_ms) for r in b.ranks),
                      *(starts[sid][2] + costs[sid].passed_ms(k) for sid, k in b.passes)])
            if len(b.ranks) > 1:
                issued_at.update((r, at) for r in b.ranks)
            it.issue_sync(b.groups, b.group_bytes, at, bucket_label(b))
        it.bwd_timing[w.index] = (start_ms, end_ms, start_ms - now_ms)
        now_ms = end_ms
        _give_up_past(it, now_ms, bwd_rest[w.index])
    return now_ms


def run_ranks(it: Iteration) -> tuple[list[float], RankTimes]:
    """Each rank on its own (`Progress` 'rank'): it posts the messages of a boundary
    when it reaches it and goes on once they have arrived; a slice starts when all of its
    ranks are there (and, under ZeRO-3, its weights, gathered from when its ranks started
    their previous compute step). Ranks are advanced in turn, each as far as it can go
    (one slice at a time), and the network only when every rank waits for a flow, so no
    flow starts before the network's clock; a rank running ahead may still issue flows
    later in time than another rank's next ones (`all_gather` queues by time)."""
    return _Ranks(it).run()


class _Ranks:
    """The state of `run_ranks`: every rank's program, how far each rank has got in it, and
    what a blocked rank waits for."""

    def __init__(self, it: Iteration) -> None:
        self.it, self.net = it, it.net
        plan, due_in_wave = it.plan, it.due_in_wave
        n = plan.num_devices
        # every rank's program: the boundary into each wave and its forward, then each wave's
        # backward and the gradients of its boundary back; (compute?, wave, backward)
        steps: list[tuple[bool, int, bool]] = []
        for w in range(len(plan.waves)):
            steps += [(False, w, False), (True, w, False)]
        for w in reversed(range(len(plan.waves))):
            steps += [(True, w, True), (False, w, True)]
        self.steps = steps
        self.computes = [k for k, st in enumerate(steps) if st[0]]
        self.next_compute = dict(zip(self.computes, self.computes[1:], strict=False))
        self.slice_at = [{r: s for s in w.slices for r in s.ranks} for w in plan.waves]
        # a boundary's messages one by one: (kind, label, src, dst, bytes), and each rank's
        self.messages: dict[int, list[tuple[FlowKind, str, int, int, int]]] = {}
        self.mine: dict[tuple[int, int], list[int]] = {}
        for k, (is_compute, w, backward) in enumerate(steps):
            if is_compute:
                continue
            found = self.messages.setdefault(k, [])
            for kind, label, parts in it.boundary_messages(w, backward):
                for src, dst, num_bytes in parts:
                    for r in (src, dst):
                        self.mine.setdefault((k, r), []).append(len(found))
                    found.append((kind, label, src, dst, num_bytes))
        # a bucket's all-reduce runs once every rank of its set has issued it: a rank issues
        # it when its slice of the due wave has passed the bucket's layers (`passes`), or when
        # it starts that wave's backward if its slice runs none of them, and after the
        # buckets of the same set before it
        self.passed: dict[int, dict[int, float]] = {id(b): {} for bs in due_in_wave.values()
                                                    for b in bs}
        self.passes = {id(b): dict(b.passes) for bs in due_in_wave.values() for b in bs}
        self.issued_at: dict[int, float] = {}
        # groups in no bucket sync whole once all of their ranks are through the backward
        bucketed = {gi for bs in due_in_wave.values() for b in bs for gi in b.groups}
        self.whole = [gi for gi in range(len(plan.param_groups)) if gi not in bucketed]
        self.pos, self.clock = [0] * n, [0.0] * n
        self.forward, self.backward_ms, self.waiting_ms = [0.0] * n, [0.0] * n, [0.0] * n
        # when each rank reached each step; the flow of each (boundary step, message)
        self.arrived: dict[tuple[int, int], float] = {}
        self.flow_of: dict[tuple[int, int], int] = {}
        # when each rank started (or passed) each compute step; a slice's ZeRO-3 gathers at
        # a compute step; the flows a blocked rank waits for
        self.computed: dict[tuple[int, int], float] = {}
        self.weights: dict[tuple[int, str], list[int]] = {}
        self.waits_on: dict[int, list[int]] = {}
        # a forward stalled for an all-gather: its next run of operators, start, stall so far
        self.forwarding: dict[tuple[int, str], tuple[int, float, float]] = {}

    def run(self) -> tuple[list[float], RankTimes]:
        """Move every rank through its program (`run_ranks`); when each one is through, and
        its times."""
        it, steps, pos, waits_on = self.it, self.steps, self.pos, self.waits_on
        plan, net, starts = it.plan, it.net, it.starts
        advance, finished = self.advance, self.finished
        first = self.computes[0] if self.computes else None
        if first is not None:
            for s in plan.waves[steps[first][1]].slices:
                self.weights[(first, s.id)] = it.issue_slice_gathers(s, 0.0)
        while True:
            moved = True
            while moved:
                moved = False
                for r in range(len(pos)):
                    if pos[r] < len(steps) and advance(r):
                        moved = True
            if all(p == len(steps) for p in pos):
                break
            assert waits_on, "every rank waits for a peer that never comes"
            while not any(finished(ids) for ids in waits_on.values()):
                net.step()
        fwd_timing, bwd_timing = it.fwd_timing, it.bwd_timing
        for w in plan.waves:
            f0 = min(starts[s.id][0] for s in w.slices)
            f1 = max(starts[s.id][1] for s in w.slices)
            prev = fwd_timing[-1][1] if fwd_timing else 0.0
            fwd_timing.append((f0, f1, max(0.0, f0 - prev)))
        prev = fwd_timing[-1][1] if fwd_timing else 0.0
        for w in reversed(plan.waves):
            b0 = min(starts[s.id][2] for s in w.slices)
            b1 = max(starts[s.id][3] for s in w.slices)
            bwd_timing[w.index] = (b0, b1, max(0.0, b0 - prev))
            prev = b1
        return self.clock, RankTimes(forward_ms=self.forward, backward_ms=self.backward_ms,
                                     waiting_ms=self.waiting_ms)

    def finished(self, ids: list[int]) -> bool:
        """Whether every flow in `ids` has ended."""
        return not np.isnan(self.net.end_s[ids]).any()

    def pass_compute(self, k: int, r: int, at_ms: float) -> None:
        """Rank r starts (or passes) compute step k at `at_ms`: the next compute step's
        slice gathers its weights once all of its ranks have."""
        computed = self.computed
        computed[(k, r)] = at_ms
        nxt = self.next_compute.get(k)
        s = self.slice_at[self.steps[nxt][1]].get(r) if nxt is not None else None
        if s is not None and all((k, q) in computed for q in s.ranks):
            self.weights[(nxt, s.id)] = self.it.issue_slice_gathers(
                s, max(computed[(k, q)] for q in s.ranks))

    def through_backward(self, w: int, r: int, start_ms: float, s: Slice | None = None
                         ) -> None:
        """Rank r started wave w's backward at `start_ms`, running slice `s` (if any): it
        issues the wave's buckets of its sets."""
        it, passed, issued_at = self.it, self.passed, self.issued_at
        for b in it.due_in_wave.get(w, []):
            if r not in b.ranks:
                continue
            k = self.passes[id(b)].get(s.id) if s is not None else None
            ready = start_ms if k is None else start_ms + it.costs[s.id].passed_ms(k)
            at = max(ready, issued_at.get(r, ready))
            if len(b.ranks) > 1:
                issued_at[r] = at
            passed[id(b)][r] = at
            if len(passed[id(b)]) == len(b.ranks):
                it.issue_sync(b.groups, b.group_bytes, max(passed[id(b)].values()),
                              bucket_label(b))

    def run_slice(self, k: int, s: Slice, start_ms: float, stall_ms: float = 0.0) -> None:
        """Slice `s` runs compute step k from `start_ms`, stalled `stall_ms` on the way
        (a forward's all-gathers, `gathered_at`)."""
        _, w, backward = self.steps[k]
        c = self.it.costs[s.id]
        cost_ms = c.backward_ms if backward else c.forward_ms
        starts = self.it.starts[s.id]
        starts[2 if backward else 0] = start_ms
        starts[3 if backward else 1] = start_ms + cost_ms + stall_ms
        arrived, clock, pos, waits_on = self.arrived, self.clock, self.pos, self.waits_on
        waiting_ms, spent_ms = self.waiting_ms, self.backward_ms if backward else self.forward
        for q in s.ranks:
            waiting_ms[q] += start_ms - arrived[(k, q)] + stall_ms
            spent_ms[q] += cost_ms
            clock[q] = start_ms + cost_ms + stall_ms
            pos[q] += 1
            waits_on.pop(q, None)
            self.pass_compute(k, q, start_ms)
            if backward:
                self.through_backward(w, q, start_ms, s)
        if passes(clock[s.ranks[0]], self.it.give_up_ms):
            raise GaveUp(clock[s.ranks[0]])

    def advance(self, r: int) -> bool:
        """Move rank r on as far as it can go now; whether it moved."""
        pos, clock, steps, arrived = self.pos, self.clock, self.steps, self.arrived
        moved = False
        while pos[r] < len(steps):
            k = pos[r]
            is_compute, w, _ = steps[k]
            if (k, r) not in arrived:
                self.arrive(k, r)
                moved = True
            if is_compute:
                s = self.slice_at[w].get(r)
                if s is None:
                    self.pass_compute(k, r, clock[r])
                    if steps[k][2]:
                        self.through_backward(w, r, clock[r])
                    pos[r] += 1
                    continue
                return self.start_slice(k, s) or moved
            if not self.leave(k, r):
                return moved
        return moved

    def arrive(self, k: int, r: int) -> None:
        """Rank r reaches step k: it posts each message of a boundary whose other rank is
        there too."""
        it, arrived = self.it, self.arrived
        arrived[(k, r)] = self.clock[r]
        for j in self.mine.get((k, r), []):
            kind, label, src, dst, num_bytes = self.messages[k][j]
            if (k, dst if src == r else src) in arrived:
                start_ms = max(arrived[(k, src)], arrived[(k, dst)])
                self.flow_of[(k, j)] = it.issue(kind, label, [(src, dst, num_bytes)],
                                                start_ms, it.latency_s)[0]

    def start_slice(self, k: int, s: Slice) -> bool:
        """Run slice `s` at compute step k if all of its ranks are there and its ZeRO-3
        weights and (forward) all-gathers have arrived; whether it ran."""
        arrived = self.arrived
        if not all((k, q) in arrived for q in s.ranks):
            return False
        it, waits_on, finished = self.it, self.waits_on, self.finished
        ids = self.weights.get((k, s.id), [])
        if not finished(ids):
            for q in s.ranks:
                waits_on[q] = ids
            return False
        # a forward waits for its all-gathers run by run, from where it stalled
        first, start_ms, stall_ms = self.forwarding.pop((k, s.id), (0, max(
            [*(arrived[(k, q)] for q in s.ranks),
             *(float(self.net.end_s[i]) * 1e3 for i in ids)]), 0.0))
        runs = [] if self.steps[k][2] else it.prior.get(s.id, [])
        for j in range(first, len(runs)):
            at, gathers = runs[j]
            if not finished(gathers):
                self.forwarding[(k, s.id)] = (j, start_ms, stall_ms)
                for q in s.ranks:
                    waits_on[q] = gathers
                return False
            start_ms, stall_ms = it.gathered_at(
                s, at, start_ms, stall_ms, float(self.net.end_s[gathers].max()) * 1e3)
        self.run_slice(k, s, start_ms, stall_ms)
        return True

    def leave(self, k: int, r: int) -> bool:
        """Rank r leaves boundary step k once all of its messages there have arrived;
        whether it left. The last step through, it syncs the groups in no bucket whose ranks
        are all through."""
        ids = [self.flow_of.get((k, j), -1) for j in self.mine.get((k, r), [])]
        if -1 in ids:
            return False
        if not self.finished(ids):
            self.waits_on[r] = ids
            return False
        pos, clock, net = self.pos, self.clock, self.net
        leave_ms = max([clock[r], *(float(net.end_s[i]) * 1e3 for i in ids)])
        self.waiting_ms[r] += leave_ms - clock[r]
        clock[r] = leave_ms
        pos[r] += 1
        self.waits_on.pop(r, None)
        if pos[r] == len(self.steps):
            for gi in self.whole:
                g = self.it.plan.param_groups[gi]
                if r in g.ranks and all(pos[q] == len(self.steps) for q in g.ranks):
                    self.it.issue_sync((gi,), (g.bytes,), max(clock[q] for q in g.ranks))
        return True
