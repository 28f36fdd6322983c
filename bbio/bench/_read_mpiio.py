"""Worker of the ``read`` suite: MPI-IO collective reads, in a child job of its own.

``OMPI_MCA_io=romio321|ompio mpirun -n N python -m bbio.bench._read_mpiio SPEC.json OUT.json``

Open MPI chooses its io component at ``MPI_Init``, so the ``read`` suite
(:mod:`bbio.bench.read`) runs ROMIO and OMPIO as separate jobs.  ``SPEC.json``
lists the cases (raw file, sample bytes, ids as an ``.npy`` array of shape
(steps, ranks, batch)).  For each case: caches dropped, the file opened
(``MPI_File_open``, with hints ``cb_nodes``/``cb_config_list`` when
aggregators are given), then per step a barrier, the file view set to an
hindexed type of the rank's samples in increasing offset order, and one
``MPI_File_read_at_all`` into an hindexed memory type that puts each sample
where the rank asked for it (after one untimed warm-up read of the spec's
``warm`` ids); the step is timed per rank (its maximum is
kept), ``syscr``/``rchar`` summed over ranks.  Rank 0 writes ``OUT.json``:
per case ``seconds``, ``syscr`` and ``rchar`` per step, the io components the
process loaded, and the cache drops (before each case; with ``cold_steps``
also before every step, untimed).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from bbio.bench import IoCounters, drop_caches, idle_barrier
from bbio.bench.read import (
    check_samples,
    loaded_io_components,
    server_counters,
    server_delta,
)


def _hints(MPI, aggregators: int):
    info = MPI.Info.Create()
    if aggregators > 0:
        info.Set("cb_nodes", str(aggregators))
        info.Set("cb_config_list", f"*:{aggregators}")
    return info


def read_case(comm, case: dict, spec: dict, counters: IoCounters, drops: list) -> dict:
    """Collective: every step of one case; rank 0 gets the per-step lists."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    sample = int(case["sample_bytes"])
    ids_all = np.load(case["ids"])
    info = _hints(MPI, int(spec["aggregators"]))
    fh = MPI.File.Open(comm, case["path"], MPI.MODE_RDONLY, info)
    info.Free()
    pids = spec.get("server_pids") or []
    server = None
    out: dict = {"seconds": [], "syscr": [], "rchar": []}
    warm = np.asarray(case["warm"][rank], dtype=np.int64)
    try:
        for step in range(-1, ids_all.shape[0]):  # step -1: the untimed warm-up
            ids = ids_all[step][rank] if step >= 0 else warm
            order = np.argsort(ids, kind="stable")
            lengths = [sample] * ids.size
            if step >= 0 and spec.get("cold_steps") and rank == 0:
                drops.append(drop_caches(bool(spec["drop_caches"])))
            comm.Barrier()
            before = counters.snapshot()
            start = time.perf_counter()
            filetype = MPI.BYTE.Create_hindexed(lengths, (ids[order] * sample).tolist()).Commit()
            memtype = MPI.BYTE.Create_hindexed(lengths, (order * sample).tolist()).Commit()
            data = np.empty((ids.size, sample), dtype=np.uint8)
            fh.Set_view(0, MPI.BYTE, filetype)
            fh.Read_at_all(0, [data, 1, memtype])
            seconds = time.perf_counter() - start
            syscr, rchar = counters.delta(before, counters.snapshot())
            filetype.Free()
            memtype.Free()
            check_samples(data, ids, f"{case['name']} {spec['system']} step {step}")
            if step < 0:
                server = server_counters(pids) if rank == 0 else None
                continue
            seconds = comm.allreduce(seconds, op=MPI.MAX)
            syscr, rchar = (int(v) for v in comm.allreduce(np.array([syscr, rchar])))
            out["seconds"].append(seconds)
            out["syscr"].append(syscr)
            out["rchar"].append(rchar)
    finally:
        fh.Close()
    if rank == 0:
        out["server"] = server_delta(server, server_counters(pids))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every case of the spec; rank 0 writes the results."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m bbio.bench._read_mpiio SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    from mpi4py import MPI

    from bbio.mpi import abort_on_error

    comm = MPI.COMM_WORLD

    def run() -> None:
        counters = IoCounters()
        result: dict = {"system": spec["system"], "cases": {}, "drops": []}
        for case in spec["cases"]:
            if comm.Get_rank() == 0:
                result["drops"].append(drop_caches(bool(spec["drop_caches"])))
            idle_barrier(comm)
            result["cases"][case["name"]] = read_case(comm, case, spec, counters, result["drops"])
        counters.close()
        if comm.Get_rank() == 0:
            result["components"] = loaded_io_components()
            Path(argv[1]).write_text(json.dumps(result))

    return abort_on_error(comm, run)


if __name__ == "__main__":
    sys.exit(main())
