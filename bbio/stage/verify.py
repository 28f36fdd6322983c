"""``bbio verify SRC DST``: re-read both sides of a finished transfer and compare with its manifest.

The manifest is DST's (one per node when DST is a stage-in's copy: a path with
``{node}``, or a node-local path such as ``/local/nvme/x`` on real hosts).  Each byte is
read once: a shared side's files are dealt out over all ranks, a per-node
side's files over the ranks of the node that holds them.  Caches are dropped
before reading, so the bytes come from the devices.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from bbio.arguments import path_argument
from bbio.config import Config
from bbio.errors import IntegrityError, NotFoundError, UsageError
from bbio.mpi import agreed, agreed_config, deal, same_arguments, sum_over_ranks, topology
from bbio.report import format_bytes, format_table
from bbio.stage.walk import check_source, symlink_target
from bbio.transfer import files
from bbio.transfer.manifest import FILE, SYMLINK, Entry, Manifest

NODE = "{node}"
SOURCE, DESTINATION = "source", "destination"
DIFFERENCE_HINT = (
    "delete the differing destination copies, then rerun the transfer: it copies what is "
    "missing (a rerun alone keeps a copy whose size and mtime match)"
)
RERUN_HINT = "rerun the transfer until it succeeds: it copies what is missing or changed"


@dataclasses.dataclass
class VerifyReport:
    """The outcome of a verification (the same on every rank).  ``files``: the paths
    checked on both sides, every source and every node's copy counted once."""

    files: int
    bytes_read: int
    problems: list[str]

    def report(self) -> str:
        """A readable summary."""
        rows = [
            ("paths checked (sources and copies)", self.files),
            ("bytes read", format_bytes(self.bytes_read)),
            ("problems", len(self.problems)),
        ]
        return "bbio verify\n" + format_table(["", ""], rows)


def _check(root: Path, entry: Entry, side: str) -> tuple[int, str | None]:
    """(bytes read, problem or None) for one path of one side: a symlink, or a file whose
    CRC32C the manifest records."""
    path = root / entry.path
    if entry.kind == SYMLINK:
        try:
            target = symlink_target(root, entry.path) if side == SOURCE else os.readlink(path)
        except OSError as exc:
            return 0, f"{side} {path}: {exc.strerror}"
        return 0, None if target == entry.target else f"{side} {path}: points to {target}"
    try:
        size, crc = files.checksum_file(path, drop_cache=True)
    except FileNotFoundError:
        return 0, f"{side} {path}: missing"
    except OSError as exc:
        return 0, f"{side} {path}: {exc}"
    if size != entry.size or crc != entry.crc32c:
        return size, (
            f"{side} {path}: {size} bytes, CRC32C {crc:08x}; "
            f"the manifest says {entry.size} bytes, {entry.crc32c:08x}"
        )
    return size, None


def _unverifiable(manifest: Manifest, dst_root: Path, entries: Sequence[Entry]) -> list[str]:
    """Why ``manifest`` (of ``dst_root``) cannot vouch for the copy: the last transfer did
    not finish, and which of ``entries`` are files without a CRC32C.  Not collective.
    A finished copy that filtered or skipped files is checked for what it holds."""
    problems = []
    if manifest.attrs.get("unfinished"):
        problems.append(
            f"{files.manifest_path(dst_root)}: the copy is not complete: the last transfer "
            f"into {dst_root} failed or was interrupted, so it may lack files of the source "
            "or hold older versions of them"
        )
    problems.extend(
        f"{DESTINATION} {dst_root / e.path}: no CRC32C recorded (the file changed while it "
        "was transferred), so the copy cannot be checked"
        for e in entries
        if e.kind == FILE and e.crc32c is None
    )
    return problems


def _checks(comm, root: Path, entries: Sequence[Entry], side: str) -> tuple[int, int, list[str]]:
    checked = bytes_read = 0
    problems = []
    for entry in deal(entries, comm):
        n, problem = _check(root, entry, side)
        checked += 1
        bytes_read += n
        if problem:
            problems.append(problem)
    return checked, bytes_read, problems


def verify(
    comm, src: str | os.PathLike, dst: str | os.PathLike, config: Config | None = None
) -> VerifyReport:
    """Collective over ``comm``: compare SRC and DST with DST's manifest, by re-reading both.

    Either side may contain ``{node}`` (a per-node burst buffer); without it, the side
    a stage-in or stage-out left on every node (its destination, or its source) is
    still each node's own, as on real hosts.  Raises
    :class:`IntegrityError` naming every file that differs or is missing, every
    manifest a transfer left ``unfinished`` (it failed or was interrupted; a finished
    copy that filtered or skipped files is checked for what it holds) and every file
    it records no CRC32C for.
    """
    config = agreed_config(comm, "verify", config)
    arguments = {"src": src, "dst": dst, "ranks_per_node": config.ranks_per_node}
    same_arguments(comm, "verify", arguments)
    path_argument("verify: the source", src)
    path_argument("verify: the destination", dst)
    topo = topology(comm, config.ranks_per_node)
    try:
        src_per_node, dst_per_node = NODE in os.fspath(src), NODE in os.fspath(dst)
        src_root = config.expand(src, node=topo.node)
        dst_root = config.expand(dst, node=topo.node)
        manifest: Manifest | None = None
        with agreed(comm, "verify: reading the manifest"):
            check_source(src_root, topo.node if src_per_node else None)
            manifest = files.read_manifest(dst_root)
            if manifest is None:
                raise NotFoundError(
                    "no bbio manifest: nothing was staged here, or the transfer did not finish",
                    path=files.manifest_path(dst_root),
                    node=topo.node if dst_per_node else None,
                    hint="run the stage-in or stage-out command (again) first",
                )
        # A node-local side needs no {node} on real hosts (/local/nvme/x is each host's
        # own): the manifest tells which side a transfer left on every node.
        kinds = sorted(set(comm.allgather(manifest.kind)))
        if len(kinds) != 1:
            raise IntegrityError(
                f"the destination's manifests are of different transfers ({', '.join(kinds)})",
                path=files.manifest_path(dst_root),
                hint="verify each transfer against its own destination",
            )
        dst_per_node = dst_per_node or kinds[0] == "stage-in"
        src_per_node = src_per_node or kinds[0] == "stage-out"
        holders = {e.node for e in manifest.entries if e.node is not None}
        needed = max(comm.allgather(max(holders, default=-1) + 1))
        if needed > topo.nodes:  # a per-node side's files of the missing nodes: read by none
            raise UsageError(
                f"the transfer left files on {needed} nodes, and this verify runs on "
                f"{topo.nodes}: the files of the others would not be read",
                path=files.manifest_path(dst_root),
                hint="run bbio verify on as many nodes as the transfer (the same ranks per "
                "node), in the same allocation",
            )
        checkable = [
            e
            for e in manifest.entries
            if e.kind == SYMLINK or (e.kind == FILE and e.crc32c is not None)
        ]

        def held_here(e: Entry) -> bool:
            return e.node is None or e.node == topo.node

        unverifiable: list[str] = []  # one rank per manifest reports it
        if dst_per_node and topo.node_comm.Get_rank() == 0:
            mine = [e for e in manifest.entries if held_here(e)]
            unverifiable = _unverifiable(manifest, dst_root, mine)
        elif not dst_per_node and comm.Get_rank() == 0:
            unverifiable = _unverifiable(manifest, dst_root, manifest.entries)

        results = []
        with agreed(comm, "verify: re-reading"):
            if dst_per_node:
                mine = [e for e in checkable if held_here(e)]
                results.append(_checks(topo.node_comm, dst_root, mine, DESTINATION))
            else:
                results.append(_checks(comm, dst_root, checkable, DESTINATION))
            if src_per_node:
                mine = [e for e in checkable if held_here(e)]
                results.append(_checks(topo.node_comm, src_root, mine, SOURCE))
            else:
                results.append(_checks(comm, src_root, checkable, SOURCE))
        checked = sum(r[0] for r in results)
        read = sum(r[1] for r in results)
        checked, read = sum_over_ranks(comm, checked, read)
        parts = comm.allgather((unverifiable, [p for r in results for p in r[2]]))
        unverifiable = sorted(p for part, _ in parts for p in part)
        differences = sorted(p for _, part in parts for p in part)
        problems = unverifiable + differences
        if problems:
            more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
            hints = []
            if unverifiable:
                hints.append(RERUN_HINT)
            if differences:
                hints.append(DIFFERENCE_HINT)
            raise IntegrityError(
                f"{len(problems)} problem(s): " + "; ".join(problems[:20]) + more,
                hint="; ".join(hints),
            )
        return VerifyReport(checked, read, problems)
    finally:
        topo.free()
