"""Plan -> process groups: one `new_group` per distinct rank set (parameter device groups and
the rank sets of contrastive-loss slices, which gather their batch).

`new_group` must be entered by every rank of the world, in the same order everywhere (torch
docs), so every rank walks the program's sorted rank sets and creates all of them, including
those it is not a member of.
"""

from __future__ import annotations

import torch.distributed as dist

from spindle_cli.runtime.program import Program

Groups = dict[tuple[int, ...], dist.ProcessGroup | None]
"""Rank set -> its group (None on ranks outside the set, and for single-rank sets)."""


def make_groups(program: Program, rank: int) -> Groups:
    """Create the process groups of a program (a collective over the whole world)."""
    groups: Groups = {}
    world = tuple(range(dist.get_world_size()))
    for ranks in program.group_ranks:
        if ranks == world:
            groups[ranks] = dist.group.WORLD
            continue
        # use_local_synchronization stays False: with overlapping sets, member-only creation
        # names groups differently on different ranks and hangs (runtime-design.md §2.1).
        pg = dist.new_group(list(ranks))
        groups[ranks] = pg if rank in ranks else None
    return groups
