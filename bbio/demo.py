"""The main job: ``mpirun -n 4 python -m bbio.demo`` (what ``make demo`` runs).

With built-in defaults it puts a "PFS" and per-node "BB" directories under
``work/demo`` in the current directory, splits the 4 ranks into 2 virtual
nodes, generates a small dataset on the PFS, copies it into every node's BB
with the native copy (CRC32C in the same pass), verifies every copy by
re-reading it, and prints a report.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from bbio import _native
from bbio.config import Config, load_config
from bbio.mpi import Topology, abort_on_error, agreed, topology
from bbio.report import format_bytes, format_table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The demo's options; every one has a built-in default."""
    parser = argparse.ArgumentParser(prog="python -m bbio.demo", description=__doc__)
    parser.add_argument("--root", default="work/demo", help="where the PFS and BB directories go")
    parser.add_argument("--files", type=int, default=64, help="files in the generated dataset")
    parser.add_argument("--file-size", type=int, default=256 << 10, help="mean bytes per file")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=2,
        help="ranks per virtual node; 0: nodes are the real hosts (on a cluster)",
    )
    parser.add_argument(
        "--bb-root", help="burst buffer directory, may contain {node} (default: ROOT/bb/node{node})"
    )
    return parser.parse_args(argv)


def demo_config(args: argparse.Namespace) -> Config:
    """The demo's settings: its own roots under ``--root``, virtual nodes."""
    root = Path(args.root).resolve()
    return load_config(
        bb_root=args.bb_root or str(root / "bb" / "node{node}"),
        pfs_root=str(root / "pfs"),
        ranks_per_node=args.ranks_per_node or None,
    )


def generate_dataset(directory: Path, files: int, mean_size: int, seed: int = 0) -> dict[str, int]:
    """Write ``files`` random files of varied sizes; return {name: CRC32C}.  Not collective."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    crcs = {}
    for i in range(files):
        size = int(rng.integers(0, 2 * mean_size))
        data = rng.integers(0, 256, size, dtype=np.uint8)
        name = f"sample_{i:05d}.bin"
        data.tofile(directory / name)
        crcs[name] = _native.crc32c(data)
    return crcs


def copy_to_node(
    topo: Topology, src: Path, dst: Path, names: list[str], expected: dict[str, int]
) -> tuple[int, int, float, int]:
    """Collective over ``topo.comm``: the ranks of each node split the files and copy them.

    Returns this rank's (files, bytes, seconds, mismatches); a mismatch is a
    copy whose CRC32C differs from the source's.
    """
    node_rank, node_size = topo.node_comm.Get_rank(), topo.node_comm.Get_size()
    mine = names[node_rank::node_size]
    copied = mismatches = 0
    with agreed(topo.comm, "creating the BB directories"):
        dst.mkdir(parents=True, exist_ok=True)
    topo.comm.Barrier()
    start = time.perf_counter()
    for name in mine:
        result = _native.copy_file(src / name, dst / name, checksum=True)
        copied += result.nbytes
        mismatches += result.crc32c != expected[name]
    seconds = time.perf_counter() - start
    return len(mine), copied, seconds, mismatches


def verify_node(dst: Path, names: list[str], expected: dict[str, int], node_comm) -> int:
    """Collective over ``node_comm``: re-read this node's copies; count CRC32C mismatches."""
    mine = names[node_comm.Get_rank() :: node_comm.Get_size()]
    bad = 0
    for name in mine:
        data = np.fromfile(dst / name, dtype=np.uint8)
        bad += _native.crc32c(data) != expected[name]
    return node_comm.allreduce(bad)


def run(comm, args: argparse.Namespace) -> int:
    """Collective over ``comm``: the whole demo; returns the exit status (0: verified)."""
    config = demo_config(args)
    topo = topology(comm, config.ranks_per_node)
    pfs = config.pfs_dir() / "dataset"
    expected: dict[str, int] = {}
    with agreed(comm, "generating the dataset"):
        if comm.Get_rank() == 0:
            expected = generate_dataset(pfs, args.files, args.file_size)
    expected = comm.bcast(expected, root=0)
    names = sorted(expected)
    bb = config.bb_dir(topo.node) / "dataset"
    stats = None
    with agreed(comm, "copying the dataset into the burst buffers"):
        stats = copy_to_node(topo, pfs, bb, names, expected)
    bad = verify_node(bb, names, expected, topo.node_comm)
    per_rank = comm.gather((topo.node, *stats, bad), root=0)
    if comm.Get_rank() == 0:
        print(report(config, topo, per_rank, sum(os.path.getsize(pfs / n) for n in names)))
    topo.free()
    return 0 if comm.allreduce(bad + stats[3]) == 0 else 1


def report(config: Config, topo: Topology, per_rank: list[tuple], dataset_bytes: int) -> str:
    """The final table: one row per node, then the totals."""
    rows = []
    for node in range(topo.nodes):
        mine = [r for r in per_rank if r[0] == node]
        files = sum(r[1] for r in mine)
        nbytes = sum(r[2] for r in mine)
        seconds = max(r[3] for r in mine)
        bad = mine[0][5] + sum(r[4] for r in mine)
        rows.append(
            (
                node,
                str(config.bb_dir(node)),
                files,
                format_bytes(nbytes),
                f"{nbytes / seconds / 1e9:.2f}" if seconds else "-",
                "yes" if bad == 0 else f"NO ({bad} bad)",
            )
        )
    table = format_table(["node", "burst buffer", "files", "bytes", "GB/s", "verified"], rows)
    ok = all(row[-1] == "yes" for row in rows)
    lines = [
        "",
        f"bbio demo: {topo.comm.Get_size()} ranks in {topo.nodes} "
        f"{'virtual ' if topo.virtual else ''}nodes, "
        f"dataset {format_bytes(dataset_bytes)} on the PFS ({config.pfs_dir()})",
        "",
        "Copy to every node's burst buffer (native copy, CRC32C in the same pass):",
        table,
        "",
        "RESULT: " + ("every copy verified by CRC32C" if ok else "VERIFICATION FAILED"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point under mpirun."""
    args = parse_args(argv)
    from mpi4py import MPI

    return abort_on_error(MPI.COMM_WORLD, lambda: run(MPI.COMM_WORLD, args))


if __name__ == "__main__":
    sys.exit(main())
