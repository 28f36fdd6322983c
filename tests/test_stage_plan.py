"""Staging plans are pure functions: tested without MPI or files."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from bbio.errors import IntegrityError, NotDirectoryError
from bbio.stage import plan
from bbio.stage.plan import DestState, Piece
from bbio.stage.walk import check_source, selected
from bbio.transfer.files import is_temp_name, temp_name, temp_path, unique_temp_path
from bbio.transfer.manifest import DIR, FILE, SYMLINK, Entry, Manifest


def f(path: str, size: int, mtime: int = 1) -> Entry:
    return Entry(path, FILE, size=size, mtime_ns=mtime)


def test_up_to_date_compares_kind_size_mtime_and_target():
    src = f("a", 10, mtime=5)
    assert plan.up_to_date(src, DestState(FILE, 10, 5))
    assert not plan.up_to_date(src, None)
    assert not plan.up_to_date(src, DestState(FILE, 11, 5))
    assert not plan.up_to_date(src, DestState(FILE, 10, 6))
    assert not plan.up_to_date(src, DestState(DIR, 0, 5))
    link = Entry("l", SYMLINK, target="a")
    assert plan.up_to_date(link, DestState(SYMLINK, 0, 0, "a"))
    assert not plan.up_to_date(link, DestState(SYMLINK, 0, 0, "b"))


def test_to_chmod_lists_current_files_whose_source_mode_changed():
    entries = [
        Entry("d", DIR, mode=0o755),
        Entry("same", FILE, size=1, mtime_ns=1, mode=0o644),
        Entry("private", FILE, size=1, mtime_ns=1, mode=0o600),
        Entry("stale", FILE, size=2, mtime_ns=1, mode=0o600),  # copied again instead
        Entry("setgid", FILE, size=1, mtime_ns=1, mode=0o2644),  # only 0o777 is compared
        Entry("unknown", FILE, size=1, mtime_ns=1, mode=0o600),
        Entry("owner's", FILE, size=1, mtime_ns=1, mode=0o644),  # the copy's owner chmod-ed it
        Entry("unrecorded", FILE, size=1, mtime_ns=1, mode=0o600),
    ]
    dest = {
        "d": DestState(DIR, 0, 1),
        "same": DestState(FILE, 1, 1, mode=0o644),
        "private": DestState(FILE, 1, 1, mode=0o644),
        "stale": DestState(FILE, 1, 1, mode=0o644),
        "setgid": DestState(FILE, 1, 1, mode=0o644),
        "unknown": DestState(FILE, 1, 1),
        "owner's": DestState(FILE, 1, 1, mode=0o600),
        "unrecorded": DestState(FILE, 1, 1, mode=0o644),
    }
    recorded = {path: 0o644 for path in dest if path != "unrecorded"}
    assert [e.path for e in plan.to_chmod(entries, dest, recorded)] == ["private"]


def test_to_copy_skips_directories_and_current_files():
    entries = [Entry("d", DIR), f("d/a", 1), f("d/b", 2)]
    dest = {"d/a": DestState(FILE, 1, 1)}
    assert [e.path for e in plan.to_copy(entries, dest)] == ["d/b"]


def test_split_pieces_cuts_large_files_and_keeps_empty_ones():
    pieces = plan.split_pieces([f("a", 0), f("b", 10), f("c", 25), Entry("l", SYMLINK)], 10)
    assert pieces == [
        Piece("a", 0, 0),
        Piece("b", 0, 10),
        Piece("c", 0, 10),
        Piece("c", 10, 10),
        Piece("c", 20, 5),
    ]


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_partition_is_contiguous_complete_and_balanced(parts):
    pieces = plan.split_pieces([f(f"x{i:03d}", 1000 + 37 * i) for i in range(100)], 1 << 20)
    result = plan.partition(pieces, parts)
    assert len(result) == parts
    assert [p for part in result for p in part] == pieces
    costs = [sum(p.length + plan.FILE_COST_BYTES for p in part) for part in result]
    biggest = max(p.length + plan.FILE_COST_BYTES for p in pieces)
    assert max(costs) - min(costs) <= 2 * biggest


def test_partition_of_nothing():
    assert plan.partition([], 3) == [[], [], []]


def test_group_by_size():
    sizes = [5, 5, 5, 20, 1, 1]
    groups = plan.group_by_size(sizes, 10, lambda s: s)
    assert groups == [[5, 5], [5], [20], [1, 1]]
    assert plan.group_by_size([], 10, lambda s: s) == []


def test_commit_rounds_cover_every_file_once_in_path_order():
    cost = plan.FILE_COST_BYTES
    sizes = {f"f{i:02d}": 3 * cost for i in range(10)} | {"big": 50 * cost, "empty": 0}
    rounds = plan.commit_rounds(dict(reversed(sizes.items())), 8 * cost)
    assert [p for r in rounds for p in r] == sorted(sizes)  # every file once, in path order
    assert ["big"] in rounds  # larger than a round: a round of its own
    assert all(sum(sizes[p] + cost for p in r) <= 8 * cost for r in rounds if r != ["big"])
    assert len(rounds) == 1 + 1 + 5  # big; empty + f00; f01..f08 in pairs; f09
    assert plan.commit_rounds({}, 8 * cost) == []


def test_assign_nodes_balances_bytes_and_is_deterministic():
    files = [f(f"s{i}", (i % 10) * 1000 + 1) for i in range(200)]
    owner = plan.assign_nodes(files, 3)
    assert set(owner) == {e.path for e in files}
    loads = [sum(e.size for e in files if owner[e.path] == n) for n in range(3)]
    assert max(loads) - min(loads) <= 10_000
    assert plan.assign_nodes(list(reversed(files)), 3) == owner


def test_owners_are_ranks_of_first_pieces():
    by_rank = [[Piece("a", 0, 10), Piece("b", 0, 5)], [Piece("b", 5, 5), Piece("c", 0, 1)]]
    assert plan.owners(by_rank) == {"a": 0, "b": 0, "c": 1}


def test_merge_node_trees_dedupes_identical_and_reports_conflicts():
    node0 = [Entry("out", DIR), f("out/a", 1, 1), f("shared", 5, 9), f("clash", 3, 1)]
    node1 = [Entry("out", DIR), f("out/b", 1, 1), f("shared", 5, 9), f("clash", 4, 1)]
    chosen, conflicts = plan.merge_node_trees([node0, node1])
    assert chosen == {"out": 0, "out/a": 0, "shared": 0, "clash": 0, "out/b": 1}
    assert conflicts == [plan.Conflict("clash", (0, 1))]


def test_symlinks_to_one_target_made_at_different_times_are_no_conflict():
    """Before, two nodes' "latest -> ckpt-10", made a second apart, refused the stage-out."""
    node0 = [Entry("latest", SYMLINK, mtime_ns=1, target="ckpt-10")]
    node1 = [Entry("latest", SYMLINK, mtime_ns=2, target="ckpt-10")]
    node2 = [Entry("latest", SYMLINK, mtime_ns=2, target="ckpt-20")]
    assert plan.merge_node_trees([node0, node1]) == ({"latest": 0}, [])
    _, conflicts = plan.merge_node_trees([node0, node1, node2])
    assert conflicts == [plan.Conflict("latest", (0, 1, 2))]


def test_what_is_seen_through_a_destination_symlink_is_not_there():
    dest = {"a": DestState(DIR, 0, 1), "a/x": DestState(FILE, 3, 1)}
    dest |= {"b": DestState(SYMLINK, 0, 1, "a"), "b/x": DestState(FILE, 3, 1)}
    dest |= {"b/c/y": DestState(FILE, 1, 1), "bb/x": DestState(FILE, 1, 1)}
    assert sorted(plan.not_through_symlinks(dest)) == ["a", "a/x", "b", "bb/x"]


def test_files_held_alike_are_compared_by_checksum():
    trees = [[f("a", 3, 1), f("b", 3, 1)], [f("a", 3, 1), f("b", 4, 1)], [f("a", 3, 1)]]
    alike = plan.held_alike(trees)
    assert alike == {"a": (0, 1, 2)}  # b differs in size: merge_node_trees refuses it
    assert plan.differing_copies(alike, [{"a": 7}, {"a": 7}, {"a": 7}]) == []
    assert plan.differing_copies(alike, [{"a": 7}, {"a": 7}, {"a": 8}]) == [
        plan.Conflict("a", (0, 1, 2))
    ]


@pytest.mark.parametrize("file_node", [0, 1])
def test_a_file_on_one_node_and_a_directory_on_another_is_a_conflict(file_node):
    trees = [[Entry("x", DIR, mtime_ns=2), f("x/y", 1)], [f("x", 4)]]
    if file_node == 0:
        trees.reverse()
    _, conflicts = plan.merge_node_trees(trees)
    assert conflicts == [plan.Conflict("x", (0, 1))]


@pytest.mark.parametrize(
    ("path", "include", "exclude", "expected"),
    [
        ("a/b.jpg", [], [], True),
        ("a/b.jpg", ["*.jpg"], [], True),
        ("a/b.png", ["*.jpg"], [], False),
        ("logs/x.txt", [], ["logs/*"], False),
        ("a/logs/x.txt", [], ["logs/*"], True),
        ("a b/é.jpg", ["*.jpg"], ["*tmp*"], True),
    ],
)
def test_filters(path, include, exclude, expected):
    assert selected(path, include, exclude) is expected


def test_manifest_round_trip_and_rejection():
    manifest = Manifest(
        "stage-in",
        [f("a b/é", 3), Entry("l", SYMLINK, target="a b/é"), Entry("d", DIR, mode=0o700)],
        {"mode": "shard"},
    )
    back = Manifest.from_json(manifest.to_json(), "here")
    assert back.entries == manifest.entries
    assert back.attrs == {"mode": "shard"}
    assert back.total_bytes == 3
    with pytest.raises(IntegrityError, match="not a bbio manifest"):
        Manifest.from_json({"format": "other"}, "here")


@pytest.mark.parametrize("name", ["file.bin", "naïve é.txt", "x" * 255])
def test_temporary_names_sit_beside_the_file_and_fit_a_file_name(name):
    final = Path("/bb/dir a") / name
    temp = temp_path(final)
    assert temp.parent == final.parent
    assert is_temp_name(temp.name)
    assert len(os.fsencode(temp.name)) <= 255
    assert temp_name(str(final)) == str(temp)


# GlusterFS's DHT places a name on a brick by its hash, but a name matching its default
# rsync-hash-regex by the captured part: the rename then moves nothing between bricks.
GLUSTER_RSYNC_HASH_REGEX = r"\.(.+)\.[^.]+"


@pytest.mark.parametrize("name", ["global.h5", "manifest.json", "node-00001.json", "a b.bin"])
def test_temporary_names_hash_like_their_file_on_glusterfs(name):
    final = Path("/pfs/step") / name
    for temp in (temp_path(final), unique_temp_path(final), unique_temp_path(final)):
        assert is_temp_name(temp.name)
        assert re.fullmatch(GLUSTER_RSYNC_HASH_REGEX, temp.name).group(1) == name
    assert unique_temp_path(final) != unique_temp_path(final)


@pytest.mark.parametrize(
    "name", [".notes-bbio-part", ".a.b-bbio-part", ".x.12-abc-bbio-part", "a.12-0123abcd-bbio-part"]
)
def test_a_users_file_is_not_taken_for_a_temporary_one(name):
    assert not is_temp_name(name)


def test_without_drops_paths_and_what_is_below_them():
    entries = [Entry("a", DIR), f("a/x", 1), f("ab", 1), Entry("b", DIR), f("b/c/y", 1), f("z", 1)]
    kept = plan.without(entries, {"a", "b/c", "z"})
    assert [e.path for e in kept] == ["ab", "b"]
    assert plan.without(entries, set()) == entries


def test_without_is_linear_in_entries_and_unreadable_paths():
    """5,000 files and 5,000 unreadable ones: each entry's parents are looked up (a few
    milliseconds), not every unreadable path compared with every entry (about 20 s)."""
    entries = [f(f"d{i % 100}/ok{i}", 1) for i in range(5_000)]
    unreadable = {f"d{i % 100}/secret{i}" for i in range(5_000)}
    start = time.perf_counter()
    assert len(plan.without(entries, unreadable)) == 5_000
    assert time.perf_counter() - start < 1.0


def test_a_followed_symlink_keeps_what_is_seen_through_it():
    dest = {"l": DestState(SYMLINK, 0, 1, "/big/ckpt"), "l/x": DestState(FILE, 3, 1)}
    dest |= {"m": DestState(SYMLINK, 0, 1, "a"), "m/y": DestState(FILE, 1, 1)}
    assert sorted(plan.not_through_symlinks(dest, {"l"})) == ["l", "l/x", "m"]


def state(e: Entry) -> DestState:
    """What a destination holds after a copy of ``e``."""
    return DestState(e.kind, e.size, e.mtime_ns, e.target)


def test_stage_out_refuses_what_changed_since_bbio_wrote_or_read_it():
    staged_in, written = f("config.yaml", 10, mtime=5), f("results.txt", 7, mtime=6)
    source = [f("config.yaml", 10, mtime=5), f("results.txt", 9, mtime=8), f("new.txt", 1)]
    late = 4 * SECOND  # verify marks a damaged copy of it with mtime 0
    source += [f("theirs.txt", 4, mtime=9), f("marked.txt", 3, mtime=late)]
    source += [f("read.txt", 3, mtime=late), f("resized.txt", 3, mtime=late)]
    seen = {
        "config.yaml": DestState(FILE, 12, 7),  # the user's edit since the stage-in
        "results.txt": state(written),  # what the previous stage-out wrote: replaced
        "theirs.txt": DestState(FILE, 4, 3),  # no record: replaced, as cp does
        "marked.txt": DestState(FILE, 3, 0),  # verify marked bbio's damaged copy
        "read.txt": DestState(FILE, 3, 0),  # mtime 0, but bbio only read it: the user's
        "resized.txt": DestState(FILE, 5, 0),  # mtime 0, but not the size stage-out wrote
    }
    by_stage_out = {
        "results.txt": [f("results.txt", 5, mtime=2), written],
        "marked.txt": [f("marked.txt", 3, mtime=late)],
        "resized.txt": [f("resized.txt", 3, mtime=late)],
    }
    by_stage_in = {"config.yaml": [staged_in], "read.txt": [f("read.txt", 3, mtime=late)]}
    checked = plan.to_check(source, seen)
    assert checked == [e.path for e in source if e.path != "new.txt"]
    planned = plan.plan_destination(source, seen, by_stage_out, by_stage_in, (), False)
    assert planned.changed == ["config.yaml", "read.txt", "resized.txt"]
    assert planned.foreign_links == planned.in_the_way == []
    assert plan.plan_destination(source, seen, by_stage_out, by_stage_in, (), True).changed == []


def test_stage_out_replaces_a_users_symlink_or_file_in_the_way_only_if_told():
    source = [
        f("data.bin", 3),
        Entry("ln", SYMLINK, target="a"),
        Entry("ours", SYMLINK, target="b"),
    ]
    source += [Entry("x", DIR), f("x/f", 1)]
    seen = {
        "data.bin": DestState(SYMLINK, 0, 1, "/home/me/big.bin"),  # the user's, no record
        "ln": DestState(SYMLINK, 0, 1, "elsewhere"),  # the user's, no record
        "ours": DestState(SYMLINK, 0, 1, "old"),  # the copy of an earlier source symlink
        "x": DestState(FILE, 5, 1),  # where the source has a directory
    }
    by_stage_out = {"ours": [Entry("ours", SYMLINK, target="old")]}
    refused = plan.plan_destination(source, seen, by_stage_out, {}, (), overwrite=False)
    assert refused.foreign_links == ["data.bin -> /home/me/big.bin", "ln -> elsewhere"]
    assert refused.changed == [] and refused.in_the_way == ["x"]
    told = plan.plan_destination(source, seen, by_stage_out, {}, (), overwrite=True)
    assert told.foreign_links == told.changed == [] and told.in_the_way == ["x"]


def test_a_pending_record_the_manifest_names_is_spent():
    pending = Manifest("stage-out", [f("a", 1)], {plan.PENDING_TOKEN: "t1"})
    assert plan.live_pending(None, pending) is pending
    assert plan.live_pending(Manifest("stage-out", [], {"pending": "t0"}), pending) is pending
    assert plan.live_pending(Manifest("stage-out", [], {"pending": "t1"}), pending) is None
    assert plan.live_pending(Manifest("stage-out", [], {"pending": None}), None) is None
    untokened = Manifest("stage-out", [f("a", 1)])
    assert plan.live_pending(Manifest("stage-out", []), untokened) is untokened


def test_stage_out_follows_the_users_symlinks_to_directories_outside():
    source = [Entry("ckpt", DIR), f("ckpt/w", 3), Entry("stale", DIR), f("stale/x", 1)]
    source += [Entry("alias", DIR), f("alias/y", 1), Entry("fresh", DIR), Entry("kept", DIR)]
    seen = {
        "ckpt": DestState(SYMLINK, 0, 1, "/big/ckpt"),
        "ckpt/w": DestState(FILE, 3, 1),  # up to date through the symlink
        "stale": DestState(SYMLINK, 0, 1, "kept"),  # a copy of an earlier source symlink
        "stale/x": DestState(FILE, 1, 1),
        "alias": DestState(SYMLINK, 0, 1, "kept"),  # the user's, inside the destination
        "alias/y": DestState(FILE, 1, 1),
        "kept": DestState(DIR, 0, 1),
    }
    records = {"stale": [Entry("stale", SYMLINK, target="kept")]}
    for overwrite in (False, True):
        planned = plan.plan_destination(source, seen, records, {}, {"ckpt", "alias"}, overwrite)
        assert planned.followed == {"ckpt", "alias"}
        assert planned.replaced == {"stale"}
        assert planned.changed == planned.foreign_links == planned.in_the_way == []
        assert [e.path for e in plan.to_copy(source, planned.current)] == ["stale/x"]
        dirs = [e for e in source if e.kind == DIR]
        assert [d.path for d in plan.created_dirs(dirs, planned, ())] == ["stale", "fresh"]
    inside = plan.plan_destination(source, seen, records, {}, {"ckpt"}, overwrite=False)
    assert inside.foreign_links == ["alias -> kept"] and inside.changed == []
    replaced = plan.plan_destination(source, seen, records, {}, {"ckpt"}, overwrite=True)
    assert replaced.replaced == {"stale", "alias"} and replaced.foreign_links == []


def test_a_directory_an_interrupted_stage_out_made_is_finished_by_the_rerun():
    dirs = [Entry("made", DIR), Entry("theirs", DIR), Entry("now-a-link", DIR)]
    seen = {
        "made": DestState(DIR, 0, 1),
        "theirs": DestState(DIR, 0, 1),
        "now-a-link": DestState(SYMLINK, 0, 1, "/elsewhere"),
    }
    planned = plan.plan_destination(dirs, seen, {}, {}, {"now-a-link"}, overwrite=False)
    created = plan.created_dirs(dirs, planned, {"made", "now-a-link"})
    assert [d.path for d in created] == ["made"]


def test_a_manifest_without_kind_is_damaged_and_unknown_fields_are_ignored():
    document = Manifest("stage-in", [f("a", 3)], {"mode": "shard"}).to_json()
    document["entries"][0]["blake3"] = "from a newer bbio"
    document["index"] = {"from": "a newer bbio"}
    assert Manifest.from_json(document, "here").entries == [f("a", 3)]
    del document["kind"]
    with pytest.raises(IntegrityError, match="damaged manifest: no field 'kind'"):
        Manifest.from_json(document, "here")
    with pytest.raises(IntegrityError, match="damaged manifest"):
        Manifest.from_json({**document, "kind": "stage-in", "entries": [{"kind": "file"}]}, "h")


def test_the_hint_for_a_file_as_the_source_names_a_glob_that_matches_it(tmp_path):
    one = tmp_path / "run[1].h5"
    one.write_bytes(b"x")
    with pytest.raises(NotDirectoryError) as info:
        check_source(one)
    pattern = re.search(r"--include '([^']*)'", str(info.value)).group(1)
    assert selected(one.name, [pattern], [])  # before, 'run[1].h5' matched only run1.h5


def test_kind_changes_are_directories_against_anything_but_a_symlink():
    source = [Entry("f", DIR), f("d", 1), Entry("k", SYMLINK, target="kk"), Entry("s", DIR)]
    source += [f("same", 1), Entry("dd", DIR)]
    dest = {"f": DestState(FILE, 1, 1), "d": DestState(DIR, 0, 1), "k": DestState(DIR, 0, 1)}
    dest |= {"s": DestState(SYMLINK, 0, 1, "x"), "same": DestState(FILE, 2, 2)}
    dest |= {"dd": DestState(DIR, 0, 1)}
    assert plan.kind_changes(source, dest) == ["f", "d", "k"]  # s: replaced as it is


def test_shards_beyond_99999_stay_in_sample_order():
    """Before, the index listed shards by name: shard-100000.h5 before shard-10001.h5."""
    from bbio.stage.pack import ShardInfo, _in_sample_order, shard_name

    shards = [ShardInfo(shard_name(i), 1, i, 1, 0, 1, 0) for i in (100000, 10001, 9999, 99999)]
    assert [s.first_sample for s in sorted(shards, key=_in_sample_order)] == [
        9999,
        10001,
        99999,
        100000,
    ]


# ------------------------------------------------ mtimes kept at a coarser granularity

SECOND = 1_000_000_000


@pytest.mark.parametrize("granularity", plan.MTIME_GRANULARITIES_NS)
@pytest.mark.parametrize("rounding", ["truncated", "rounded up"])
def test_the_mtime_granularity_is_the_smallest_that_explains_what_was_read_back(
    granularity, rounding
):
    def kept(ns: int) -> int:
        down = ns - ns % granularity
        return down if rounding == "truncated" or down == ns else down + granularity

    assert plan.mtime_granularity((ns, kept(ns)) for ns in plan.MTIME_PROBES_NS) == granularity


def test_an_mtime_no_granularity_explains_is_compared_exactly():
    wrote = plan.MTIME_PROBES_NS[0]
    assert plan.mtime_granularity([(wrote, wrote + 3 * SECOND)]) == 1  # an FS that ignores utime
    assert plan.mtime_granularity([(wrote, wrote - wrote % 10)]) == 1  # 10 ns: none of ours


def test_a_copy_on_whole_seconds_is_up_to_date_and_recorded_only_within_a_second():
    source = f("a", 10, mtime=1_600_000_000_123_456_789)
    truncated = DestState(FILE, 10, 1_600_000_000 * SECOND)
    rounded_up = DestState(FILE, 10, 1_600_000_001 * SECOND)
    for copy in (truncated, rounded_up):
        assert not plan.up_to_date(source, copy)  # exact, as before: the bug on Lustre
        assert plan.up_to_date(source, copy, SECOND)
        assert plan.is_recorded(copy, [source], [], SECOND)
        assert plan.is_recorded(copy, [], [source], SECOND)
        assert not plan.is_recorded(copy, [source], [source])
    other_second = DestState(FILE, 10, 1_599_999_999 * SECOND)
    resized = DestState(FILE, 11, 1_600_000_000 * SECOND)
    for copy in (other_second, resized):
        assert not plan.up_to_date(source, copy, SECOND)
        assert not plan.is_recorded(copy, [source], [source], SECOND)
    assert plan.to_copy([source], {"a": truncated}, SECOND) == []
    assert plan.to_check([source], {"a": truncated}, SECOND) == []


def test_stage_out_onto_whole_seconds_refuses_only_what_changed_there():
    written = f("r.txt", 5, mtime=1_700_000_000_987_654_321)  # what the last stage-out wrote
    source = [f("r.txt", 6, mtime=1_700_000_100_000_000_001)]  # the job's new version
    seen = {"r.txt": DestState(FILE, 5, 1_700_000_000 * SECOND)}  # as the PFS keeps it
    planned = plan.plan_destination(source, seen, {"r.txt": [written]}, {}, (), False, SECOND)
    assert planned.changed == []
    exactly = plan.plan_destination(source, seen, {"r.txt": [written]}, {}, (), False)
    assert exactly.changed == ["r.txt"]  # before: bbio's own file was refused
    edited = {"r.txt": DestState(FILE, 5, 1_700_000_050 * SECOND)}  # the user's since
    planned = plan.plan_destination(source, edited, {"r.txt": [written]}, {}, (), False, SECOND)
    assert planned.changed == ["r.txt"]


SOURCE_MTIMES = (0, 1, SECOND - 1, SECOND, 2 * SECOND - 1, 2 * SECOND, -SECOND, 10**18 + 7)


@pytest.mark.parametrize("source_mtime", SOURCE_MTIMES)
def test_a_damaged_copys_mark_is_never_its_sources_mtime_whatever_the_granularities(source_mtime):
    """The mark is set by a run that found one granularity and read back by a run that may
    find another (a destination created by the first run): kept as it is by every file
    system, it is the source's at none.  Before, a source of mtime 0 was marked 1 ns, kept
    as 0 on whole seconds: the damaged copy was taken as up to date."""
    marker = plan.damaged_mtime(source_mtime)
    assert marker in (0, 4 * SECOND)
    for granularity in plan.MTIME_GRANULARITIES_NS:
        assert marker % granularity == 0  # kept as it is there
        assert not plan.same_mtime(marker, source_mtime, granularity)
        copy = DestState(FILE, 3, marker)
        assert plan.is_recorded(copy, [], [f("x", 3, source_mtime)], granularity)
        assert not plan.up_to_date(f("x", 3, source_mtime), copy, granularity)


def test_mtimes_are_one_within_the_granularity_whichever_side_keeps_it_coarsely():
    """rsync's --modify-window: a coarse source (a burst buffer of whole seconds) and its
    finer destination (the PFS original) are one too.  Before, only a stored mtime that
    was a multiple of the granularity could match."""
    fine, coarse = 1_700_000_000_123_456_789, 1_700_000_000 * SECOND
    for a, b in ((fine, coarse), (coarse, fine)):
        assert plan.same_mtime(a, b, SECOND)
        assert not plan.same_mtime(a, b, 1)
    assert not plan.same_mtime(fine, coarse - SECOND, SECOND)  # 1.12 s apart
    assert plan.same_mtime(fine, fine, 1)
    source = f("a", 10, mtime=coarse)
    assert plan.up_to_date(source, DestState(FILE, 10, fine), SECOND)


@pytest.mark.parametrize("granularity", plan.MTIME_GRANULARITIES_NS)
def test_a_trees_granularity_is_the_largest_that_divides_every_files_mtime(granularity):
    base = 1_700_000_002 * SECOND + 987_654_321
    mtimes = [base - base % granularity + k * granularity for k in range(1, 6)]
    tree = [Entry("d", DIR, mtime_ns=7), Entry("l", SYMLINK, target="d", mtime_ns=3)]
    tree += [f(f"d/{i}", 1, mtime=m) for i, m in enumerate(mtimes)]
    assert plan.tree_mtime_granularity(tree) == granularity


def test_a_tree_of_few_files_is_compared_exactly():
    few = [f(str(i), 1, mtime=(i + 1) * 2 * SECOND) for i in range(plan.MTIME_INFERENCE_MIN_FILES)]
    assert plan.tree_mtime_granularity(few) == 2 * SECOND
    assert plan.tree_mtime_granularity(few[1:]) == 1
    assert plan.tree_mtime_granularity([]) == 1


@pytest.mark.parametrize("kind", [FILE, SYMLINK])
@pytest.mark.parametrize("overwrite", [False, True])
def test_stage_out_refuses_a_file_or_symlink_where_the_pfs_has_a_directory(kind, overwrite):
    entry = f("a/res", 6) if kind == FILE else Entry("a/res", SYMLINK, target="big0")
    source = [Entry("a", DIR), entry, f("a/big0", 3)]
    seen = {"a": DestState(DIR, 0, 1), "a/res": DestState(DIR, 0, 1)}
    planned = plan.plan_destination(source, seen, {"a/res": [entry]}, {}, (), overwrite)
    assert planned.dirs_in_the_way == ["a/res"]
    assert planned.changed == planned.foreign_links == planned.in_the_way == []


def test_group_by_size_bounds_the_items_of_a_group():
    sizes = [0] * 5 + [3, 3]
    assert plan.group_by_size(sizes, 5, lambda n: n, max_items=3) == [[0, 0, 0], [0, 0, 3], [3]]
    assert plan.group_by_size(sizes, 5, lambda n: n) == [[0, 0, 0, 0, 0, 3], [3]]


@pytest.mark.parametrize("nodes", [1, 31, 32, 33, 1000])
def test_a_replicate_rounds_allgatherv_counts_fit_a_c_int(nodes):
    """Before, pieces of 64 MiB made rounds of 64 MiB per member: the displacements of 33
    members overflowed a C int (Open MPI 4.1 has no large-count calls)."""
    round_bytes = plan.replicate_round_bytes(nodes, 64 << 20)
    assert nodes * round_bytes <= plan.MPI_INT_MAX
    assert round_bytes == (64 << 20 if nodes < 32 else plan.MPI_INT_MAX // nodes)
    files = [f("big", nodes * (64 << 20) + 5), *(f(f"small{i}", 10) for i in range(600))]
    pieces = plan.split_pieces(files, min(64 << 20, round_bytes))
    parts = plan.partition(pieces, nodes * 2)
    for column in range(2):
        rounds = plan.replicate_rounds(pieces, nodes, 2, column, round_bytes)
        for node in range(nodes):  # in order, all of its part
            read = [p for members in rounds for p in members[node]]
            assert read == parts[node * 2 + column]
        for members in rounds:
            counts = [sum(p.length for p in member) for member in members]
            assert len(members) == nodes and sum(counts) <= plan.MPI_INT_MAX
            assert all(len(member) <= plan.OPEN_FILES_AT_ONCE for member in members)
