"""File domains of the collective read plan start and end on stripe boundaries.  Pure:
tested without MPI or files.

Before the fix only a domain's length was a multiple of the stripe: its edges were
offset by the group's first requested byte, so every domain edge fell inside a stripe
whenever that byte was not on a boundary (a header, or a request that starts mid-file).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bbio.read.plan import Extents, FixedExtents, Holders, make_plan
from tests.test_read_plan import execute, fake_files, plan_for


def first_offsets(plan) -> list[int]:
    """The first byte each aggregator reads (in file order), for the aggregators that read."""
    return [
        int(plan.read_offset[plan.read_agg == a].min())
        for a in range(len(plan.aggregators))
        if (plan.read_agg == a).any()
    ]


@pytest.mark.parametrize("base", [1, 100, 4095, 4097])
@pytest.mark.parametrize("aggregators", [2, 3, 4])
def test_every_domain_edge_is_a_stripe_boundary(base, aggregators):
    """One-byte samples, every one requested: each aggregator's first read starts exactly at
    its domain's edge, which must be a multiple of the stripe (4096)."""
    stripe, count = 4096, 40_000
    extents = FixedExtents(count=count, base=base, record=1)
    ids = np.arange(count)
    plan = make_plan(
        np.zeros(count, np.int64),
        ids,
        ids,
        extents,
        [0] * aggregators,
        list(range(aggregators)),
        Holders.none(1, 1),
        [base + count],
        stripe=stripe,
        max_hole=65536,
        max_read=1 << 24,
    )
    starts = first_offsets(plan)
    assert starts[0] == base  # the first domain holds the first requested byte
    assert len(starts) == aggregators
    edges = starts[1:]
    assert all(edge % stripe == 0 for edge in edges), edges  # before the fix: base + k * domain
    assert edges == sorted(edges)


def test_the_reviewers_example_puts_its_domain_edge_on_a_stripe_boundary():
    """/tmp/rev-read/align.py with one-byte records: a 100-byte header, then records; two
    aggregators.  Before the fix the edge was at 100 + 53,248 bytes; now at 53,248."""
    extents = FixedExtents(count=100_000, base=100, record=1)
    ids = np.arange(100_000)
    plan = make_plan(
        np.repeat([0, 1], 50_000),
        np.tile(np.arange(50_000), 2),
        ids,
        extents,
        [0, 1],
        [0, 1],
        Holders.none(2, 1),
        [100 + 100_000],
        stripe=4096,
        max_hole=65536,
        max_read=1 << 24,
    )
    assert first_offsets(plan) == [100, 13 * 4096]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stripe", [1, 64, 512, 4096])
def test_aligned_domains_still_give_every_request_exactly_its_bytes(seed, stripe):
    """Variable-size samples in several files, random requests from 4 ranks on 2 nodes: the
    bytes are right, and between one aggregator's extents and the next's there is a
    stripe boundary (in the byte space where every file starts on one)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(20_000, 60_000, 3).tolist()
    files = fake_files(sizes, seed=seed)
    file_idx, offsets, lengths = [], [], []
    for f, size in enumerate(sizes):
        at = int(rng.integers(0, 300))  # a header of its own
        while True:
            n = int(rng.integers(1, 700))
            if at + n > size:
                break
            file_idx.append(f)
            offsets.append(at)
            lengths.append(n)
            at += n + int(rng.integers(0, 50))
    extents = Extents(
        np.array(file_idx, np.int32), np.array(offsets, np.int64), np.array(lengths, np.int64)
    )
    requests = [rng.integers(0, len(extents), int(rng.integers(0, 80))) for _ in range(4)]
    plan = plan_for(
        requests,
        extents,
        files,
        rank_node=[0, 0, 1, 1],
        aggregators=[0, 1, 2, 3],
        stripe=stripe,
        max_hole=1 << 16,
        max_read=4096,
    )
    got = execute(plan, files)
    for r, ids in enumerate(requests):
        for p, i in enumerate(ids):
            f, off, n = extents.file[i], extents.offset[i], extents.length[i]
            assert got[(r, p)] == files[f][off : off + n].tobytes()
    padded = [-(-max(s, 1) // stripe) * stripe for s in sizes]
    base = np.concatenate([[0], np.cumsum(padded)[:-1]])
    ids = np.concatenate(requests).astype(np.int64)
    starts = base[extents.file[ids]] + extents.offset[ids]  # in the plan's one byte space
    spans = sorted(
        (int(starts[plan.req_agg == a].min()), int(starts[plan.req_agg == a].max()))
        for a in range(4)
        if (plan.req_agg == a).any()
    )
    for (_, last), (first, _) in itertools.pairwise(spans):
        assert last < first  # contiguous domains: each sample's start in one of them
        assert -(-(last + 1) // stripe) * stripe <= first  # a stripe boundary between them
