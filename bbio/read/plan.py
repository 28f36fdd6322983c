"""The collective read plan: a pure function from every rank's requests to who reads what.

Inputs are plain arrays: each request is (rank, position in that rank's list,
sample id), and the dataset's extent table maps a sample to (file, offset,
length).  The plan:

1. groups requests by who should serve them: a rank's own node, when that
   node's burst buffer holds the file; the lowest node holding it otherwise;
   and every aggregator when only the PFS has it;
2. within a group, sorts the distinct extents by (file, offset), splits the
   group's accessed byte range into one contiguous *file domain* per
   aggregator of the group, every edge on a ``stripe`` boundary (the range's
   start rounded down to one, each domain a multiple of it), and gives each
   extent to the aggregator whose domain holds its start;
3. merges an aggregator's neighbouring extents into one range while the hole
   between them is at most ``max_hole`` bytes and at most ``hole_fraction``
   (10%) of the two neighbours' mean length: the holes then add at most 10%
   to the bytes needed, whatever the sample size and the density of the
   requests (a range never crosses a domain's edge, so dense requests are
   split among the aggregators too);
4. cuts ranges into reads of at most ``max_read`` bytes and places each
   aggregator's reads back to back in its buffer, in (file, offset) order, so
   the bytes of every request are contiguous there; it records, for every
   request, its aggregator and where its bytes start.

Everything is vectorised with NumPy.  From the result every rank derives what
it sends to and receives from every other rank.
:func:`split_rounds` cuts a plan into rounds, so that the aggregators read
round k+1 while the ranks exchange round k.  :func:`aggregation_pays` decides
whether the exchange is worth it at all: when merging saves little, every
rank reads its own samples directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

PFS_ONLY = -1
#: a hole is merged only up to this fraction of its neighbours' mean length
HOLE_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class Extents:
    """Where each sample's bytes are, as a table: ``file[i]``, ``offset[i]``, ``length[i]``."""

    file: np.ndarray  # int32
    offset: np.ndarray  # int64
    length: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.file.size)

    def take(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(file, offset, length) of the samples ``ids``, as int64 arrays.  Pure."""
        return (
            self.file[ids].astype(np.int64),
            self.offset[ids].astype(np.int64),
            self.length[ids].astype(np.int64),
        )

    def min_length(self) -> int:
        """The shortest sample's length (there is at least one sample).  Pure."""
        return int(self.length.min())


@dataclasses.dataclass(frozen=True)
class FixedExtents:
    """Where each sample's bytes are, computed: ``count`` records of ``record`` bytes back to
    back from byte ``base`` of file 0.  A few bytes for any count (a table would take 20
    bytes per sample on every rank)."""

    count: int
    base: int
    record: int

    def __len__(self) -> int:
        return self.count

    def take(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(file, offset, length) of the samples ``ids``, as int64 arrays.  Pure."""
        ids = np.asarray(ids, dtype=np.int64)
        return (
            np.zeros(ids.shape, dtype=np.int64),
            self.base + ids * self.record,
            np.full(ids.shape, self.record, dtype=np.int64),
        )

    def min_length(self) -> int:
        """Every sample's length.  Pure."""
        return self.record


#: a dataset's extents: a table (variable-size samples) or computed (fixed-size ones)
SampleExtents = Extents | FixedExtents


@dataclasses.dataclass(frozen=True)
class Holders:
    """Which node's burst buffer holds which file.

    ``holds[node, file]`` is True when that node holds it; ``lowest[file]`` is
    the lowest such node, or ``PFS_ONLY``.
    """

    holds: np.ndarray  # bool, (nodes, files)
    lowest: np.ndarray  # int64, (files,)

    @classmethod
    def from_sets(cls, nodes: int, files: int, held: Sequence[Sequence[int]]) -> Holders:
        """``held[node]`` lists the files that node holds."""
        holds = np.zeros((nodes, files), dtype=bool)
        for node, fs in enumerate(held):
            holds[node, np.asarray(list(fs), dtype=np.int64)] = True
        any_holder = holds.any(axis=0)
        lowest = np.where(any_holder, holds.argmax(axis=0), PFS_ONLY).astype(np.int64)
        return cls(holds, lowest)

    @classmethod
    def none(cls, nodes: int, files: int) -> Holders:
        """Only the PFS holds anything."""
        return cls.from_sets(nodes, files, [[] for _ in range(nodes)])


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """Who reads what, and where every request's bytes land.

    ``read_*`` arrays have one row per read: aggregator index (into
    ``aggregators``), file, offset, length, and offset in that aggregator's
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


def _empty_plan(aggregators: Sequence[int]) -> ReadPlan:
    nothing = np.zeros(0, dtype=np.int64)
    return ReadPlan(*([nothing] * 10), aggregators=tuple(int(a) for a in aggregators))


def make_plan(
    req_rank: np.ndarray,
    req_pos: np.ndarray,
    req_sample: np.ndarray,
    extents: SampleExtents,
    rank_node: Sequence[int],
    aggregators: Sequence[int],
    holders: Holders,
    file_sizes: Sequence[int],
    stripe: int,
    max_hole: int,
    max_read: int,
    hole_fraction: float = HOLE_FRACTION,
) -> ReadPlan:
    """Plan one collective read (see the module docstring).  Pure.

    ``rank_node[r]`` is rank r's node; ``aggregators`` are ranks, at least one
    on every node.
    """
    req_rank = np.asarray(req_rank, dtype=np.int64)
    if req_rank.size == 0:
        return _empty_plan(aggregators)
    req_pos = np.asarray(req_pos, dtype=np.int64)
    req_sample = np.asarray(req_sample, dtype=np.int64)
    nodes = np.asarray(rank_node, dtype=np.int64)
    files, starts, lengths = extents.take(req_sample)

    # 1. serving group per request
    req_node = nodes[req_rank]
    group = np.where(holders.holds[req_node, files], req_node, holders.lowest[files])

    # One byte space for all files: each starts on a stripe boundary.
    padded = -(-np.maximum(np.asarray(file_sizes, dtype=np.int64), 1) // stripe) * stripe
    file_base = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
    gstart = file_base[files] + starts
    gend = gstart + lengths

    # 2. distinct extents per group, sorted; each given to an aggregator by file domain
    order = np.lexsort((gend, gstart, group))
    g_s, s_s, e_s = group[order], gstart[order], gend[order]
    distinct = np.ones(order.size, dtype=bool)
    distinct[1:] = (g_s[1:] != g_s[:-1]) | (s_s[1:] != s_s[:-1]) | (e_s[1:] != e_s[:-1])
    g_u, s_u, e_u = g_s[distinct], s_s[distinct], e_s[distinct]
    f_u = files[order][distinct]

    # file domains: each group's accessed span, from the stripe boundary at or before its
    # first byte (files start on stripe boundaries of the byte space), split evenly among
    # its aggregators into stripe multiples, so every domain's edge is a stripe boundary;
    # an extent goes to the aggregator whose domain holds its start
    agg_nodes = nodes[np.asarray(aggregators, dtype=np.int64)]
    a_u = np.zeros(s_u.size, dtype=np.int64)
    for g in np.unique(g_u).tolist():
        members = np.flatnonzero(agg_nodes == g) if g != PFS_ONLY else np.arange(agg_nodes.size)
        sel = np.flatnonzero(g_u == g)
        lo, hi = int(s_u[sel].min()), int(e_u[sel].max())
        lo -= lo % stripe
        domain = -(-max(hi - lo, 1) // members.size)
        domain = -(-domain // stripe) * stripe
        a_u[sel] = members[np.minimum((s_u[sel] - lo) // domain, members.size - 1)]

    # 3. neighbours of one aggregator merged into ranges (never across a domain's edge:
    # a dense request would otherwise become one range, read by one aggregator).
    # (Overlapping extents, which samples rarely are, may start a range inside the
    # previous one: both are read, which is wasteful but correct.)
    new_range = np.ones(g_u.size, dtype=bool)
    hole = s_u[1:] - e_u[:-1]
    affordable = hole_fraction * ((e_u[1:] - s_u[1:]) + (e_u[:-1] - s_u[:-1])) / 2
    new_range[1:] = (
        (g_u[1:] != g_u[:-1])
        | (a_u[1:] != a_u[:-1])
        | (f_u[1:] != f_u[:-1])
        | (hole > max_hole)
        | (hole > affordable)
    )
    range_id = np.cumsum(new_range) - 1
    r_start = s_u[new_range]
    r_end = np.maximum.reduceat(e_u, np.flatnonzero(new_range))
    r_file = f_u[new_range]
    r_agg = a_u[new_range]

    # 4. reads of at most max_read; each aggregator's buffer in (file, offset) order
    pieces = np.maximum(-(-(r_end - r_start) // max_read), 1)
    p_range = np.repeat(np.arange(r_start.size), pieces)
    p_index = np.arange(p_range.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    p_start = r_start[p_range] + p_index * max_read
    p_len = np.minimum(r_end[p_range] - p_start, max_read)
    p_agg = r_agg[p_range]
    by_agg = np.argsort(p_agg, kind="stable")  # pieces are in (file, offset) order already
    p_buf = np.zeros(p_range.size, dtype=np.int64)
    sorted_len = p_len[by_agg]
    sorted_agg = p_agg[by_agg]
    running = np.cumsum(sorted_len) - sorted_len
    first_of_agg = np.searchsorted(sorted_agg, sorted_agg, side="left")
    p_buf[by_agg] = running - running[first_of_agg]
    range_buf = p_buf[np.cumsum(pieces) - pieces]  # buffer offset of each range's first piece

    # where each request's bytes start: its range's buffer offset plus its offset in the range
    req_range = np.empty(order.size, dtype=np.int64)
    req_range[order] = range_id[np.cumsum(distinct) - 1]
    return ReadPlan(
        read_agg=p_agg,
        read_file=r_file[p_range],
        read_offset=p_start - file_base[r_file[p_range]],
        read_length=p_len,
        read_buf=p_buf,
        req_rank=req_rank,
        req_pos=req_pos,
        req_agg=r_agg[req_range],
        req_buf=range_buf[req_range] + gstart - r_start[req_range],
        req_length=lengths,
        aggregators=tuple(int(a) for a in aggregators),
    )


#: the longest block an MPI datatype takes (its block lengths are C ints)
MPI_BLOCK_BYTES = 2**31 - 1


def split_blocks(
    lengths: np.ndarray, displacements: np.ndarray, limit: int = MPI_BLOCK_BYTES
) -> tuple[np.ndarray, np.ndarray]:
    """Blocks (bytes at displacements) cut into blocks of at most ``limit`` bytes, in order,
    for an MPI indexed datatype: the same bytes.  Pure."""
    lengths = np.asarray(lengths, dtype=np.int64)
    displacements = np.asarray(displacements, dtype=np.int64)
    pieces = np.maximum(-(-lengths // limit), 1)
    if int(pieces.max(initial=1)) == 1:
        return lengths, displacements
    index = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    start = np.repeat(displacements, pieces) + index * limit
    end = np.repeat(displacements + lengths, pieces)
    return np.minimum(end - start, limit), start


@dataclasses.dataclass(frozen=True)
class Rounds:
    """A plan cut into rounds: ``read_round[i]`` and ``req_round[j]`` in ``range(count)``."""

    read_round: np.ndarray
    req_round: np.ndarray
    count: int


def split_rounds(plan: ReadPlan, round_bytes: int, max_rounds: int = 8) -> Rounds:
    """Cut every aggregator's reads into the same number of rounds, in buffer order.  Pure.

    While the ranks exchange round k, the aggregators read round k+1.  The
    count is what the busiest aggregator needs for rounds of about
    ``round_bytes`` (at most ``max_rounds``); each aggregator's reads are split
    by bytes.  A request (which may span several reads, cut at ``max_read``)
    belongs to the round of the read that holds its last byte, the latest.
    """
    reads, requests = plan.read_length.size, plan.req_length.size
    if reads == 0:
        return Rounds(np.zeros(0, np.int64), np.zeros(requests, np.int64), 1)
    aggs = len(plan.aggregators)
    per_agg = np.bincount(plan.read_agg, weights=plan.read_length, minlength=aggs)
    count = int(min(max_rounds, max(1, -(-int(per_agg.max()) // round_bytes))))
    read_round = np.zeros(reads, dtype=np.int64)
    req_round = np.zeros(requests, dtype=np.int64)
    if count == 1:
        return Rounds(read_round, req_round, 1)
    for agg in range(aggs):
        mine = np.flatnonzero(plan.read_agg == agg)
        if mine.size == 0:
            continue
        mine = mine[np.argsort(plan.read_buf[mine], kind="stable")]
        lengths = plan.read_length[mine]
        before = np.cumsum(lengths) - lengths
        read_round[mine] = before * count // max(int(lengths.sum()), 1)
        served = np.flatnonzero(plan.req_agg == agg)
        last_byte = plan.req_buf[served] + np.maximum(plan.req_length[served] - 1, 0)
        holder = np.searchsorted(plan.read_buf[mine], last_byte, side="right") - 1
        req_round[served] = read_round[mine[holder]]
    return Rounds(read_round, req_round, count)


def reads_alone(extents: SampleExtents, holders: Holders, direct_bytes: int) -> bool:
    """Can every rank read its own samples, with no requests or bytes exchanged?  Pure.

    True when every sample is at least ``direct_bytes`` long (such a read is
    already large for the PFS: merging would save little and the exchange
    would copy every byte once more) and no file sits in some nodes' burst
    buffers but not in others' (those samples must travel).  The answer
    depends only on the dataset, so every rank reaches it without asking the
    others.  ``direct_bytes`` 0: never.
    """
    if direct_bytes <= 0 or len(extents) == 0:
        return False
    held_somewhere = holders.holds.any(axis=0)
    held_everywhere = holders.holds.all(axis=0)
    return bool(extents.min_length() >= direct_bytes and (held_everywhere | ~held_somewhere).all())


def aggregation_pays(
    plan: ReadPlan,
    req_rank: np.ndarray,
    req_sample: np.ndarray,
    extents: SampleExtents,
    rank_node: Sequence[int],
    holders: Holders,
    min_saving: float,
) -> bool:
    """Should this collective read go through the aggregators?  Pure.

    Aggregating costs an exchange over MPI; it pays when merging saves at
    least ``min_saving`` (a fraction) of the read requests the ranks would
    issue on their own, or when a request must be served by another node's
    burst buffer.  Otherwise every rank reads its own samples directly.  A
    ``min_saving`` of 0 always aggregates.
    """
    req_rank = np.asarray(req_rank, dtype=np.int64)
    if req_rank.size == 0:
        return False
    if min_saving <= 0:
        return True
    files = extents.take(np.asarray(req_sample, dtype=np.int64))[0]
    req_node = np.asarray(rank_node, dtype=np.int64)[req_rank]
    remote = (holders.lowest[files] != PFS_ONLY) & ~holders.holds[req_node, files]
    if remote.any():
        return True
    return plan.requests_issued <= (1.0 - min_saving) * req_rank.size
