"""The collective read plan and the sampler are pure: tested without MPI or files."""

from __future__ import annotations

import numpy as np
import pytest

from bbio.read import sampler
from bbio.read.plan import (
    Extents,
    FixedExtents,
    Holders,
    aggregation_pays,
    make_plan,
    reads_alone,
    split_blocks,
    split_rounds,
)


def fake_files(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]


def fixed_extents(files, sample):
    file_idx, offsets = [], []
    for f, data in enumerate(files):
        for off in range(0, data.size - sample + 1, sample):
            file_idx.append(f)
            offsets.append(off)
    n = len(offsets)
    return Extents(
        np.array(file_idx, np.int32), np.array(offsets, np.int64), np.full(n, sample, np.int64)
    )


def execute(plan, files):
    """Run a plan on in-memory 'files': return every request's bytes, by (rank, pos)."""
    buffers = {}
    for agg in range(len(plan.aggregators)):
        buffers[agg] = np.zeros(plan.buffer_bytes(agg), dtype=np.uint8)
    for a, f, off, length, buf in zip(
        plan.read_agg,
        plan.read_file,
        plan.read_offset,
        plan.read_length,
        plan.read_buf,
        strict=True,
    ):
        chunk = files[f][off : off + length]
        buffers[a][buf : buf + chunk.size] = chunk
    got = {}
    for r, p, a, buf, length in zip(
        plan.req_rank, plan.req_pos, plan.req_agg, plan.req_buf, plan.req_length, strict=True
    ):
        got[(int(r), int(p))] = buffers[a][buf : buf + length].tobytes()
    return got


def plan_for(requests, extents, files, *, rank_node, aggregators, holders=None, **kw):
    counts = [len(r) for r in requests]
    settings = {"stripe": 4096, "max_hole": 0, "max_read": 1 << 20, "hole_fraction": 0.1, **kw}
    return make_plan(
        np.repeat(np.arange(len(requests)), counts),
        np.concatenate([np.arange(c) for c in counts]),
        np.concatenate([np.asarray(r, dtype=np.int64) for r in requests]),
        extents,
        rank_node,
        aggregators,
        holders or Holders.none(max(rank_node) + 1, len(files)),
        [f.size for f in files],
        settings["stripe"],
        settings["max_hole"],
        settings["max_read"],
        settings["hole_fraction"],
    )


@pytest.mark.parametrize("max_hole", [0, 300, 1 << 20])
@pytest.mark.parametrize("max_read", [64, 1000, 1 << 20])
def test_every_request_gets_exactly_its_bytes(max_hole, max_read):
    files = fake_files([10_000, 7_000, 3_000], seed=1)
    extents = fixed_extents(files, 100)
    rng = np.random.default_rng(2)
    requests = [rng.integers(0, len(extents), size) for size in (7, 0, 13, 5)]
    requests[3][:2] = requests[0][:2]  # the same samples from two ranks
    requests[2][-1] = requests[2][0]  # and twice from one rank
    plan = plan_for(
        requests,
        extents,
        files,
        rank_node=[0, 0, 1, 1],
        aggregators=[0, 2],
        max_hole=max_hole,
        max_read=max_read,
    )
    got = execute(plan, files)
    for r, ids in enumerate(requests):
        for p, i in enumerate(ids):
            f, off, n = extents.file[i], extents.offset[i], extents.length[i]
            assert got[(r, p)] == files[f][off : off + n].tobytes()
    if max_read >= 100:
        assert all(length <= max_read for length in plan.read_length)


def test_neighbours_merge_up_to_the_hole_size_and_each_byte_is_read_once():
    files = fake_files([100_000])
    extents = fixed_extents(files, 100)
    requests = [[0, 1, 2], [5, 50], [3]]
    tight = plan_for(requests, extents, files, rank_node=[0, 0, 0], aggregators=[0])
    assert tight.requests_issued == 3  # 0-3 adjacent, then 5, then 50
    assert tight.bytes_read == 600
    loose = plan_for(
        requests,
        extents,
        files,
        rank_node=[0, 0, 0],
        aggregators=[0],
        max_hole=200,
        hole_fraction=1,
    )
    assert loose.requests_issued == 2  # 0-5 with a 100-byte hole, then 50
    assert loose.bytes_read == 700
    # by default a hole is merged only up to 10% of its neighbours' mean length
    thrifty = plan_for(requests, extents, files, rank_node=[0, 0, 0], aggregators=[0], max_hole=200)
    assert thrifty.requests_issued == 3 and thrifty.bytes_read == 600


def test_computed_extents_plan_exactly_as_their_table():
    """A fixed-size layout's extents are computed from the id, in a few bytes: the same
    places, the same decisions and the same plan as the table (20 bytes per sample)."""
    files = fake_files([10_008])
    table = Extents(
        np.zeros(100, np.int32), 8 + np.arange(100, dtype=np.int64) * 100, np.full(100, 100)
    )
    computed = FixedExtents(count=100, base=8, record=100)
    ids = np.array([99, 0, 41, 41, 7])
    assert len(computed) == len(table) == 100 and computed.min_length() == table.min_length()
    assert all(
        np.array_equal(a, b) for a, b in zip(computed.take(ids), table.take(ids), strict=True)
    )
    requests = [[0, 1, 2], [5, 50], [99, 3]]
    plans = [
        plan_for(requests, extents, files, rank_node=[0, 0, 1], aggregators=[0, 2])
        for extents in (table, computed)
    ]
    assert plans[0].requests_issued == plans[1].requests_issued
    assert all(
        np.array_equal(getattr(plans[0], f), getattr(plans[1], f))
        for f in ("read_file", "read_offset", "read_length", "read_buf", "req_buf")
    )
    holders = Holders.none(2, 1)
    assert reads_alone(computed, holders, 100) and not reads_alone(computed, holders, 101)


@pytest.mark.parametrize("sample", [250, 2500, 114_660])
def test_holes_never_add_more_than_a_tenth_of_the_bytes_needed(sample):
    files = fake_files([sample * 4000], seed=8)
    extents = fixed_extents(files, sample)
    rng = np.random.default_rng(9)
    for density in (0.01, 0.3, 0.9):  # sparse to dense requests
        ids = rng.choice(len(extents), int(density * len(extents)), replace=False)
        requests = np.array_split(ids, 4)
        plan = plan_for(
            requests, extents, files, rank_node=[0, 0, 1, 1], aggregators=[0, 2], max_hole=1 << 16
        )
        needed = int(extents.length[ids].sum())
        assert needed <= plan.bytes_read <= 1.1 * needed
        if density == 0.9:  # dense: neighbours still merge
            assert plan.requests_issued < ids.size / 2


def test_file_domains_split_the_work_between_aggregators():
    files = fake_files([1 << 20])
    extents = fixed_extents(files, 1024)
    requests = [list(range(0, 1024, 8)), [], [], []]
    plan = plan_for(requests, extents, files, rank_node=[0, 0, 1, 1], aggregators=[0, 1, 2, 3])
    per_agg = [int((plan.read_agg == a).sum()) for a in range(4)]
    assert all(count > 0 for count in per_agg)
    for a in range(4):  # contiguous domains: every read of agg a precedes those of a+1
        mine = plan.read_offset[plan.read_agg == a]
        if a < 3:
            assert mine.max() < plan.read_offset[plan.read_agg == a + 1].min()


@pytest.mark.parametrize("max_hole", [0, 1 << 20])
def test_dense_requests_are_split_between_aggregators_too(max_hole):
    """Every sample of a file, back to back: merged whole, it would be one range read by
    one aggregator."""
    files = fake_files([1 << 20])
    extents = fixed_extents(files, 1024)
    requests = [list(range(r, 1024, 4)) for r in range(4)]
    plan = plan_for(
        requests,
        extents,
        files,
        rank_node=[0, 1, 2, 3],
        aggregators=[0, 1, 2, 3],
        max_hole=max_hole,
    )
    per_agg = [int(plan.read_length[plan.read_agg == a].sum()) for a in range(4)]
    assert per_agg == [1 << 18] * 4
    got = execute(plan, files)
    for r, ids in enumerate(requests):
        for p, i in enumerate(ids):
            assert got[(r, p)] == files[0][i * 1024 : (i + 1) * 1024].tobytes()


def test_blocks_longer_than_an_mpi_int_are_cut_in_order():
    lengths, displacements = split_blocks([5, 0, 12, 3], [100, 7, 200, 0], limit=4)
    assert lengths.tolist() == [4, 1, 0, 4, 4, 4, 3]
    assert displacements.tolist() == [100, 104, 7, 200, 204, 208, 0]
    big = (2**31 - 1) * 2 + 5  # a 4 GiB sample
    lengths, displacements = split_blocks([big], [8])
    assert lengths.tolist() == [2**31 - 1, 2**31 - 1, 5]
    assert displacements.tolist() == [8, 8 + 2**31 - 1, 8 + 2 * (2**31 - 1)]


@pytest.mark.parametrize("round_bytes", [1, 500, 3000, 1 << 30])
def test_rounds_cut_each_aggregator_buffer_in_order_and_keep_requests_whole(round_bytes):
    files = fake_files([50_000, 20_000], seed=4)
    extents = fixed_extents(files, 100)
    rng = np.random.default_rng(5)
    requests = [rng.integers(0, len(extents), size) for size in (40, 3, 25, 0)]
    plan = plan_for(
        requests,
        extents,
        files,
        rank_node=[0, 0, 1, 1],
        aggregators=[0, 2],
        max_read=650,
        max_hole=1 << 20,
        hole_fraction=1e9,
    )
    rounds = split_rounds(plan, round_bytes, max_rounds=8)
    per_agg = [plan.buffer_bytes(a) for a in range(2)]
    assert rounds.count == min(8, max(1, -(-max(per_agg) // round_bytes)))
    for a in range(2):
        mine = np.flatnonzero(plan.read_agg == a)
        mine = mine[np.argsort(plan.read_buf[mine])]
        assert np.all(np.diff(rounds.read_round[mine]) >= 0)  # buffer order
        if per_agg[a] >= rounds.count * 650:  # enough bytes: no round is empty
            assert set(rounds.read_round[mine].tolist()) == set(range(rounds.count))
    straddling = 0
    for j in range(plan.req_length.size):  # every read a request needs is done by its round
        a, start, end = plan.req_agg[j], plan.req_buf[j], plan.req_buf[j] + plan.req_length[j]
        overlaps = (
            (plan.read_agg == a)
            & (plan.read_buf < end)
            & (plan.read_buf + plan.read_length > start)
        )
        straddling += int(overlaps.sum() > 1)
        assert rounds.req_round[j] == rounds.read_round[overlaps].max()
    assert straddling > 0  # max_read 650 cuts some 100-byte samples in two


def test_rounds_of_an_empty_plan():
    files = fake_files([1000])
    plan = plan_for([[], []], fixed_extents(files, 100), files, rank_node=[0, 0], aggregators=[0])
    rounds = split_rounds(plan, 10)
    assert rounds.count == 1 and rounds.read_round.size == 0 and rounds.req_round.size == 0


def test_files_in_a_nodes_burst_buffer_are_served_by_that_node():
    files = fake_files([50_000, 50_000])
    extents = fixed_extents(files, 500)
    holders = Holders.from_sets(2, 2, [[0], [0, 1]])  # file 0 everywhere, file 1 on node 1 only
    requests = [[0, 150], [1], [2, 160], [3]]  # ranks 0,1 on node 0; 2,3 on node 1
    plan = plan_for(
        requests,
        extents,
        files,
        rank_node=[0, 0, 1, 1],
        aggregators=[0, 2],
        holders=holders,
    )
    agg_node = {0: 0, 1: 1}
    for r, p, a, f in zip(
        plan.req_rank,
        plan.req_pos,
        plan.req_agg,
        extents.file[[*requests[0], *requests[1], *requests[2], *requests[3]]],
        strict=True,
    ):
        node = 0 if r < 2 else 1
        expected = node if f == 0 else 1
        assert agg_node[int(a)] == expected, (r, p, f)
    got = execute(plan, files)
    assert got[(0, 1)] == files[1][25_000:25_500].tobytes()


def decide(requests, extents, files, holders, min_saving):
    plan = plan_for(
        requests, extents, files, rank_node=[0, 0, 1, 1], aggregators=[0, 2], holders=holders
    )
    req_rank = np.repeat(np.arange(len(requests)), [len(r) for r in requests])
    samples = np.concatenate([np.asarray(r, dtype=np.int64) for r in requests])
    return aggregation_pays(plan, req_rank, samples, extents, [0, 0, 1, 1], holders, min_saving)


def test_aggregation_pays_when_it_merges_enough_or_data_is_on_another_node():
    files = fake_files([50_000, 50_000])
    extents = fixed_extents(files, 500)  # 100 samples per file
    pfs = Holders.none(2, 2)
    scattered = [[0, 10], [20, 30], [40, 50], [60, 70]]  # nothing touches: no request saved
    assert not decide(scattered, extents, files, pfs, 0.1)
    assert decide(scattered, extents, files, pfs, 0.0)  # 0: always aggregate
    shared = [[0, 10], [0, 10], [40, 50], [40, 50]]  # half the requests are duplicates
    assert decide(shared, extents, files, pfs, 0.5) and not decide(shared, extents, files, pfs, 0.6)
    neighbours = [[0, 1], [2, 3], [4, 5], [6, 7]]  # all touch: one read
    assert decide(neighbours, extents, files, pfs, 0.8)
    on_node_1 = Holders.from_sets(2, 2, [[], [1]])  # file 1 only in node 1's burst buffer
    far = [[100], [0], [0], [0]]  # rank 0 (node 0) wants sample 100 of file 1
    assert decide(far, extents, files, on_node_1, 1.0)
    near = [[0], [0], [100], [101]]  # node 1's ranks read their own burst buffer
    assert not decide(near, extents, files, on_node_1, 1.0)
    assert not decide([[], [], [], []], extents, files, pfs, 0.1)
    # samples cut into several reads (max_read below the sample size): 0 still aggregates
    plan = plan_for(
        scattered, extents, files, rank_node=[0, 0, 1, 1], aggregators=[0, 2], max_read=200
    )
    req_rank, samples = np.repeat(np.arange(4), 2), np.concatenate(scattered)
    assert plan.requests_issued > samples.size
    assert aggregation_pays(plan, req_rank, samples, extents, [0, 0, 1, 1], pfs, 0.0)
    assert not aggregation_pays(plan, req_rank, samples, extents, [0, 0, 1, 1], pfs, 0.1)


def test_no_requests_at_all():
    files = fake_files([1000])
    plan = plan_for([[], []], fixed_extents(files, 10), files, rank_node=[0, 0], aggregators=[0])
    assert plan.requests_issued == 0 and plan.req_rank.size == 0


# ------------------------------------------------------------------ sampler


@pytest.mark.parametrize("n", [0, 1, 10, 97])
@pytest.mark.parametrize("replicas", [1, 3, 4])
@pytest.mark.parametrize("batch", [1, 8])
def test_an_epoch_delivers_every_sample_exactly_once(n, replicas, batch):
    steps = sampler.epoch_batches(
        n, replicas, batch, seed=5, epoch=1, shuffle=True, drop_last=False
    )
    assert len(steps) == sampler.steps_per_epoch(n, replicas, batch, False)
    delivered = np.concatenate([b for step in steps for b in step]) if steps else np.zeros(0)
    assert sorted(delivered.tolist()) == list(range(n))
    assert all(len(step) == replicas for step in steps)


def test_the_split_is_distributed_samplers_round_robin():
    # DistributedSampler(dataset of 10, num_replicas=3, shuffle=False, drop_last=True) gives
    # rank 0: [0, 3, 6], rank 1: [1, 4, 7], rank 2: [2, 5, 8].
    order = sampler.epoch_order(10, seed=0, epoch=0, shuffle=False)
    assert [sampler.rank_indices(order, 3, r, True).tolist() for r in range(3)] == [
        [0, 3, 6],
        [1, 4, 7],
        [2, 5, 8],
    ]
    # without drop_last bbio does not pad: rank 0 gets the 10th sample, no one repeats
    assert [sampler.rank_indices(order, 3, r, False).tolist() for r in range(3)] == [
        [0, 3, 6, 9],
        [1, 4, 7],
        [2, 5, 8],
    ]


def test_drop_last_gives_full_batches_only_and_the_shuffle_depends_on_seed_and_epoch():
    steps = sampler.epoch_batches(103, 4, 5, seed=1, epoch=0, shuffle=True, drop_last=True)
    assert len(steps) == 5 and all(len(b) == 5 for step in steps for b in step)
    first = sampler.epoch_order(103, 1, 0, True)
    assert np.array_equal(first, sampler.epoch_order(103, 1, 0, True))
    assert not np.array_equal(first, sampler.epoch_order(103, 1, 1, True))
    assert not np.array_equal(first, sampler.epoch_order(103, 2, 0, True))


def test_ranks_read_alone_only_large_samples_that_need_not_travel():
    files = fake_files([50_000, 50_000])
    extents = fixed_extents(files, 500)
    pfs = Holders.none(2, 2)
    assert reads_alone(extents, pfs, 500) and not reads_alone(extents, pfs, 501)
    assert not reads_alone(extents, pfs, 0)  # 0: never
    assert reads_alone(extents, Holders.from_sets(2, 2, [[0, 1], [0, 1]]), 500)  # replicated
    assert not reads_alone(extents, Holders.from_sets(2, 2, [[0], [1]]), 500)  # sharded
    assert not reads_alone(Extents(*(np.zeros(0, dtype=t) for t in "iqq")), pfs, 1)  # empty
    varied = Extents(np.zeros(3, np.int32), np.array([0, 600, 1300]), np.array([600, 700, 499]))
    assert reads_alone(varied, Holders.none(2, 1), 499) and not reads_alone(varied, pfs, 500)
