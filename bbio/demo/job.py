"""The demo's MPI job: ``mpirun -n 4 python -m bbio.demo.job PHASE ...`` (the driver runs it).

``prepare``: generate a dataset of small sample files on the "PFS", pack it
(``bbio pack``), stage the pack into every node's burst buffer (replicate,
verified), and measure one epoch read through ``bbio.Loader`` against plain
per-rank reads of the same samples.

``train``: train a small model whose batches come from ``bbio.Loader`` and
checkpoint it asynchronously every few steps (``bbio.Checkpointer``); before
each save, the job appends the CRC32C of every rank's state to a training log
on the PFS.  The driver kills this phase in the middle of a drain.

``restart``: restore the newest complete checkpoint, check that its state is
identical to what the log recorded for that step, train to the end and wait
for the last checkpoint to be committed.

Both training phases report the last step trained (``steps``) and whether
their last save is committed (``final_committed``; None when they saved
nothing).

Each phase writes its measurements as JSON to ``--result FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from bbio import _native
from bbio.checkpoint.checkpointer import Checkpointer
from bbio.checkpoint.layout import Shard
from bbio.config import Config, load_config
from bbio.mpi import abort_on_error, agreed
from bbio.read.datasets import open_dataset
from bbio.read.loader import Loader
from bbio.stage.pack import pack, read_index
from bbio.stage.run import stage_in

SEED = 42
CHECKPOINTER = "demo"  # the checkpointer's name
CHECKPOINT_EVERY = 2
TRAIN_LOG = "train-log.jsonl"  # in the PFS directory: each save's digests, one line each
ROW_BYTES = 8 * 4  # the model is float32, 8 columns


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The job's options (the driver passes them all)."""
    parser = argparse.ArgumentParser(prog="python -m bbio.demo.job")
    parser.add_argument("phase", choices=["prepare", "train", "restart"])
    parser.add_argument("--root", required=True)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--sample-size", type=int, default=32 << 10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model-mib", type=int, default=32, help="model state per rank")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--bb-root")
    parser.add_argument("--result", required=True, help="where to write this phase's JSON")
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


def _pack_crcs(packed: Path) -> np.ndarray:
    import h5py

    crcs = []
    for shard in read_index(packed):
        with h5py.File(packed / shard.file, "r") as f:
            crcs.append(np.asarray(f["crc32c"][:]))
    return np.concatenate(crcs)


def _max(comm, value: float) -> float:
    from mpi4py import MPI

    return comm.allreduce(value, op=MPI.MAX)


def prepare(comm, args: argparse.Namespace, config: Config) -> dict:
    """Collective: generate, pack, stage-in, and compare one epoch of reads."""
    pfs = config.pfs_dir()
    result: dict = {}
    start = time.monotonic()
    with agreed(comm, "generating the dataset"):
        if comm.Get_rank() == 0:
            generate_samples(pfs / "samples", args.samples, args.sample_size)
    result["generate"] = {
        "samples": args.samples,
        "bytes": args.samples * args.sample_size,
        "seconds": _max(comm, time.monotonic() - start),
    }
    packed = pack(comm, pfs / "samples", pfs / "packed", shard_size=4 << 20, config=config)
    result["pack"] = {"samples": packed.samples, "shards": packed.shards, "seconds": packed.seconds}
    staged = stage_in(
        comm,
        pfs / "packed",
        f"{config.bb_root}/packed",
        mode="replicate",
        verify=True,
        config=config,
    )
    result["stage"] = {
        "nodes": staged.nodes,
        "files": staged.files,
        "unchanged": staged.unchanged,
        "bytes_written": staged.bytes_written,
        "source_bytes_read": staged.source_bytes_read,
        "seconds": staged.seconds,
        "verified": staged.verified,
        "report": staged.report(),
    }
    result["read"] = compare_reads(comm, config, pfs, args.batch_size)
    return result


def compare_reads(comm, config: Config, pfs: Path, batch_size: int) -> dict:
    """Collective: one epoch through bbio.Loader, then the same batches with plain reads."""
    from mpi4py import MPI

    names = sorted(p.name for p in (pfs / "samples").iterdir())
    ok = True
    history: list[np.ndarray] = []
    with open_dataset(comm, pfs / "packed", config=config) as ds:
        crcs = _pack_crcs(pfs / "packed")
        comm.Barrier()
        start = time.monotonic()
        with Loader(comm, ds, batch_size=batch_size, seed=SEED, prefetch=2) as loader:
            for batch in loader:
                ids = loader.indices
                ok &= all(_native.crc32c(b) == crcs[i] for b, i in zip(batch, ids, strict=True))
                history.append(ids)
        loader_seconds = _max(comm, time.monotonic() - start)
        local = len(ds.local)
    comm.Barrier()
    start = time.monotonic()
    for ids in history:
        data = [(pfs / "samples" / names[i]).read_bytes() for i in ids]
        ok &= all(_native.crc32c(b) == crcs[i] for b, i in zip(data, ids, strict=True))
    plain_seconds = _max(comm, time.monotonic() - start)
    return {
        "steps": len(history),
        "samples": comm.allreduce(sum(int(ids.size) for ids in history)),
        "loader_seconds": loader_seconds,
        "plain_seconds": plain_seconds,
        "checked": bool(comm.allreduce(ok, op=MPI.LAND)),
        "files_in_bb": local,
    }


# ---------------------------------------------------------------- training


def initial_model(comm, mib: int) -> dict:
    """This rank's slice of the global model at step 0 (``mib`` MiB)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = (mib << 20) // ROW_BYTES
    weights = np.random.default_rng(SEED + rank).standard_normal((rows, 8)).astype(np.float32)
    return {"weights": Shard(weights, (rank * rows, 0), (size * rows, 8))}


def train_step(model: dict, batch: list[np.ndarray], step: int) -> dict:
    """A deterministic update from this rank's batch (a stand-in for an optimizer)."""
    signal = np.float32(sum(int(b[:64].sum()) for b in batch) % 1000 / 1000.0)
    w = model["weights"]
    return {"weights": Shard(w.data * np.float32(0.999) + signal, w.start, w.global_shape)}


def digest(model: dict) -> int:
    """CRC32C of this rank's state."""
    return _native.crc32c(np.ascontiguousarray(model["weights"].data).view(np.uint8).reshape(-1))


def _log_digests(comm, log_path: Path, step: int, model: dict) -> None:
    digests = comm.gather(digest(model), root=0)
    if comm.Get_rank() == 0:
        with open(log_path, "a") as f:
            f.write(json.dumps({"step": step, "digests": digests}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _batches(comm, config: Config, pfs: Path, args, start_step: int):
    """(global step, batch) after ``start_step`` to the end of the last epoch."""
    with (
        open_dataset(comm, pfs / "packed", config=config) as ds,
        Loader(
            comm,
            ds,
            batch_size=args.batch_size,
            seed=SEED,
            epochs=args.epochs,
            prefetch=2,
            start_step=start_step,
        ) as loader,
    ):
        yield from enumerate(loader, start=start_step + 1)


def train(comm, args: argparse.Namespace, config: Config, restart: bool) -> dict:
    """Collective: train, checkpointing every CHECKPOINT_EVERY steps (the driver may kill it)."""
    pfs = config.pfs_dir()
    log_path = pfs / TRAIN_LOG
    result: dict = {"saves": [], "restored": None}
    ckpt = Checkpointer(comm, CHECKPOINTER, keep_bb=2, keep_pfs=3, config=config)
    model, start_step = initial_model(comm, args.model_mib), 0
    if restart:
        step, arrays, attrs = ckpt.restore()
        logged = {}
        for line in log_path.read_text().splitlines():
            entry = json.loads(line)
            logged[entry["step"]] = entry["digests"]
        w = model["weights"]
        model = {"weights": Shard(arrays["weights"], w.start, w.global_shape)}
        identical = (
            comm.allreduce(
                int(digest(model) == logged[step][comm.Get_rank()]) if step in logged else 0
            )
            == comm.Get_size()
        )
        result["restored"] = {
            "step": step,
            "identical": bool(identical),
            "from": ckpt.last_restore_tier,
        }
        start_step = attrs["loader_step"]
    elif comm.Get_rank() == 0:
        log_path.unlink(missing_ok=True)
    handle, step = None, start_step
    for step, batch in _batches(comm, config, pfs, args, start_step):
        model = train_step(model, batch, step)
        if step % CHECKPOINT_EVERY == 0:
            _log_digests(comm, log_path, step, model)  # first: a kill may follow the save
            comm.Barrier()
            start = time.monotonic()
            handle = ckpt.save(step, model, attrs={"loader_step": step})
            blocked = _max(comm, time.monotonic() - start)
            result["saves"].append({"step": step, "blocking_seconds": blocked})
            if comm.Get_rank() == 0:
                print(f"saved step {step} ({blocked:.3f} s blocking)", flush=True)
    result["steps"] = step
    ckpt.close(wait=True)
    result["final_committed"] = None if handle is None else handle.done()
    return result


def run(comm, args: argparse.Namespace) -> int:
    """Collective over ``comm``: run one phase and write its result (rank 0)."""
    config = demo_config(args)
    if args.phase == "prepare":
        result = prepare(comm, args, config)
    else:
        result = train(comm, args, config, restart=args.phase == "restart")
    if comm.Get_rank() == 0:
        Path(args.result).write_text(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point under mpirun or srun."""
    args = parse_args(argv)
    from mpi4py import MPI

    return abort_on_error(MPI.COMM_WORLD, lambda: run(MPI.COMM_WORLD, args))


if __name__ == "__main__":
    sys.exit(main())
