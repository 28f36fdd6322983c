"""``bbio verify SRC DST``: re-read both sides of a finished transfer and compare with its manifest.

The manifest is DST's (one per node when DST contains ``{node}``).  Each byte is
read once: a shared side's files are dealt out over all ranks, a per-node
side's files over the ranks of the node that holds them.  Caches are dropped
before reading, so the bytes come from the devices.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from bbio.config import Config, load_config
from bbio.errors import IntegrityError, NotFoundError
from bbio.mpi import agreed, deal, same_arguments, sum_over_ranks, topology
from bbio.report import format_bytes, format_table
from bbio.stage.walk import check_source, symlink_target
from bbio.transfer import files
from bbio.transfer.manifest import FILE, SYMLINK, Entry, Manifest

NODE = "{node}"
SOURCE, DESTINATION = "source", "destination"


@dataclasses.dataclass
class VerifyReport:
    """The outcome of a verification (the same on every rank)."""

    files: int
    bytes_read: int
    problems: list[str]

    def report(self) -> str:
        """A readable summary."""
        rows = [
            ("copies checked (both sides)", self.files),
            ("bytes read", format_bytes(self.bytes_read)),
            ("problems", len(self.problems)),
        ]
        return "bbio verify\n" + format_table(["", ""], rows)


def _check(root: Path, entry: Entry, side: str) -> tuple[int, str | None]:
    """(bytes read, problem or None) for one path of one side."""
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
            f"the manifest says {entry.size} bytes, {entry.crc32c or 0:08x}"
        )
    return size, None


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

    Either side may contain ``{node}`` (a per-node burst buffer).  Raises
    :class:`IntegrityError` naming every file that differs or is missing.
    """
    config = config or load_config()
    arguments = {"src": src, "dst": dst, "ranks_per_node": config.ranks_per_node}
    same_arguments(comm, "verify", arguments)
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
        checkable = [e for e in manifest.entries if e.kind in (FILE, SYMLINK)]

        def held_here(e: Entry) -> bool:
            return e.node is None or e.node == topo.node

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
        problems = sorted(
            p for part in comm.allgather([p for r in results for p in r[2]]) for p in part
        )
        if problems:
            raise IntegrityError(
                f"{len(problems)} difference(s): " + "; ".join(problems[:20]),
                hint="delete the differing destination copies, then rerun the transfer: it "
                "copies what is missing (a rerun alone keeps a copy whose size and mtime match)",
            )
        return VerifyReport(checked, read, problems)
    finally:
        topo.free()
