"""``bbio ckpt`` from a shell, and a rank killed for real during a save (mpirun subprocesses)."""

from __future__ import annotations

import json
import shutil
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import run_mpi, run_python
from tests.test_ckpt_drain import sound_manifest

JOB = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import numpy as np
    from mpi4py import MPI
    import bbio
    from bbio.config import Config

    comm = MPI.COMM_WORLD
    root, action = sys.argv[1], sys.argv[2]
    config = Config(bb_root=f"{root}/bb/{{node}}", pfs_root=f"{root}/pfs",
                    ranks_per_node=comm.Get_size() // 2, progress="never")
    ckpt = bbio.Checkpointer(comm, "run", config=config)

    def state(step, rows):
        return {"w": np.full((rows, 16), step * 10 + comm.Get_rank(), dtype=np.float64)}

    if action == "save":
        for step in (1, 2):
            ckpt.save(step, state(step, 1000)).wait(timeout=60)
        ckpt.close()
    elif action == "die-while-saving":
        ckpt.save(1, state(1, 1000)).wait(timeout=60)
        if comm.Get_rank() == 1:  # rank 1 dies in the middle of the next save
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        ckpt.save(2, state(2, 4 << 20))  # 512 MiB per rank: still writing at 0.3 s
        ckpt.close()
    elif action == "die-while-recording":  # the leaders die before the nth bookkeeping write
        from bbio.checkpoint import drain, layout
        from bbio.transfer import files

        ckpt.save(1, state(1, 1000)).wait(timeout=60)
        nth, written, write = int(sys.argv[3]), [], files.write_json_atomic
        task = drain.task_path(ckpt.journal, 2)
        record = ckpt.bb_dir / layout.step_dirname(2) / layout.node_record_name(ckpt.node)

        def write_unless_killed(path, *args, **kwargs):
            if path in (task, record):
                written.append(path)
                if len(written) == nth:
                    os.kill(os.getpid(), signal.SIGKILL)
            write(path, *args, **kwargs)

        files.write_json_atomic = write_unless_killed
        ckpt.save(2, state(2, 1000))
        ckpt.close()
    elif action == "raise-inside-with":
        with ckpt:
            ckpt.save(1, state(1, 1000))
            if comm.Get_rank() == 0:
                raise RuntimeError("the training failed on rank 0")
    elif action == "restore":
        step, arrays, _ = ckpt.restore()
        w = arrays["w"]
        assert (w == step * 10 + comm.Get_rank()).all(), "restored a torn checkpoint"
        if comm.Get_rank() == 0:
            print(f"restored step {step} rows {w.shape[0]}", flush=True)
        ckpt.close()
    """
)


@pytest.fixture
def job(tmp_path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return path


def bbio_ckpt(tmp_path: Path, *args: str, node: int = 0):
    # drain takes no --pfs-root: it drains where each journal's target.json says
    pfs = [] if args[0] == "drain" else ["--pfs-root", str(tmp_path / "pfs")]
    bb = ["--bb-root", str(tmp_path / "bb" / "{node}"), "--node", str(node)]
    return run_python("-m", "bbio", "ckpt", *args, *bb, *pfs)


def test_ls_verify_wait_from_a_shell(tmp_path, job):
    saved = run_mpi(4, str(job), str(tmp_path), "save")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    listing = bbio_ckpt(tmp_path, "ls", node=1)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines() if line.startswith("run ")]
    assert rows == [
        ["run", "1", "complete", "committed", "-"],
        ["run", "2", "complete", "committed", "-"],
    ]
    verified = bbio_ckpt(tmp_path, "verify", "run")
    assert verified.returncode == 0, verified.stderr
    # 2 steps x (2 node files + global.h5) on the PFS, and node 0's 2 drained BB copies
    assert "8 checkpoint file(s) verified" in verified.stdout
    waited = bbio_ckpt(tmp_path, "wait", "run", "--step", "2", "--timeout", "5")
    assert waited.returncode == 0 and "step 2 is committed" in waited.stdout
    missing = bbio_ckpt(tmp_path, "wait", "run", "--step", "3", "--timeout", "1")
    assert missing.returncode == 1 and "not committed after 1 s" in missing.stderr
    shutil.rmtree(tmp_path / "pfs" / "ckpt" / "run" / "step-00000001")  # as retention does
    started = time.monotonic()
    gone = bbio_ckpt(tmp_path, "wait", "run", "--step", "1", "--timeout", "60")
    assert gone.returncode == 1 and time.monotonic() - started < 30
    assert "step 2 is committed: retention removed it, or it was never saved" in gone.stderr
    node_file = tmp_path / "pfs" / "ckpt" / "run" / "step-00000002" / "node-00001.h5"
    data = bytearray(node_file.read_bytes())
    data[-100] ^= 0xFF
    node_file.write_bytes(bytes(data))
    broken = bbio_ckpt(tmp_path, "verify", "run")
    assert broken.returncode == 1
    assert str(node_file) in broken.stderr and "Traceback" not in broken.stderr


def _without(path: Path, key: str) -> str:
    document = json.loads(path.read_text())
    del document[key]
    return json.dumps(document)


@pytest.mark.parametrize("damage", ["not JSON", "a field missing"])
def test_one_damaged_manifest_or_record_is_named_and_passed_over(tmp_path, job, damage):
    saved = run_mpi(4, str(job), str(tmp_path), "save")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    manifest = tmp_path / "pfs" / "ckpt" / "run" / "step-00000001" / "manifest.json"
    record = tmp_path / "bb" / "1" / "ckpt" / "run" / "step-00000002" / "node-00001.json"
    if damage == "not JSON":
        manifest.write_text("{garbage")
        record.write_text("")
    else:  # before: a KeyError's traceback from verify
        manifest.write_text(_without(manifest, "files"))
        record.write_text(_without(record, "size"))
    listing = bbio_ckpt(tmp_path, "ls", node=1)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines() if line.startswith("run ")]
    assert rows[0][:2] == ["run", "1"] and "damaged manifest" in " ".join(rows[0]), rows
    assert rows[1][:2] == ["run", "2"] and "committed" in rows[1], rows
    verified = bbio_ckpt(tmp_path, "verify", "run", node=1)
    assert verified.returncode == 1 and "Traceback" not in verified.stderr
    assert "2 checkpoint file(s) damaged or differing" in verified.stderr, verified.stderr
    assert str(manifest) in verified.stderr and str(record) in verified.stderr
    restored = run_mpi(4, str(job), str(tmp_path), "restore")  # node 1's BB copy unusable
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert "restored step 2 rows 1000" in restored.stdout


def test_drain_finish_says_what_it_drained(tmp_path, job):
    from bbio.checkpoint import drain, layout
    from bbio.transfer import files

    saved = run_mpi(4, str(job), str(tmp_path), "save")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    idle = bbio_ckpt(tmp_path, "drain", "--finish", "--timeout", "30")
    assert idle.returncode == 0, idle.stderr
    assert f"nothing to drain in {tmp_path / 'bb' / '0'}: no checkpoint step queued" in idle.stdout
    # node 0's drain died before step 2 was committed: its task is still queued
    bb, pfs = tmp_path / "bb" / "0" / "ckpt" / "run", tmp_path / "pfs" / "ckpt" / "run"
    bb_step, pfs_step = bb / layout.step_dirname(2), pfs / layout.step_dirname(2)
    drain.manifest_path(pfs_step).unlink()
    record = files.read_json(bb_step / layout.node_record_name(0))
    task = drain.Task("run", 2, 0, 2, str(bb_step), str(pfs_step), 5, save_time=record["time"])
    drain.add_task(drain.journal_dir(bb), task)
    finished = bbio_ckpt(tmp_path, "drain", "--finish", "--timeout", "30")
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.strip() == (
        f"drained the queued checkpoint step(s) in {tmp_path / 'bb' / '0'} to the PFS (run: 1)"
    )
    assert drain.read_manifest(pfs_step) is not None


def test_a_damaged_task_file_is_named_and_the_other_steps_are_drained(tmp_path, job):
    """Before, a task file of the wrong fields was a TypeError's traceback in ``ls`` and
    ``drain --finish``, and killed the drain, which then drained nothing; ``wait`` for
    its step waited until its timeout."""
    from bbio.checkpoint import drain, layout
    from bbio.transfer import files

    saved = run_mpi(4, str(job), str(tmp_path), "save")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    bb, pfs = tmp_path / "bb" / "0" / "ckpt" / "run", tmp_path / "pfs" / "ckpt" / "run"
    journal = drain.journal_dir(bb)
    for step in (1, 2):  # node 0's drain died before either was committed
        drain.manifest_path(pfs / layout.step_dirname(step)).unlink()
    (pfs / layout.step_dirname(2) / layout.node_record_name(0)).unlink()  # nor step 2 copied
    bb_step, pfs_step = bb / layout.step_dirname(1), pfs / layout.step_dirname(1)
    record = files.read_json(bb_step / layout.node_record_name(0))
    task = drain.Task("run", 1, 0, 2, str(bb_step), str(pfs_step), 5, save_time=record["time"])
    drain.add_task(journal, task)
    damaged = drain.task_path(journal, 2)
    damaged.write_text(json.dumps({"name": "run", "step": 2}))

    def queue_column() -> dict[str, str]:
        listing = bbio_ckpt(tmp_path, "ls")
        assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr
        rows = [line for line in listing.stdout.splitlines() if line.startswith("run ")]
        return {row.split()[1]: row.rsplit("  ", 1)[-1].strip() for row in rows}

    assert queue_column() == {"1": "queued", "2": "damaged task"}
    finished = bbio_ckpt(tmp_path, "drain", "--finish", "--timeout", "30")
    assert finished.returncode == 1 and "Traceback" not in finished.stderr
    assert "the drain's task file is damaged" in finished.stderr, finished.stderr
    assert str(damaged) in finished.stderr
    assert drain.read_manifest(pfs_step) is not None  # step 1 drained and committed all the same
    assert (bb / layout.step_dirname(2)).is_dir()  # the damaged task's copy is kept
    assert queue_column() == {"1": "-", "2": "set aside"}
    verified = bbio_ckpt(tmp_path, "verify", "run")
    assert verified.returncode == 1 and str(damaged) in verified.stderr
    assert "Traceback" not in verified.stderr
    started = time.monotonic()
    waited = bbio_ckpt(tmp_path, "wait", "run", "--step", "2", "--timeout", "60")
    assert waited.returncode == 1 and time.monotonic() - started < 30
    assert "step 2 will not be committed: set aside on this node" in waited.stderr


def test_a_damaged_task_file_of_a_committed_save_is_removed(tmp_path, job):
    """Before, its save was set aside: ``damaged.json`` beside the committed manifest,
    ``verify`` failing, and the epilog failing and draining the node."""
    from bbio.checkpoint import drain, layout

    saved = run_mpi(4, str(job), str(tmp_path), "save")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    damaged = drain.task_path(drain.journal_dir(tmp_path / "bb" / "0" / "ckpt" / "run"), 2)
    damaged.write_text(json.dumps({"name": "run", "step": 2}))
    finished = bbio_ckpt(tmp_path, "drain", "--finish", "--timeout", "30")
    assert finished.returncode == 0, finished.stderr
    assert "(removed: its save is committed)" in finished.stderr, finished.stderr
    pfs_step = tmp_path / "pfs" / "ckpt" / "run" / layout.step_dirname(2)
    assert not damaged.exists() and not drain.damaged_on_pfs(pfs_step).exists()
    verified = bbio_ckpt(tmp_path, "verify", "run")
    assert verified.returncode == 0, verified.stderr


@pytest.mark.parametrize("action", ["wait", "drain"])
@pytest.mark.parametrize("timeout", ["nan", "-5"])
def test_a_timeout_that_is_not_seconds_is_refused(tmp_path, action, timeout):
    """Before, ``--timeout nan`` waited for ever and ``-5`` timed out at once."""
    (tmp_path / "bb" / "0" / "ckpt" / "run").mkdir(parents=True)
    name = ["run", "--step", "1"] if action == "wait" else ["--finish"]
    refused = bbio_ckpt(tmp_path, action, *name, "--timeout", timeout)
    assert refused.returncode == 1 and not refused.stdout, refused.stdout
    assert refused.stderr.startswith(f"bbio: error: {action}: timeout must be "), refused.stderr


def test_drain_finish_fails_on_a_burst_buffer_that_does_not_exist(tmp_path):
    missing = bbio_ckpt(tmp_path, "drain", "--finish", node=3)
    assert missing.returncode == 1 and not missing.stdout
    assert f"no burst-buffer directory {tmp_path / 'bb' / '3'}" in missing.stderr
    assert "Check --bb-root and --node" in missing.stderr and "Traceback" not in missing.stderr
    ignored = run_python("-m", "bbio", "ckpt", "drain", "--finish", "--pfs-root", str(tmp_path))
    assert ignored.returncode == 2 and "unrecognized arguments: --pfs-root" in ignored.stderr


@pytest.mark.parametrize("action", ["ls", "verify"])
def test_ls_and_verify_fail_on_roots_or_names_that_exist_nowhere(tmp_path, action):
    nowhere = bbio_ckpt(tmp_path, action)
    assert nowhere.returncode == 1 and not nowhere.stdout
    assert f"neither the burst buffer {tmp_path / 'bb' / '0'} nor the PFS root" in nowhere.stderr
    assert "Check --bb-root, --pfs-root and --node" in nowhere.stderr
    (tmp_path / "pfs" / "ckpt" / "run").mkdir(parents=True)
    typo = bbio_ckpt(tmp_path, action, "rnu")
    assert typo.returncode == 1 and not typo.stdout
    assert f"no checkpointer 'rnu' in {tmp_path / 'bb' / '0' / 'ckpt'} or " in typo.stderr
    assert "Checkpointers there: run" in typo.stderr and "Traceback" not in typo.stderr
    assert bbio_ckpt(tmp_path, action, "run").returncode == 0


@pytest.mark.parametrize("step", [["--step", "1"], []], ids=["a-step", "the-newest"])
def test_wait_for_a_name_that_exists_nowhere_fails_at_once(tmp_path, step):
    """Also without ``--step`` (the newest step here): before, that error named the burst
    buffer alone and listed no names."""
    (tmp_path / "pfs" / "ckpt" / "run").mkdir(parents=True)
    started = time.monotonic()
    typo = bbio_ckpt(tmp_path, "wait", "rnu", *step, "--timeout", "60")
    assert time.monotonic() - started < 30  # not polled until the timeout
    assert typo.returncode == 1 and not typo.stdout
    assert "no checkpointer 'rnu' in" in typo.stderr and "Checkpointers there: run" in typo.stderr


def test_wait_without_a_copy_here_suggests_step(tmp_path):
    (tmp_path / "bb" / "0" / "ckpt" / "run").mkdir(parents=True)
    waited = bbio_ckpt(tmp_path, "wait", "run", "--timeout", "1")
    assert waited.returncode == 1
    assert "no checkpoint 'run' in this burst buffer" in waited.stderr
    assert "Wait for a given step with --step" in waited.stderr


@pytest.mark.timeout(700)  # two jobs of up to 300 s each
def test_a_rank_killed_during_save_never_leaves_a_restorable_partial_checkpoint(tmp_path, job):
    died = run_mpi(4, str(job), str(tmp_path), "die-while-saving", timeout=300)
    assert died.returncode != 0, "rank 1 was supposed to be killed"
    restored = run_mpi(4, str(job), str(tmp_path), "restore", timeout=300)
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert "restored step 1 rows 1000" in restored.stdout


@pytest.mark.timeout(900)  # three jobs of up to 300 s each
@pytest.mark.parametrize("nth", [1, 2])
def test_a_save_killed_between_its_task_and_its_record_is_neither_restored_nor_drained(
    tmp_path, job, nth
):
    """The job dies before the nth of a save's two bookkeeping writes on each node (its
    drain's task, its node's record): after the epilog, the restore takes the newest
    committed checkpoint, which a save the drains could not commit must never outdo."""
    died = run_mpi(4, str(job), str(tmp_path), "die-while-recording", str(nth), timeout=300)
    assert died.returncode != 0, "the node leaders were supposed to be killed"
    for node in (0, 1):
        finished = bbio_ckpt(tmp_path, "drain", "--finish", "--timeout", "120", node=node)
        assert finished.returncode == 0, finished.stdout + finished.stderr
        assert "set aside" not in finished.stderr, finished.stderr
    pfs = tmp_path / "pfs" / "ckpt" / "run"
    assert (pfs / "step-00000001" / "manifest.json").exists()
    assert not (pfs / "step-00000002" / "manifest.json").exists()
    restored = run_mpi(4, str(job), str(tmp_path), "restore", timeout=300)
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert "restored step 1 rows 1000" in restored.stdout


def test_an_error_on_one_rank_inside_with_ends_the_job_instead_of_hanging(tmp_path, job):
    # `python -m mpi4py` aborts the job on an uncaught exception (plain `python` would
    # wait in MPI_Finalize for the other ranks); bbio must not wait for them before that
    args = ("-m", "mpi4py", str(job), str(tmp_path), "raise-inside-with")
    failed = run_mpi(4, *args, timeout=120)
    assert failed.returncode != 0
    assert "the training failed on rank 0" in failed.stdout + failed.stderr


def test_trimming_never_deletes_a_copy_that_is_not_drained(tmp_path):
    from bbio.checkpoint import drain, layout
    from bbio.transfer import files

    bb, pfs = tmp_path / "bb" / "ckpt" / "run", tmp_path / "pfs" / "ckpt" / "run"
    journal = drain.journal_dir(bb)
    journal.mkdir(parents=True)
    for step in (1, 2, 3, 4):
        step_dir = bb / layout.step_dirname(step)
        step_dir.mkdir()
        (step_dir / layout.node_filename(0)).write_bytes(b"x")
        drained = step != 2  # step 2: just written, its drain has not copied it yet
        record = {"size": 1, "crc32c": 7 if drained else None, "node": 0, "complete": True}
        files.write_json_atomic(step_dir / layout.node_record_name(0), record)
    (pfs / layout.step_dirname(9)).mkdir(parents=True)  # a newer step is committed
    files.write_json_atomic(drain.manifest_path(pfs / layout.step_dirname(9)), sound_manifest(9))
    assert drain.trim_bb(bb, 0, 1, pfs, journal) == 1  # step 2 still waits for its drain
    left = sorted(p.name for p in bb.glob("step-*"))
    assert left == [layout.step_dirname(2), layout.step_dirname(4)]
