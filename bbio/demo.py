"""The main job: ``mpirun -n 4 python -m bbio.demo`` (what ``make demo`` runs).

With built-in defaults it puts a "PFS" and per-node "BB" directories under
``work/demo`` in the current directory and splits the 4 ranks into 2 virtual
nodes.  Then it:

1. generates a dataset of small sample files on the PFS;
2. packs them into a few HDF5 shards (``bbio pack``);
3. stages the packed dataset into every node's BB (``bbio stage-in``,
   replicate mode, verified by re-reading);
4. trains for one epoch: a loop whose batches come from ``bbio.Loader``
   (collective reads from the burst buffers, a seeded global shuffle, prefetch
   in the background), against plain per-rank reads of the same samples from
   the PFS, in the same run;

and prints a report: one table per step, then a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from bbio import _native
from bbio.config import Config, load_config
from bbio.mpi import abort_on_error, agreed
from bbio.read.datasets import open_dataset
from bbio.read.loader import Loader
from bbio.report import format_bytes, format_table
from bbio.stage.pack import pack, read_index
from bbio.stage.run import stage_in


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The demo's options; every one has a built-in default."""
    parser = argparse.ArgumentParser(prog="python -m bbio.demo", description=__doc__)
    parser.add_argument("--root", default="work/demo", help="where the PFS and BB directories go")
    parser.add_argument("--samples", type=int, default=512, help="sample files in the dataset")
    parser.add_argument("--sample-size", type=int, default=32 << 10, help="bytes per sample")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
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
        progress="never",
    )


def generate_samples(directory: Path, samples: int, size: int, seed: int = 0) -> None:
    """Write ``samples`` files of ``size`` random bytes, sample_00000.bin ... .  Not collective."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(samples):
        rng.integers(0, 256, size, dtype=np.uint8).tofile(directory / f"sample_{i:05d}.bin")


@dataclasses.dataclass
class Step:
    """One line of the final summary."""

    name: str
    result: str
    seconds: float


def run(comm, args: argparse.Namespace) -> int:
    """Collective over ``comm``: the whole demo; returns the exit status (0: all verified)."""
    config = demo_config(args)
    pfs = config.pfs_dir()
    steps: list[Step] = []
    rank0 = comm.Get_rank() == 0

    start = time.monotonic()
    with agreed(comm, "generating the dataset"):
        if rank0:
            generate_samples(pfs / "samples", args.samples, args.sample_size)
    dataset_bytes = args.samples * args.sample_size
    steps.append(
        Step(
            "generate",
            f"{args.samples} samples, {format_bytes(dataset_bytes)} on the PFS",
            time.monotonic() - start,
        )
    )

    packed = pack(comm, pfs / "samples", pfs / "packed", shard_size=4 << 20, config=config)
    steps.append(
        Step("pack", f"{packed.samples} samples into {packed.shards} HDF5 shards", packed.seconds)
    )

    staged = stage_in(
        comm,
        pfs / "packed",
        f"{config.bb_root}/packed",
        mode="replicate",
        verify=True,
        config=config,
    )
    steps.append(
        Step(
            "stage-in",
            f"replicated to {staged.nodes} nodes, {format_bytes(staged.source_bytes_read)} read "
            f"from the PFS, verified: {'yes' if staged.verified else 'no'}",
            staged.seconds,
        )
    )
    training = train_one_epoch(comm, config, pfs, args.batch_size)
    steps.append(
        Step(
            "train",
            f"{training.samples} samples in {training.steps} steps through bbio.Loader: "
            f"{training.loader_rate:.0f} samples/s, plain per-rank reads {training.plain_rate:.0f}"
            f" samples/s ({training.loader_rate / training.plain_rate:.1f}x); every sample checked",
            training.loader_seconds,
        )
    )
    if rank0:
        print(report(comm, config, staged.nodes, staged.report(), steps))
    return 0 if staged.verified and training.all_checked else 1


@dataclasses.dataclass
class Training:
    """What the training loop measured (the same on every rank)."""

    steps: int
    samples: int
    loader_seconds: float
    plain_seconds: float
    all_checked: bool

    @property
    def loader_rate(self) -> float:
        """Samples per second through bbio.Loader."""
        return self.samples / self.loader_seconds

    @property
    def plain_rate(self) -> float:
        """Samples per second with plain per-rank reads."""
        return self.samples / self.plain_seconds


def _plain_read(paths: list[Path]) -> list[bytes]:
    return [p.read_bytes() for p in paths]


def train_one_epoch(comm, config: Config, pfs: Path, batch_size: int) -> Training:
    """Collective over ``comm``: one epoch through bbio.Loader, then the same batches plainly.

    The "model" checks each sample against the CRC32C the pack recorded; the
    baseline reads each rank's samples one file at a time from the PFS.
    """
    from mpi4py import MPI

    names = sorted(p.name for p in (pfs / "samples").iterdir())
    ok = True
    history: list[np.ndarray] = []
    with open_dataset(comm, pfs / "packed", config=config) as ds:
        crcs = _pack_crcs(pfs / "packed")
        comm.Barrier()
        start = time.monotonic()
        with Loader(comm, ds, batch_size=batch_size, seed=42, prefetch=2) as loader:
            for batch in loader:
                ids = loader.indices
                ok &= all(_native.crc32c(b) == crcs[i] for b, i in zip(batch, ids, strict=True))
                history.append(ids)
        loader_seconds = comm.allreduce(time.monotonic() - start, op=MPI.MAX)
    comm.Barrier()
    start = time.monotonic()
    for ids in history:
        data = _plain_read([pfs / "samples" / names[i] for i in ids])
        ok &= all(_native.crc32c(b) == crcs[i] for b, i in zip(data, ids, strict=True))
    plain_seconds = comm.allreduce(time.monotonic() - start, op=MPI.MAX)
    samples = comm.allreduce(sum(int(ids.size) for ids in history))
    return Training(
        len(history), samples, loader_seconds, plain_seconds, bool(comm.allreduce(ok, op=MPI.LAND))
    )


def _pack_crcs(packed: Path) -> np.ndarray:
    import h5py

    crcs = []
    for shard in read_index(packed):
        with h5py.File(packed / shard.file, "r") as f:
            crcs.append(np.asarray(f["crc32c"][:]))
    return np.concatenate(crcs)


def report(comm, config: Config, nodes: int, stage_table: str, steps: list[Step]) -> str:
    """The final report: the stage-in summary, then one row per step."""
    summary = format_table(
        ["step", "result", "seconds"], [(s.name, s.result, f"{s.seconds:.2f}") for s in steps]
    )
    bbs = ", ".join(str(config.bb_dir(n)) for n in range(nodes))
    return "\n".join(
        [
            "",
            f"bbio demo: {comm.Get_size()} ranks in {nodes} nodes; PFS {config.pfs_dir()}; "
            f"burst buffers {bbs}",
            "",
            stage_table,
            "",
            summary,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point under mpirun."""
    args = parse_args(argv)
    from mpi4py import MPI

    return abort_on_error(MPI.COMM_WORLD, lambda: run(MPI.COMM_WORLD, args))


if __name__ == "__main__":
    sys.exit(main())
