"""The main job: ``python -m bbio.demo`` (what ``make demo`` runs).

A driver without MPI that runs the demo's MPI job (:mod:`bbio.demo.job`) in
phases, the way a cluster would: with built-in defaults, 4 ranks in 2 virtual
nodes, a "PFS" and per-node "BB" directories under ``work/demo``.

1. prepare: generate a dataset, pack it, stage it into every node's BB
   (replicate, verified), read an epoch through ``bbio.Loader`` against plain
   per-rank reads;
2. train with asynchronous checkpoints, and kill the job (its ranks, through
   SIGUSR2 to the launcher, which passes it on, and its drain processes, as a
   node failure would) while a checkpoint is being drained;
3. finish the drain as a Slurm epilog would: ``bbio ckpt drain --finish`` on
   every node;
4. restart: restore the newest complete checkpoint, check the state is
   identical to what training logged, and train to the end;

then print a report.  ``--launcher`` runs the job (default ``mpirun -n 4``;
on a cluster, e.g. ``srun``); ``--bb-root`` is the burst buffer's template
(``{node}``, ``{job}``, ``{user}``, as in ``bb_root``), and
``--epilog-launcher`` runs the per-node work (the removal of an earlier run's
checkpoints, the epilog's drain) once on every host.  Each phase's output goes
to ``ROOT/results/PHASE.log`` and is printed when the phase fails; a job still
running when the driver ends (an error, Ctrl-C, SIGTERM) is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from bbio.checkpoint import drain, layout
from bbio.checkpoint.restore import bb_copies
from bbio.config import Config
from bbio.demo.job import CHECKPOINTER, TRAIN_LOG, demo_config
from bbio.errors import BBIOError, UsageError
from bbio.report import format_bytes, format_table

LAUNCHER_EXIT_SECONDS = 30.0  # after the kill, for the launcher to see its ranks end


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The driver's options; every one has a built-in default."""
    parser = argparse.ArgumentParser(prog="python -m bbio.demo", description=__doc__)
    parser.add_argument("--root", default="work/demo", help="where the PFS and BB directories go")
    parser.add_argument("--launcher", default="mpirun -n 4", help="how to start the MPI job")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="0: real hosts")
    parser.add_argument(
        "--bb-root",
        help="burst buffer, may contain {node}, {job}, {user} (default: ROOT/bb/node{node})",
    )
    parser.add_argument(
        "--epilog-launcher",
        help="runs a command once per node, e.g. 'srun --ntasks-per-node=1': the removal of "
        "an earlier run's checkpoints and the epilog's drain; needs a --bb-root without {node} "
        "(default: once per node directory, here)",
    )
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--sample-size", type=int, default=32 << 10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model-mib", type=int, default=32, help="model state per rank")
    return parser.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Places:
    """Where the demo's checkpoints are, as this host sees them."""

    pfs: Path  # the checkpointer's directory on the PFS
    bbs: list[Path]  # the burst buffers (node directories) on this host
    nodes: int  # the job's node count
    train_log: Path  # the log training appends to at each save, on the PFS

    @classmethod
    def of(cls, config: Config, nodes: int) -> Places:
        """The PFS directory, and ``bb_root`` expanded for every node (one directory per
        host when it has no {node})."""
        bbs = sorted({config.expand(config.bb_root, node=n) for n in range(nodes)})
        pfs = config.pfs_dir()
        return cls(pfs / layout.CKPT_DIR / CHECKPOINTER, bbs, nodes, pfs / TRAIN_LOG)

    def bb_ckpt_dirs(self) -> list[Path]:
        """The checkpointer's directory in each burst buffer seen here."""
        return [bb / layout.CKPT_DIR / CHECKPOINTER for bb in self.bbs]

    def journals(self) -> list[Path]:
        """The drain journals seen here."""
        return [drain.journal_dir(d) for d in self.bb_ckpt_dirs()]

    def every_node_here(self) -> bool:
        """Does this host see every node's burst buffer (virtual nodes, or one node)?"""
        return len(self.bbs) == self.nodes


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


@contextlib.contextmanager
def _started(command: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """Start ``command`` in a session of its own, its output into ``log``; on leaving (an
    error, Ctrl-C, SIGTERM), end it if it still runs (:func:`_end`).  A checkpoint drain
    is not below it (it runs in a session of its own, to outlive a crash):
    :func:`train_and_kill` kills the drains itself."""
    with open(log, "wb") as out:
        job = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield job
    finally:
        if job.poll() is None:
            _end(job)


def _fail(what: str, status: int, log: Path) -> NoReturn:
    """Print ``log`` and stop the demo: ``what`` failed."""
    sys.stdout.write(log.read_text(errors="replace"))
    raise SystemExit(f"bbio demo: {what} failed (exit status {status}; output above, in {log})")


def _run(command: list[str], what: str, log: Path) -> None:
    """Run ``command`` to its end; stop the demo if it fails."""
    with _started(command, log) as job:
        job.wait()
    if job.returncode != 0:
        _fail(what, job.returncode, log)


def _on_every_node(
    args: argparse.Namespace,
    places: Places,
    command: Callable[[Path], list[str]],
    what: str,
    log: Path,
) -> None:
    """Run ``command(bb)`` once per node: through ``--epilog-launcher`` (one burst
    buffer path, the same on every host), else here on each node directory."""
    if args.epilog_launcher:
        launched = [*shlex.split(args.epilog_launcher), *command(places.bbs[0])]
        _run(launched, f"{what} on every node", log)
        return
    for n, bb in enumerate(places.bbs):
        _run(command(bb), f"{what} on {bb}", log.with_suffix(f".{n}.log"))


def _draining(places: Places) -> int | None:
    """The step a drain is copying now, not yet committed, while an older step is, if any."""
    committed = drain.committed_steps(places.pfs)
    for journal in places.journals():
        status = drain.read_status(journal)
        tasks = drain.pending(journal)
        if tasks and status.get("state") == "copying":
            step = tasks[0].step  # still queued for a moment after its commit: excluded
            if step not in committed and any(older < step for older in committed):
                return step
    return None


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, from /proc (a zombie is dead: left out)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                state, ppid = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[:2]
                if state != "Z":
                    children.setdefault(int(ppid), []).append(int(entry))
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
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # again, for what was forked while the first ones died
        below = _descendants(pid)
        if not below:
            break
        for victim in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _end(job: subprocess.Popen, meanwhile: Callable[[], object] = lambda: None) -> None:
    """End the launcher ``job`` and its ranks at once, as a node failure would.

    The launcher gets SIGUSR2 and passes it on to every rank on every node
    (``srun`` and Open MPI's ``mpirun`` do), whose default action ends a rank at
    once, as SIGKILL would; killing the launcher instead would leave ``srun``'s
    ranks running (they are not its children).  ``meanwhile`` runs right after
    the signal.  Once the launcher has ended (or after
    ``LAUNCHER_EXIT_SECONDS``), what ran below it when the signal was sent and
    still runs is SIGKILLed: a launcher that does not pass SIGUSR2 on (MPICH's
    ``mpiexec``) dies of it, leaving its ranks here to init.
    """
    below = _handles(_descendants(job.pid))
    try:
        with contextlib.suppress(ProcessLookupError):
            job.send_signal(signal.SIGUSR2)
        meanwhile()
        try:
            job.wait(LAUNCHER_EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            _kill_tree(job.pid)  # before it is reaped: its pid is still its own
            job.wait()
    finally:
        _kill_handles(below)


def _handles(pids: list[int]) -> list[int]:
    """Descriptors (pidfds) of those of ``pids`` still running: a signal sent through one
    never reaches a later process given the same pid."""
    handles = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            handles.append(os.pidfd_open(pid))
    return handles


def _kill_handles(handles: list[int]) -> None:
    """SIGKILL the processes of ``handles`` (:func:`_handles`) and close them."""
    for handle in handles:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(handle, signal.SIGKILL)
        os.close(handle)


def processes_running(text: str) -> list[int]:
    """Live processes of this host (but this one) whose command line contains ``text``.
    Not collective."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
                if text.encode() in cmdline:
                    found.append(int(entry))
    return found


def _crash(job: subprocess.Popen, places: Places) -> None:
    """Kill the training job (:func:`_end`) and its drains at once; then this host's
    drains of the demo's journals again, since a save in between may have started one."""
    _end(job, meanwhile=lambda: _kill_drains(places))
    for journal in places.journals():
        _kill_handles(_handles(processes_running(f"bbio.checkpoint.drainer --journal {journal} ")))


def _ran_on(killed: dict, places: Places, result: Path) -> str | None:
    """Why the killed training job seems to run on, if it does: its ranks still run on
    this host (they are SIGKILLed), it wrote its result, or its log changed since the
    kill.  Rank 0 writes both; ranks on other hosts are not seen from here."""
    here = processes_running(f" --result {result}")
    if here:
        _kill_handles(_handles(here))
        return f"its ranks on this host still ran after the kill (pids {here}; killed now)"
    if result.exists():
        return f"the training job finished after it was killed (it wrote {result})"
    if _state_of(places.train_log) != killed["log_after_kill"]:
        return f"the training job still wrote {places.train_log} after it was killed"
    return None


def _state_of(path: Path) -> list[int] | None:
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return [info.st_size, info.st_mtime_ns]


def kill_drain(journal: Path) -> str | None:
    """SIGKILL the drain that last reported in ``journal``'s status, if it ran on this
    host; else return why it was not killed (its pid means nothing here)."""
    status = drain.read_status(journal)
    pid, host = status.get("pid"), status.get("host")
    if not pid:
        return None
    if host != socket.gethostname():
        return (
            f"the drain of {journal} (pid {pid}) ran on host {host or '(not recorded)'}, "
            f"not on this one ({socket.gethostname()}): not killed"
        )
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return None


def _kill_drains(places: Places) -> None:
    """SIGKILL the drains of the journals seen here (:func:`kill_drain`); say which could
    not be killed from this host."""
    for journal in places.journals():
        why = kill_drain(journal)
        if why:
            print(f"bbio demo: {why}", flush=True)
    if not places.every_node_here():
        print(
            f"bbio demo: {places.nodes - len(places.bbs)} nodes' burst buffers are "
            "not seen from this host: their drains were not killed here",
            flush=True,
        )


def train_and_kill(args: argparse.Namespace, places: Places, result: Path) -> dict:
    """Run the training phase; kill it (ranks and drains) while a drain is in progress.

    Stops the demo when training fails without being killed.
    """
    log = result.with_suffix(".log")
    start, killed_at = time.monotonic(), None
    try:
        with _started(_job(args, "train", result), log) as job:
            while job.poll() is None:
                step = _draining(places)
                if step is not None:
                    killed_at = step
                    _crash(job, places)
                    break
                time.sleep(0.005)
            job.wait()
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): the job's drains go with it
        _kill_drains(places)
        raise
    if killed_at is not None and job.returncode == 0:
        killed_at = None  # it ended by itself, before the signal: not killed
    if killed_at is None and job.returncode != 0:
        _fail("the train phase", job.returncode, log)
    printed = [
        int(line.split()[2])
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith("saved step")
    ]
    committed = drain.committed_steps(places.pfs)
    # a save the kill cut short of its log line counts if every node's copy was complete
    in_every_bb: set[int] = set()
    if places.every_node_here():
        copies = [set(bb_copies(d, None)) for d in places.bb_ckpt_dirs()]
        in_every_bb = set.intersection(*copies)
    return {
        "killed_at": killed_at,
        "log_after_kill": _state_of(places.train_log),
        "saves": sorted({*printed, *committed, *in_every_bb}),
        "seconds": time.monotonic() - start,
        "committed": committed,
    }


def _drain_command(bb: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bbio",
        "ckpt",
        "drain",
        "--finish",
        "--bb-root",
        str(bb),
        "--timeout",
        "300",
    ]


def epilog(args: argparse.Namespace, places: Places, log: Path) -> dict:
    """What each node's Slurm epilog runs: finish draining its burst buffer."""
    start = time.monotonic()
    _on_every_node(args, places, _drain_command, "bbio ckpt drain --finish", log)
    return {
        "nodes": places.nodes,
        "seconds": time.monotonic() - start,
        "committed": drain.committed_steps(places.pfs),
    }


def passed(prepare: dict, killed: dict, epilog_: dict, restart: dict) -> bool:
    """Did every check pass: data verified, the job killed mid-drain, the newest
    committed checkpoint restored identical, the last save committed?"""
    restored = restart["restored"]
    return bool(
        prepare["stage"]["verified"]
        and prepare["read"]["checked"]
        and killed["killed_at"] is not None
        and epilog_["committed"]
        and restored["step"] == max(epilog_["committed"])
        and restored["identical"]
        and restart["final_committed"] is not False
    )


def report(
    args: argparse.Namespace, prepare: dict, killed: dict, epilog_: dict, restart: dict
) -> tuple[str, bool]:
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
            f"restored step {restored['step']} from the {restored['from'].upper()} (newest "
            f"committed: {max(epilog_['committed'], default=None)}); state identical to the "
            f"training log: {'yes' if restored['identical'] else 'NO'}",
            0.0,
        ),
        (
            "finish",
            f"trained to step {restart['steps']}, {len(saves)} more checkpoints (blocking "
            f"{max((s['blocking_seconds'] for s in saves), default=0):.3f} s at most); "
            + {True: "last one committed: yes", False: "last one committed: NO"}.get(
                restart["final_committed"], "no checkpoint to commit"
            ),
            0.0,
        ),
    ]
    ok = passed(prepare, killed, epilog_, restart)
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


def _stop_if_ran_on(args: argparse.Namespace, killed: dict, places: Places, result: Path) -> None:
    """Stop the demo if the training job it killed runs on (:func:`_ran_on`)."""
    survived = _ran_on(killed, places, result) if killed["killed_at"] is not None else None
    if survived:
        raise SystemExit(
            f"bbio demo: {survived}: the launcher ({args.launcher}) did not pass SIGUSR2 "
            "on to its ranks; the demo needs a launcher that does (srun, Open MPI's mpirun). "
            "Processes of the job on other hosts may still run."
        )


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM (make's timeout, scancel): leave through the ``finally`` blocks that kill
    the running job."""
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    """Run the phases and print the report; 0 if every check passed."""
    config = demo_config(args)
    if args.epilog_launcher and "{node}" in config.bb_root:
        raise UsageError(
            f"--epilog-launcher runs the epilog once per host, which cannot know its node "
            f"index, but the burst buffer {config.bb_root} contains {{node}}",
            hint="pass --bb-root without {node} (one burst buffer per host), or no "
            "--epilog-launcher (every node directory on this host)",
        )
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    results = root / "results"
    results.mkdir(exist_ok=True)
    print(f"bbio demo: preparing the dataset under {root} ...", flush=True)
    _run(
        _job(args, "prepare", results / "prepare.json"),
        "the prepare phase",
        results / "prepare.log",
    )
    prepare = json.loads((results / "prepare.json").read_text())
    places = Places.of(config, prepare["stage"]["nodes"])
    shutil.rmtree(places.pfs, ignore_errors=True)  # checkpoints of an earlier demo run
    _on_every_node(
        args,
        places,
        lambda bb: ["rm", "-rf", str(bb / layout.CKPT_DIR / CHECKPOINTER)],
        "removing an earlier run's checkpoints",
        results / "cleanup.log",
    )
    print("bbio demo: training with asynchronous checkpoints, then killing the job ...", flush=True)
    trained = results / "train.json"
    trained.unlink(missing_ok=True)  # of an earlier demo run
    killed = train_and_kill(args, places, trained)
    _stop_if_ran_on(args, killed, places, trained)
    epilog_ = epilog(args, places, results / "epilog.log")
    _stop_if_ran_on(args, killed, places, trained)
    print("bbio demo: restarting from the newest complete checkpoint ...", flush=True)
    _run(
        _job(args, "restart", results / "restart.json"),
        "the restart phase",
        results / "restart.log",
    )
    restart = json.loads((results / "restart.json").read_text())
    text, ok = report(args, prepare, killed, epilog_, restart)
    print(text)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Run the demo; a job still running when it ends (an error, Ctrl-C, SIGTERM) is killed."""
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return run(args)
    except BBIOError as exc:
        print(f"bbio demo: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bbio demo: interrupted; the running job was killed", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
