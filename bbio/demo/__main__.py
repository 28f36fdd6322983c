"""The main job: ``python -m bbio.demo`` (what ``make demo`` runs).

A driver without MPI that runs the demo's MPI job (:mod:`bbio.demo.job`) in
phases, the way a cluster would: with built-in defaults, 4 ranks in 2 virtual
nodes, a "PFS" and per-node "BB" directories under ``work/demo``.

1. prepare: generate a dataset, pack it, stage it into every node's BB
   (replicate, verified), read an epoch through ``bbio.Loader`` against plain
   per-rank reads;
2. train with asynchronous checkpoints, and kill the job (its ranks and its
   drain processes, as Slurm would) while a checkpoint is being drained;
3. finish the drain as a Slurm epilog would: ``bbio ckpt drain --finish`` on
   every node;
4. restart: restore the newest complete checkpoint, check the state is
   identical to what training logged, and train to the end;

then print a report.  ``--launcher`` runs the job (default ``mpirun -n 4``;
on a cluster, e.g. ``srun``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bbio.checkpoint import drain
from bbio.checkpoint.restore import bb_copies
from bbio.report import format_bytes, format_table

JOURNAL_GLOB = "bb/node*/ckpt/demo/.journal"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The driver's options; every one has a built-in default."""
    parser = argparse.ArgumentParser(prog="python -m bbio.demo", description=__doc__)
    parser.add_argument("--root", default="work/demo", help="where the PFS and BB directories go")
    parser.add_argument("--launcher", default="mpirun -n 4", help="how to start the MPI job")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="0: real hosts")
    parser.add_argument(
        "--bb-root", help="burst buffer, may contain {node} (default: ROOT/bb/node{node})"
    )
    parser.add_argument(
        "--epilog-launcher",
        help="runs a command once per node, e.g. 'srun --ntasks-per-node=1' "
        "(default: once per virtual node directory, here)",
    )
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--sample-size", type=int, default=32 << 10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model-mib", type=int, default=32, help="model state per rank")
    return parser.parse_args(argv)


def _job(args: argparse.Namespace, phase: str, result: Path) -> list[str]:
    return [
        *shlex.split(args.launcher),
        sys.executable,
        "-m",
        "bbio.demo.job",
        phase,
        "--root",
        str(Path(args.root).resolve()),
        "--samples",
        str(args.samples),
        "--sample-size",
        str(args.sample_size),
        "--batch-size",
        str(args.batch_size),
        "--epochs",
        str(args.epochs),
        "--model-mib",
        str(args.model_mib),
        "--ranks-per-node",
        str(args.ranks_per_node),
        *(["--bb-root", args.bb_root] if args.bb_root else []),
        "--result",
        str(result),
    ]


def _run(command: list[str], what: str) -> None:
    finished = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if finished.returncode != 0:
        sys.stdout.write(finished.stdout)
        raise SystemExit(f"bbio demo: {what} failed (exit status {finished.returncode})")


def _draining(root: Path) -> int | None:
    """The step a drain is copying now, not yet committed, while an older step is, if any."""
    committed = drain.committed_steps(root / "pfs" / "ckpt" / "demo")
    for journal in root.glob(JOURNAL_GLOB):
        status = drain.read_status(journal)
        tasks = drain.pending(journal)
        if tasks and status.get("state") == "copying":
            step = tasks[0].step  # still queued for a moment after its commit: excluded
            if step not in committed and any(older < step for older in committed):
                return step
    return None


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything below it at once, as Slurm ends a job's cgroup.

    Open MPI starts each rank in a process group of its own, so killing the
    launcher's group would leave the ranks running.
    """
    for _ in range(5):  # again, for what was forked while the first ones died
        below = _descendants(pid)
        if not below:
            break
        for victim in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def train_and_kill(args: argparse.Namespace, root: Path, result: Path) -> dict:
    """Run the training phase; kill it (ranks and drains) while a drain is in progress."""
    job = subprocess.Popen(
        _job(args, "train", result),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    start, killed_at = time.monotonic(), None
    while job.poll() is None:
        step = _draining(root)
        if step is not None:
            killed_at = step
            _kill_tree(job.pid)  # the launcher and its ranks (each in its own process group)...
            for journal in root.glob(JOURNAL_GLOB):  # ...and its drains, as Slurm would
                pid = drain.read_status(journal).get("pid")
                if pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    output = job.communicate()[0].decode(errors="replace")
    lines = output.splitlines()
    printed = [int(line.split()[2]) for line in lines if line.startswith("saved step")]
    committed = drain.committed_steps(root / "pfs" / "ckpt" / "demo")
    pending = sorted({t.step for j in root.glob(JOURNAL_GLOB) for t in drain.pending(j)})
    # a save the kill cut short of its log line counts if every node's copy was complete
    copies = [set(bb_copies(d / "ckpt" / "demo", None)) for d in sorted(root.glob("bb/node*"))]
    in_every_bb = set.intersection(*copies) if copies else set()
    return {
        "killed_at": killed_at,
        "saves": sorted({*printed, *committed, *in_every_bb}),
        "seconds": time.monotonic() - start,
        "committed": committed,
        "pending": pending,
    }


def epilog(args: argparse.Namespace, root: Path) -> dict:
    """What each node's Slurm epilog runs: finish draining its burst buffer."""
    start = time.monotonic()
    nodes = sorted(root.glob("bb/node*"))
    for node_dir in nodes:
        _run(
            [
                sys.executable,
                "-m",
                "bbio",
                "ckpt",
                "drain",
                "--finish",
                "--bb-root",
                str(node_dir),
                "--timeout",
                "300",
            ],
            f"bbio ckpt drain --finish on {node_dir}",
        )
    return {
        "nodes": len(nodes),
        "seconds": time.monotonic() - start,
        "committed": drain.committed_steps(root / "pfs" / "ckpt" / "demo"),
    }


def report(args, prepare: dict, killed: dict, epilog_: dict, restart: dict) -> tuple[str, bool]:
    """The final report and whether everything checked out."""
    read, stage = prepare["read"], prepare["stage"]
    loader_rate = read["samples"] / read["loader_seconds"]
    plain_rate = read["samples"] / read["plain_seconds"]
    saves = restart["saves"]
    restored = restart["restored"]
    rows = [
        (
            "generate",
            f"{prepare['generate']['samples']} samples, "
            f"{format_bytes(prepare['generate']['bytes'])} on the PFS",
            prepare["generate"]["seconds"],
        ),
        (
            "pack",
            f"{prepare['pack']['samples']} samples into {prepare['pack']['shards']} HDF5 shards",
            prepare["pack"]["seconds"],
        ),
        (
            "stage-in",
            f"replicated to {stage['nodes']} nodes, {format_bytes(stage['source_bytes_read'])}"
            f" read from the PFS, verified: {'yes' if stage['verified'] else 'NO'}",
            stage["seconds"],
        ),
        (
            "read",
            f"1 epoch through bbio.Loader from the BBs: {loader_rate:.0f} samples/s; plain "
            f"per-rank reads from the PFS: {plain_rate:.0f} samples/s; every sample checked: "
            f"{'yes' if read['checked'] else 'NO'}",
            read["loader_seconds"],
        ),
        (
            "train",
            f"checkpoints saved asynchronously at steps {killed['saves']}",
            killed["seconds"],
        ),
        (
            "kill",
            f"job killed while step {killed['killed_at']} was draining; committed then: "
            f"{killed['committed']}"
            if killed["killed_at"] is not None
            else "training ended before a drain could be caught in flight",
            0.0,
        ),
        (
            "epilog",
            f"bbio ckpt drain --finish on {epilog_['nodes']} nodes; committed now: "
            f"{epilog_['committed']}",
            epilog_["seconds"],
        ),
        (
            "restart",
            f"restored step {restored['step']} from the {restored['from'].upper()}; state "
            f"identical to the training log: {'yes' if restored['identical'] else 'NO'}",
            0.0,
        ),
        (
            "finish",
            f"trained to step {restart['steps']}, {len(saves)} more checkpoints (blocking "
            f"{max((s['blocking_seconds'] for s in saves), default=0):.3f} s at most); last one "
            f"committed: {'yes' if restart['final_committed'] else 'NO'}",
            0.0,
        ),
    ]
    ok = (
        stage["verified"]
        and read["checked"]
        and restored["identical"]
        and restart["final_committed"]
    )
    table = format_table(["step", "result", "seconds"], [(a, b, f"{c:.2f}") for a, b, c in rows])
    text = "\n".join(
        [
            "",
            f"bbio demo: {args.launcher}, {args.ranks_per_node or 'real'} ranks per node; "
            f"root {Path(args.root).resolve()}",
            "",
            stage["report"],
            "",
            table,
            "",
            "RESULT: " + ("all checks passed" if ok else "SOMETHING FAILED (see above)"),
        ]
    )
    return text, ok


def main(argv: list[str] | None = None) -> int:
    """Run the phases and print the report."""
    args = parse_args(argv)
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    results = root / "results"
    results.mkdir(exist_ok=True)
    print(f"bbio demo: preparing the dataset under {root} ...", flush=True)
    _run(_job(args, "prepare", results / "prepare.json"), "the prepare phase")
    prepare = json.loads((results / "prepare.json").read_text())
    for old in [root / "pfs" / "ckpt" / "demo", *root.glob("bb/node*/ckpt/demo")]:
        shutil.rmtree(old, ignore_errors=True)  # checkpoints of an earlier demo run
    print("bbio demo: training with asynchronous checkpoints, then killing the job ...", flush=True)
    killed = train_and_kill(args, root, results / "train.json")
    epilog_ = epilog(args, root)
    print("bbio demo: restarting from the newest complete checkpoint ...", flush=True)
    _run(_job(args, "restart", results / "restart.json"), "the restart phase")
    restart = json.loads((results / "restart.json").read_text())
    text, ok = report(args, prepare, killed, epilog_, restart)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
