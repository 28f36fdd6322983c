"""The collective read plan: a pure function from every rank's requests to who reads what.

Inputs are plain arrays: each request is (rank, position in that rank's list,
sample id), and the dataset's extent table maps a sample to (file, offset,
length).  The plan:

1. groups requests by who should serve them: a rank's node, when that node's
   burst buffer holds the file; the lowest node holding it otherwise; and all
   aggregators when only the PFS has it;
2. within a group, sorts the distinct extents by (file, offset) and merges
   neighbours into one read while the hole between them is at most
   ``max_hole`` and the read stays within ``max_read`` (a larger sample is
   read in several pieces);
3. splits the group's accessed byte range into one contiguous *file domain*
   per aggregator, aligned to ``stripe``, and gives each read to the
   aggregator whose domain holds its start;
4. places each read in its aggregator's buffer (reads back to back, in order)
   and records, for every request, its aggregator and where its bytes lie in
   that buffer.

From the result every rank derives what it sends to and receives from every
other in one ``Alltoallv``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

PFS_ONLY = -1


@dataclasses.dataclass(frozen=True)
class Extents:
    """Where each sample's bytes are: ``file[i]``, ``offset[i]``, ``length[i]``."""

    file: np.ndarray  # int32
    offset: np.ndarray  # int64
    length: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.file.size)


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """Who reads what, and where every request's bytes land.

    ``reads`` has one row per read: aggregator index (into the plan's
    aggregator list), file, offset, length, and offset in that aggregator's
    buffer.  ``req_*`` arrays are per request, in the order given.
    """

    read_agg: np.ndarray
    read_file: np.ndarray
    read_offset: np.ndarray
    read_length: np.ndarray
    read_buf: np.ndarray
    req_rank: np.ndarray
    req_pos: np.ndarray
    req_agg: np.ndarray
    req_buf: np.ndarray
    req_length: np.ndarray
    aggregators: tuple[int, ...]

    def buffer_bytes(self, agg: int) -> int:
        """Bytes aggregator ``agg`` reads into its buffer."""
        return int(self.read_length[self.read_agg == agg].sum())

    @property
    def bytes_read(self) -> int:
        """Bytes read by all aggregators (holes included)."""
        return int(self.read_length.sum())

    @property
    def requests_issued(self) -> int:
        """Read requests that reach the file systems."""
        return int(self.read_length.size)


def _group_of(
    req_node: np.ndarray, files: np.ndarray, holders: Sequence[frozenset[int]]
) -> np.ndarray:
    """Serving group per request: a node index, or PFS_ONLY."""
    group = np.full(req_node.size, PFS_ONLY, dtype=np.int64)
    for i, (node, f) in enumerate(zip(req_node.tolist(), files.tolist(), strict=True)):
        held = holders[f]
        if node in held:
            group[i] = node
        elif held:
            group[i] = min(held)
    return group


def _merge(
    file: np.ndarray, offset: np.ndarray, end: np.ndarray, max_hole: int, max_read: int
) -> list[tuple[int, int, int]]:
    """Merge sorted extents into (file, start, end) ranges."""
    ranges: list[tuple[int, int, int]] = []
    cur_file, cur_start, cur_end = -1, 0, 0
    for f, o, e in zip(file.tolist(), offset.tolist(), end.tolist(), strict=True):
        if f == cur_file and o - cur_end <= max_hole and max(e, cur_end) - cur_start <= max_read:
            cur_end = max(cur_end, e)
            continue
        if cur_file >= 0:
            ranges.append((cur_file, cur_start, cur_end))
        cur_file, cur_start, cur_end = f, o, e
    if cur_file >= 0:
        ranges.append((cur_file, cur_start, cur_end))
    return ranges


def make_plan(
    req_rank: np.ndarray,
    req_pos: np.ndarray,
    req_sample: np.ndarray,
    extents: Extents,
    rank_node: Sequence[int],
    aggregators: Sequence[int],
    holders: Sequence[frozenset[int]],
    file_sizes: Sequence[int],
    stripe: int,
    max_hole: int,
    max_read: int,
) -> ReadPlan:
    """Plan one collective read (see the module docstring).  Pure.

    ``rank_node[r]`` is rank r's node; ``aggregators`` are ranks, at least one
    on every node; ``holders[f]`` the nodes whose burst buffer holds file f
    (empty: only the PFS has it).
    """
    req_rank = np.asarray(req_rank, dtype=np.int64)
    req_pos = np.asarray(req_pos, dtype=np.int64)
    req_sample = np.asarray(req_sample, dtype=np.int64)
    nodes = np.asarray(rank_node, dtype=np.int64)
    files = extents.file[req_sample].astype(np.int64)
    starts = extents.offset[req_sample].astype(np.int64)
    lengths = extents.length[req_sample].astype(np.int64)
    group = _group_of(nodes[req_rank], files, holders)
    agg_nodes = nodes[np.asarray(aggregators, dtype=np.int64)]
    # One byte space for all files: each starts on a stripe boundary.
    padded = -(-np.maximum(np.asarray(file_sizes, dtype=np.int64), 1) // stripe) * stripe
    file_base = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)

    range_rows: list[tuple[int, int, int, int]] = []  # aggregator, file, start, end
    req_range = np.zeros(req_rank.size, dtype=np.int64)  # index into range_rows
    for g in np.unique(group).tolist():
        members = np.flatnonzero(agg_nodes == g) if g != PFS_ONLY else np.arange(agg_nodes.size)
        in_group = np.flatnonzero(group == g)
        uniq = np.unique(np.stack([files[in_group], starts[in_group], lengths[in_group]]), axis=1)
        ranges = _merge(uniq[0], uniq[1], uniq[1] + uniq[2], max_hole, max_read)
        first = np.array([file_base[f] + s for f, s, _ in ranges], dtype=np.int64)
        last = np.array([file_base[f] + e for f, _, e in ranges], dtype=np.int64)
        lo, hi = int(first.min()), int(last.max())
        domain = -(-max(hi - lo, 1) // members.size)
        domain = -(-domain // stripe) * stripe
        owner = members[np.minimum((first - lo) // domain, members.size - 1)]
        # ranges are sorted by (file, start), so by ``first``: find each request's range
        where = np.searchsorted(first, file_base[files[in_group]] + starts[in_group], "right") - 1
        req_range[in_group] = len(range_rows) + where
        range_rows.extend(
            (int(a), f, s, e) for a, (f, s, e) in zip(owner.tolist(), ranges, strict=True)
        )

    # Reads: each range cut into pieces of at most max_read; an aggregator's
    # buffer holds its reads back to back in (file, offset) order, so the
    # pieces of one range are adjacent and a request's bytes are contiguous.
    order = sorted(range(len(range_rows)), key=lambda i: range_rows[i])
    read_rows: list[tuple[int, int, int, int, int]] = []
    range_buf = np.zeros(len(range_rows), dtype=np.int64)
    filled: dict[int, int] = {}
    for i in order:
        agg, f, s, e = range_rows[i]
        range_buf[i] = filled.get(agg, 0)
        for piece in range(s, e, max_read) if e > s else [s]:
            length = min(max_read, e - piece)
            read_rows.append((agg, f, piece, length, filled.get(agg, 0)))
            filled[agg] = filled.get(agg, 0) + length
    reads = np.array(read_rows, dtype=np.int64).reshape(-1, 5)
    ranges_arr = np.array(range_rows, dtype=np.int64).reshape(-1, 4)
    return ReadPlan(
        read_agg=reads[:, 0],
        read_file=reads[:, 1],
        read_offset=reads[:, 2],
        read_length=reads[:, 3],
        read_buf=reads[:, 4],
        req_rank=req_rank,
        req_pos=req_pos,
        req_agg=ranges_arr[req_range, 0] if req_rank.size else np.zeros(0, dtype=np.int64),
        req_buf=range_buf[req_range] + starts - ranges_arr[req_range, 2]
        if req_rank.size
        else np.zeros(0, dtype=np.int64),
        req_length=lengths,
        aggregators=tuple(int(a) for a in aggregators),
    )
