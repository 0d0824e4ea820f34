"""The simulator's flow-level model of the cluster's network: the point-to-point flows an
inter-wave transfer makes (`row_flows`), and a fluid simulation of flows sharing the ports of
ranks, islands and nodes (`Network`). `simulate`'s module docstring describes the model; what
sends which flows when is the iteration's (planner/iteration.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.plan import tp_groups
from spindle_cli.planner.memory import split_rows


@lru_cache(maxsize=8192)
def row_flows(
    num_bytes: int,
    src_ranks: tuple[int, ...],
    src_strategy: str,
    dst_ranks: tuple[int, ...],
    dst_strategy: str,
    num_rows: int,
) -> tuple[tuple[int, int, int], ...]:
    """(src rank, dst rank, bytes) pieces of a transfer, rows matched by overlap; same-rank
    pieces are dropped, pieces of 0 bytes kept (a consumer waits for its message, which the
    executor sends however small the rows). Every rank of a consumer tensor-parallel group
    needs its group's rows; they come from the producer rank on the same device when there is
    one, else from the producer group's ranks in turn (each holds the group's output). Cached:
    the candidate plans a planner simulates share most of their slices."""
    src_groups = tp_groups(src_ranks, src_strategy)
    dst_groups = tp_groups(dst_ranks, dst_strategy)
    src_rows = split_rows(num_rows, len(src_groups))
    dst_rows = split_rows(num_rows, len(dst_groups))
    out: list[tuple[int, int, int]] = []
    # Both row splits are ascending and contiguous: the producer groups overlapping a consumer
    # group are a run that starts at or after the previous consumer's first (a merge walk).
    first = 0
    for di, (dg, (dlo, dhi)) in enumerate(zip(dst_groups, dst_rows, strict=True)):
        while first < len(src_rows) and src_rows[first][1] <= dlo:
            first += 1
        k = first
        while k < len(src_rows) and src_rows[k][0] < dhi:
            sg, (slo, shi) = src_groups[k], src_rows[k]
            k += 1
            overlap = min(dhi, shi) - max(dlo, slo)
            if overlap <= 0:
                continue
            piece = num_bytes * overlap // num_rows
            for j, d in enumerate(dg):
                # every rank of a producer group holds its rows: consumers take turns
                s = d if d in sg else sg[(di + j) % len(sg)]
                if s != d:
                    out.append((s, d, piece))
    return tuple(out)

_least = np.minimum.reduce
"""The least element of an array (`ndarray.min` without its Python wrapper)."""
_greatest = np.maximum.reduce
"""The greatest element of an array (`ndarray.max` without its Python wrapper)."""


@lru_cache(maxsize=8)
def _pair_ports(num_devices: int, island_size: int, devices_per_node: int
                ) -> dict[tuple[int, int], tuple[int, int]]:
    """The (send, receive) ports of rank pairs on a cluster of this shape, filled by
    `Network._ports_of` as pairs are first seen and shared by every simulation on it (the
    planner simulates dozens of candidates on one cluster)."""
    return {}


@dataclass(slots=True, kw_only=True)
class _Chain:
    """Flows added `after` others (`Network.add`): those that had not ended when last looked
    at, and when the flows may start once none is moving."""

    waiting: np.ndarray
    ids: list[int]
    start_s: float
    latency_s: float

GIVE_UP_ROUNDING = 1e-12
"""The relative rounding a give-up bound allows: the clock and the work left are summed in
another order than the simulation to the end sums them (the network in seconds, against a
bound in ms), so an iteration equal to the bound could pass it by an ulp. The checks give up
only beyond it (`passes`); `simulate.simulated_cost` shaves it off a bound it gave up at."""


def passes(total: float, bound: float) -> bool:
    """Whether a lower bound of the iteration, `total`, passes the give-up `bound` beyond
    rounding (`GIVE_UP_ROUNDING`)."""
    return total > bound * (1 + GIVE_UP_ROUNDING)


class GaveUp(Exception):
    """The simulation (`simulate._run`) found the iteration lasts at least `now_ms`, past its
    `give_up_ms`."""

    def __init__(self, now_ms: float) -> None:
        super().__init__(now_ms)
        self.now_ms = now_ms


class Network:
    """Fluid simulation of point-to-point flows sharing ports (internal state of one
    `simulate` call).

    Ports: inside an island each rank has an NVLink send and receive port at the intra-island
    bandwidth. Between nodes a flow goes through its nodes' NICs: one send and one receive
    port per node whose capacity is the per-device inter-node bandwidth times the devices of
    the node (the cluster spec quotes the node's link divided by its devices), so one rank
    talking across nodes alone gets the whole link and eight at once get an eighth each.
    Between islands of one node, each rank has its own port at the inter-node rate. A port
    carrying k flows gives each capacity/k; a flow moves at the smaller of its two port
    shares. Rates are recomputed whenever a flow starts or ends. Flows added `after` others
    start once those have ended (a process group's collectives run one after another).
    """

    def __init__(self, cluster: ClusterSpec, give_up_s: float = math.inf) -> None:
        self.now_s = 0.0
        # `finish` raises GaveUp once the clock plus `tail_s` passes this: whoever waits for
        # a flow sets `tail_s` to the least the iteration lasts past that flow's end
        self.give_up_s = give_up_s
        self.tail_s = 0.0
        self.num_flows = 0
        # Ports are numbered by kind: NVLink out/in per rank, island out/in per rank, NIC
        # out/in per node.
        n, nodes = cluster.num_devices, cluster.num_nodes
        self._capacity = np.concatenate([
            np.full(2 * n, float(cluster.intra_island_bandwidth_bytes_per_s)),
            np.full(2 * n, float(cluster.inter_node_bandwidth_bytes_per_s)),
            np.full(2 * nodes, float(cluster.inter_node_bandwidth_bytes_per_s
                                     * cluster.devices_per_node)),
        ])
        self._island_size = cluster.island_size
        self._node_size = cluster.devices_per_node
        self._pair_ports = _pair_ports(n, cluster.island_size, cluster.devices_per_node)
        self._num_devices = n
        self._num_nodes = nodes
        # Per flow, grown by doubling: when it may start, bytes left, its two ports, its end.
        self.ready_s = np.empty(256)
        self.end_s = np.full(256, np.nan)
        self._remaining = np.empty(256)
        self._ports = np.empty((256, 2), dtype=np.int64)
        # Flows not started yet, ordered by start time, their start times, and the earliest
        # (inf when none).
        self._waiting = np.empty(0, dtype=np.int64)
        self._waiting_ready_s = np.empty(0)
        self._next_start_s = math.inf
        # Flows moving bytes now, in slots kept in start order: ids, (send, receive) ports as
        # two rows, bytes left; and how many active flows each port carries (as floats: a
        # port's share of its capacity is one division per port, the quotient each of its
        # flows would get). A flow that ends leaves its slot dead: bytes left inf, its send
        # port the idle port `_idle`, whose load stays 1, so its rate is at most 1 and above
        # 0 whatever its receive port carries (inf where it carries no flow), and a step moves
        # nothing through it; dead slots are dropped once they outnumber the live ones
        # (`_compact`).
        self._idle = len(self._capacity)
        self._capacity = np.append(self._capacity, 1.0)
        self._active = np.empty(0, dtype=np.int64)
        self._active_ports = np.empty((2, 0), dtype=np.int64)
        self._active_left = np.empty(0)
        self._live = 0
        self._load = np.zeros(len(self._capacity))
        self._load[self._idle] = 1.0
        self._new: list[int] = []
        # flows added `after` others, by one flow they wait for (the one issued last among
        # those still moving when the chain was last looked at)
        self._after: dict[int, list[_Chain]] = {}

    def _ports_of(self, src: int, dst: int) -> tuple[int, int]:
        """The (send, receive) port of a flow from src to dst."""
        pair = (src, dst)
        if pair not in self._pair_ports:
            n, nic = self._num_devices, 4 * self._num_devices
            node_src, node_dst = src // self._node_size, dst // self._node_size
            if src // self._island_size == dst // self._island_size:
                self._pair_ports[pair] = (src, n + dst)
            elif node_src == node_dst:
                self._pair_ports[pair] = (2 * n + src, 3 * n + dst)
            else:
                self._pair_ports[pair] = (nic + node_src, nic + self._num_nodes + node_dst)
        return self._pair_ports[pair]

    def add(self, pieces: Sequence[tuple[int, int, int]], start_s: float,
            latency_s: float, after: Sequence[int] = ()) -> list[int]:
        """Register flows (src rank, dst rank, bytes) that may start at `start_s`, and once
        the flows `after` have ended; returns their ids."""
        # (within the float rounding of the clock, however far it has run)
        assert start_s >= self.now_s - 1e-12 * max(1.0, self.now_s), \
            "a flow cannot start in the simulated past"
        i, k = self.num_flows, len(pieces)
        while i + k > len(self.ready_s):
            grow = len(self.ready_s)
            self.ready_s = np.concatenate([self.ready_s, np.empty(grow)])
            self.end_s = np.concatenate([self.end_s, np.full(grow, np.nan)])
            self._remaining = np.concatenate([self._remaining, np.empty(grow)])
            self._ports = np.concatenate([self._ports, np.empty((grow, 2), dtype=np.int64)])
        if k:
            known, ports_of = self._pair_ports, self._ports_of
            self._ports[i : i + k] = [known.get((src, dst)) or ports_of(src, dst)
                                      for src, dst, _ in pieces]
            self.ready_s[i : i + k] = start_s + latency_s
            self._remaining[i : i + k] = [num_bytes for _, _, num_bytes in pieces]
        ids = list(range(i, i + k))
        self.num_flows += k
        if after and ids:
            waits = np.asarray(after, dtype=np.int64)
            waits = waits[np.isnan(self.end_s[waits])]
            if waits.size:
                chain = _Chain(waiting=waits, ids=ids, start_s=start_s, latency_s=latency_s)
                self._after.setdefault(int(waits[-1]), []).append(chain)
                return ids
        self._new.extend(ids)
        return ids

    def finish(self, ids: list[int]) -> float:
        """Advance until every flow in `ids` is done; returns the last one's end time."""
        if not ids:
            return 0.0
        index = np.array(ids, dtype=np.int64)
        open_ = index[np.isnan(self.end_s[index])]
        if open_.size:
            with np.errstate(divide="ignore"):  # shares of ports that carry no flow (`_step`)
                while open_.size:
                    # step until the open flow issued last has ended (one element to look
                    # at per step), then look for the others still open
                    last = open_[-1]
                    while math.isnan(self.end_s[last]):
                        self._step()
                        self._check_give_up()
                    open_ = open_[np.isnan(self.end_s[open_])]
        return float(_greatest(self.end_s[index]))

    def step(self) -> None:
        """Advance to the next event (`_step`), for a caller waiting on flows it knows are
        pending; raises GaveUp once the clock plus `tail_s` passes `give_up_s`."""
        assert self._new or self._waiting.size or self._live, "no flow is pending"
        with np.errstate(divide="ignore"):  # the shares of ports that carry no flow (`_step`)
            self._step()
        self._check_give_up()

    def _check_give_up(self) -> None:
        """Raise GaveUp once the clock plus `tail_s` passes `give_up_s`: the clock only
        advances to the end of a flow someone waits for, so the iteration lasts at least
        until now, plus the tail."""
        if passes(self.now_s + self.tail_s, self.give_up_s):
            raise GaveUp((self.now_s + self.tail_s) * 1e3)

    def _step(self) -> None:
        """Advance to the next event: a flow starts or the first active flow ends. Callers
        ignore division by zero: a port that carries no flow has an infinite share, which no
        live flow reads."""
        if self._new:
            self._wait(np.array(self._new, dtype=np.int64))
            self._new.clear()
        if self._next_start_s <= self.now_s:
            self._start()
        if not self._live:
            self.now_s = self._next_start_s
            return
        share = self._capacity / self._load
        ports = self._active_ports
        rate = np.minimum(share[ports[0]], share[ports[1]])
        rem = self._active_left
        dt = min(float(_least(rem / rate)), self._next_start_s - self.now_s)
        moved = rate * dt
        rem -= moved
        self.now_s += dt
        # A flow within a relative 1e-9 of done ends now (float rounding of equal-rate flows).
        done = (rem <= 1e-9 * np.maximum(moved, 1.0)).nonzero()[0]
        if not done.size:
            return
        ended = self._active[done]
        self.end_s[ended] = self.now_s
        if self._after:
            self._release(ended)
        np.add.at(self._load, ports.take(done, axis=1), -1.0)
        ports[0, done] = self._idle
        rem[done] = math.inf
        self._live -= done.size
        if 2 * self._live < rem.size - 32:
            self._compact()

    def _wait(self, new: np.ndarray) -> None:
        """Queue flows `new` (their start times set) with those waiting, by start time."""
        waiting = np.concatenate([self._waiting, new])
        ready = self.ready_s[waiting]
        order = np.argsort(ready, kind="stable")
        self._waiting, self._waiting_ready_s = waiting[order], ready[order]
        self._next_start_s = float(self._waiting_ready_s[0])

    def _start(self) -> None:
        """Move the waiting flows whose start time has come to new active slots."""
        k = int(self._waiting_ready_s.searchsorted(self.now_s, side="right"))
        begin = self._waiting[:k]
        ports = self._ports.take(begin, axis=0).T
        self._active = np.concatenate([self._active, begin])
        self._active_ports = np.concatenate([self._active_ports, ports], axis=1)
        self._active_left = np.concatenate([self._active_left, self._remaining[begin]])
        np.add.at(self._load, ports, 1.0)
        self._live += k
        self._waiting, self._waiting_ready_s = self._waiting[k:], self._waiting_ready_s[k:]
        self._next_start_s = float(self._waiting_ready_s[0]) if self._waiting.size else math.inf

    def _compact(self) -> None:
        """Drop the dead slots (no bytes left to move: inf), keeping the live ones in order."""
        keep = self._active_left != math.inf
        self._active = self._active[keep]
        self._active_ports = self._active_ports[:, keep]
        self._active_left = self._active_left[keep]

    def _release(self, ended: np.ndarray) -> None:
        """Start the flows waiting for `ended` whose predecessors have all ended."""
        for j in ended.tolist():
            for chain in self._after.pop(j, ()):
                # every flow ending now has its end time: one still without waits on
                chain.waiting = chain.waiting[np.isnan(self.end_s[chain.waiting])]
                if chain.waiting.size:
                    self._after.setdefault(int(chain.waiting[-1]), []).append(chain)
                else:
                    self.ready_s[chain.ids] = max(chain.start_s, self.now_s) + chain.latency_s
                    self._new.extend(chain.ids)
