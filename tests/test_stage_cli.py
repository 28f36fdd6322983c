"""End-to-end tests of ``bbio stage-in`` and ``bbio verify`` under ``mpirun``.

Serial tests: each launches ``mpirun -n N python -m bbio ...`` in subprocesses,
with ``BBIO_RANKS_PER_NODE`` set so that the ranks form two virtual nodes, each
with its own burst-buffer directory ``DST/{node}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import pwd
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tty
from pathlib import Path

import crc32c
import numpy as np
import pytest

from bbio.transfer import files
from tests.conftest import MPI_ENV, REPO, run_mpi

META = ".bbio"
# (ranks, BBIO_RANKS_PER_NODE): both give two virtual nodes
LAYOUTS = [pytest.param(2, "1", id="2ranks"), pytest.param(4, "2", id="4ranks")]

_BASE = np.random.default_rng(20240601).integers(0, 256, 8 << 20, dtype=np.uint8)


def payload(size: int, salt: int) -> bytes:
    """``size`` random-looking bytes, different for every ``salt`` and every 4 KiB page.

    Cheap to make: a shared random block, read from an offset chosen by ``salt``, with
    each 4 KiB page stamped with (salt, page index), so that misplaced pages are detected.
    """
    start = (salt * 32771) % (_BASE.size // 2)
    data = np.resize(_BASE[start:], ((size + 4095) // 4096) * 4096)
    stamps = data.view(np.uint64)[::512]
    stamps[:] = np.arange(stamps.size, dtype=np.uint64) + (np.uint64(salt) << np.uint64(40))
    return data[:size].tobytes()


def make_tree(root: Path, spec: dict[str, int]) -> None:
    """Write files ``root/path`` of the given sizes."""
    for salt, (rel, size) in enumerate(sorted(spec.items()), start=1):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(payload(size, salt))


def final_files(root: Path) -> dict[str, Path]:
    """Regular files under their final names (not bbio's metadata or temporary files)."""
    found = {}
    for directory, dirs, names in os.walk(root):
        if Path(directory) == root and META in dirs:
            dirs.remove(META)
        for name in names:
            path = Path(directory) / name
            if not files.is_temp_name(name):
                found[path.relative_to(root).as_posix()] = path
    return found


def temp_files(root: Path) -> list[Path]:
    return [Path(d) / n for d, _, names in os.walk(root) for n in names if files.is_temp_name(n)]


def manifest(node_dst: Path) -> Path:
    return node_dst / META / "manifest.json"


def assert_same_file(copy: Path, source: Path) -> None:
    assert copy.read_bytes() == source.read_bytes(), f"{copy} differs from {source}"
    assert copy.stat().st_mtime_ns == source.stat().st_mtime_ns, f"{copy}: mtime not kept"


def assert_tree_equal(node_dst: Path, src: Path) -> None:
    """``node_dst`` holds exactly the files of ``src``, byte for byte, and no temporary files.

    Its manifest lists every file with the source's size, mtime and CRC32C.
    """
    copies, sources = final_files(node_dst), final_files(src)
    assert sorted(copies) == sorted(sources)
    for rel, path in sources.items():
        assert_same_file(copies[rel], path)
    assert temp_files(node_dst) == []
    document = json.loads(manifest(node_dst).read_text())
    listed = {e["path"]: e for e in document["entries"] if e["kind"] == "file"}
    assert sorted(listed) == sorted(sources)
    for rel, path in sources.items():
        st, entry = path.stat(), listed[rel]
        assert (entry["size"], entry["mtime_ns"]) == (st.st_size, st.st_mtime_ns), rel
        assert entry.get("crc32c") == crc32c.crc32c(path.read_bytes()), f"{rel}: wrong CRC32C"


def summary_count(stdout: str, label: str) -> int:
    match = re.search(rf"^{label}\s+(\d+)\s*$", stdout, re.MULTILINE)
    assert match, f"no '{label}' line in the summary:\n{stdout}"
    return int(match.group(1))


def stage_in(n: int, rpn: str, src: Path, dst: str, *extra: str, timeout: float = 120):
    env = {"BBIO_RANKS_PER_NODE": rpn, "BBIO_PROGRESS": "auto"}
    return run_mpi(
        n,
        "-m",
        "bbio",
        "stage-in",
        str(src),
        dst,
        *extra,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )


def stop(proc: subprocess.Popen, *rank_pids: int) -> None:
    """End ``mpirun`` (which ends its ranks) if it still runs; SIGKILL what is left of it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    for pid in rank_pids:  # only while it is still a live bbio rank (pids get reused)
        with contextlib.suppress(OSError):
            if (
                _state(pid) not in (None, "Z")
                and b"bbio" in Path(f"/proc/{pid}/cmdline").read_bytes()
            ):
                os.kill(pid, signal.SIGKILL)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr


# ------------------------------------------------------- 1. resume after kill -9

BIG_TREE = {
    **{
        f"d{i % 8}/f{i:03d}.bin": int(size) << 10
        for i, size in enumerate(np.random.default_rng(7).integers(16, 257, 400))
    },
    # larger than the 64 MiB chunk size (copied in two pieces each), and last in path
    # order: committed after the small files, their fsync keeps the run interruptible
    "zz/big-a.bin": (72 << 20) + 12345,
    "zz/big-b.bin": (72 << 20) + 54321,
}


@pytest.fixture(scope="module")
def big_src(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("big") / "src"
    make_tree(src, BIG_TREE)
    return src


def _rank_pids(mpirun_pid: int) -> dict[int, int]:
    """{MPI rank: pid} of the rank processes ``mpirun`` started (its children, via /proc)."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != mpirun_pid:
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                ranks[int(item.split(b"=", 1)[1])] = int(entry)
    return ranks


def _state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` ("R", "S", "D", "T", "Z"...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _wait_state(pid: int, states: str, timeout: float) -> bool:
    """Wait until ``pid`` is in one of ``states`` or gone; False on timeout."""
    deadline = time.monotonic() + timeout
    while (state := _state(pid)) is not None and state not in states:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _interrupt_after_first_commit(
    proc: subprocess.Popen, n: int, per_node: int, nodes: list[Path], ranks: dict[int, int]
) -> int:
    """Kill -9 one rank of a running stage-in as soon as some files are committed.

    Every rank is stopped for a moment, so that what is committed stays put while
    the victim is chosen: the last rank of the node with the fewest committed files
    (the node is then surely unfinished, and that rank commits the big files last).
    Fills ``ranks`` ({rank: pid}); returns the victim's rank.
    """
    deadline = time.monotonic() + 120
    while len(ranks) < n or not any(final_files(node) for node in nodes if node.is_dir()):
        assert proc.poll() is None, "stage-in ended before any file was seen committed"
        assert time.monotonic() < deadline, "no file was committed in time"
        if len(ranks) < n:
            ranks.update(_rank_pids(proc.pid))
        time.sleep(0.002)
    for pid in ranks.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        for pid in ranks.values():  # a rank inside a system call stops when it returns
            assert _wait_state(pid, "TtZ", 30), f"rank process {pid} did not stop"
        assert proc.poll() is None, "stage-in ended before any rank was killed"
        assert not any(manifest(node).exists() for node in nodes), "stage-in had finished"
        counts = [len(final_files(node)) if node.is_dir() else 0 for node in nodes]
        victim = (counts.index(min(counts)) + 1) * per_node - 1
        os.kill(ranks[victim], signal.SIGKILL)
        assert _wait_state(ranks[victim], "Z", 30), "the killed rank did not die"
    finally:
        for pid in ranks.values():  # the others carry on until mpirun ends them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    proc.wait(timeout=60)
    for pid in ranks.values():  # no rank may still be writing while we look
        assert _wait_state(pid, "Z", 30), f"rank process {pid} outlived mpirun"
    return victim


@pytest.mark.parametrize(("n", "rpn"), LAYOUTS)
def test_resume_after_kill(tmp_path, big_src, n, rpn):
    dst = tmp_path / "bb"
    nodes = [dst / "0", dst / "1"]
    # niced, so that this process sees the first commits at once on a busy machine
    cmd = ["nice", "-n", "19", "mpirun", "-n", str(n), sys.executable, "-m", "bbio"]
    cmd += ["stage-in", str(big_src), str(dst / "{node}")]
    # rounds of about 20 small files: the kill lands with most rounds not yet begun
    env = {**os.environ, **MPI_ENV, "BBIO_RANKS_PER_NODE": rpn}
    env["BBIO_STAGE_ROUND_BYTES"] = str(8 << 20)
    log = tmp_path / "killed.log"
    ranks: dict[int, int] = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        victim = _interrupt_after_first_commit(proc, n, int(rpn), nodes, ranks)
    finally:
        stop(proc, *ranks.values())
    assert proc.returncode != 0, f"mpirun exited 0 after rank {victim} was killed"

    sources = final_files(big_src)
    survivors = 0
    for node in nodes:
        assert not manifest(node).exists(), "the killed run wrote a manifest"
        present = final_files(node)
        assert set(present) <= set(sources)
        for rel, path in present.items():
            assert_same_file(path, sources[rel])
        survivors += len(present)
    # Files are committed round by round: the killed run keeps the rounds it finished
    # (every committed file intact), and the rerun copies only the rest.
    assert 0 < survivors < 2 * len(sources), f"not interrupted:\n{log.read_text()}"

    result = stage_in(n, rpn, big_src, str(dst / "{node}"))
    assert_ok(result)
    assert summary_count(result.stdout, "files already up to date") == survivors
    assert summary_count(result.stdout, "files copied") == 2 * len(sources) - survivors
    for node in nodes:
        assert_tree_equal(node, big_src)


# --------------------------------------------------------- 2. unreadable files


def _unprivileged(tmp_root: Path) -> tuple[list[str], dict[str, str]]:
    """A command prefix (and environment) that runs without root's file access override.

    As root: as user ``nobody`` when ``nobody`` can run this interpreter, else as root
    without the capabilities that bypass permission checks (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH).
    """
    if os.geteuid() != 0:
        return [], {}
    probe = subprocess.run(
        ["runuser", "-u", "nobody", "--", sys.executable, "-c", "import bbio, mpi4py"],
        capture_output=True,
        timeout=30,
        cwd=tmp_root,
    )
    if probe.returncode == 0:
        home = tmp_root / "home"
        home.mkdir()
        home.chmod(0o777)
        # runuser sets HOME to nobody's (nonexistent) home; env sets it back
        return ["runuser", "-u", "nobody", "--", "env", f"HOME={home}"], {}
    drop = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", "--"], {}


@pytest.fixture
def world_tmp():
    """A temporary directory under /tmp that any user may use (removed afterwards)."""
    path = Path(tempfile.mkdtemp(prefix="bbio-test-", dir="/tmp"))
    path.chmod(0o777)
    umask = os.umask(0o022)  # what root makes there, the unprivileged user may read
    try:
        yield path
    finally:
        os.umask(umask)
        shutil.rmtree(path)


def test_unreadable_file(world_tmp):
    src = world_tmp / "src"
    make_tree(src, {"ok.bin": 5000, "sub/secret.bin": 3000, "sub/fine.bin": 100})
    secret = src / "sub" / "secret.bin"
    secret.chmod(0o000)
    prefix, extra_env = _unprivileged(world_tmp)
    env = {**os.environ, **MPI_ENV, **extra_env, "BBIO_RANKS_PER_NODE": "1"}

    def run(dst: Path, *flags: str) -> subprocess.CompletedProcess:
        cmd = [*prefix, "mpirun", "-n", "2", sys.executable, "-m", "bbio", "stage-in"]
        return subprocess.run(
            [*cmd, *flags, str(src), str(dst / "{node}")],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            cwd=world_tmp,
        )

    failed = run(world_tmp / "strict")
    assert failed.returncode != 0
    assert failed.stderr.count("bbio: error:") == 1, failed.stderr
    error_line = next(line for line in failed.stderr.splitlines() if "bbio: error:" in line)
    assert "sub/secret.bin" in error_line
    assert "sub/fine.bin" not in error_line and "ok.bin" not in error_line
    assert "Traceback" not in failed.stderr
    for node in ("0", "1"):
        copied = [p for p in (world_tmp / "strict" / node).rglob("*") if not p.is_dir()]
        assert copied == [], f"files written although the stage-in failed: {copied}"

    skipped = run(world_tmp / "lenient", "--skip-unreadable")
    assert_ok(skipped)
    warnings = [
        line
        for line in (skipped.stdout + skipped.stderr).splitlines()
        if "sub/secret.bin" in line and "skip" in line.lower()
    ]
    assert len(warnings) == 1, skipped.stdout + skipped.stderr
    assert summary_count(skipped.stdout, "skipped") == 1
    for node in ("0", "1"):
        root = world_tmp / "lenient" / node
        assert sorted(final_files(root)) == ["ok.bin", "sub/fine.bin"]
        assert_same_file(root / "ok.bin", src / "ok.bin")
        assert_same_file(root / "sub" / "fine.bin", src / "sub" / "fine.bin")
        assert manifest(root).is_file()
        document = json.loads(manifest(root).read_text())
        assert [e["path"] for e in document["entries"] if e["kind"] == "file"] == [
            "ok.bin",
            "sub/fine.bin",
        ]
        assert [s["path"] for s in document["attrs"]["skipped"]] == ["sub/secret.bin"]

    # Reading the directory as a dataset: the copy skipped a file, so the files are
    # listed on the PFS, where one cannot be read; open_dataset has no --skip-unreadable.
    opened = subprocess.run(
        [*prefix, "mpirun", "-n", "2", sys.executable, "-c", _OPEN_DATASET, str(src)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=world_tmp,
    )
    refusals = [line for line in opened.stdout.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 2 and refusals[0] == refusals[1], opened.stdout + opened.stderr
    assert "1 path(s) in" in refusals[0] and "sub/secret.bin: permission denied" in refusals[0]
    assert "or move them out of the directory" in refusals[0] and "--skip" not in refusals[0]


def test_a_read_only_source_directory_does_not_block_a_rerun(world_tmp):
    src = world_tmp / "src"
    make_tree(src, {"ro/a.bin": 100})
    (src / "ro").chmod(0o555)
    prefix, extra_env = _unprivileged(world_tmp)
    env = {**os.environ, **MPI_ENV, **extra_env, "BBIO_RANKS_PER_NODE": "1"}
    command = [*prefix, "mpirun", "-n", "2", sys.executable, "-m", "bbio", "stage-in"]
    command += [str(src), str(world_tmp / "dst" / "{node}")]

    def stage_in() -> None:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=60, cwd=world_tmp
        )
        assert_ok(done)

    stage_in()
    (src / "ro").chmod(0o755)
    (src / "ro" / "b.bin").write_bytes(b"new")
    (src / "ro").chmod(0o555)
    stage_in()  # the copy of ro/ is read-only too: the rerun still copies b.bin into it
    for node in ("0", "1"):
        copy = world_tmp / "dst" / node / "ro"
        assert (copy / "b.bin").read_bytes() == b"new"
        assert copy.stat().st_mode & 0o777 == 0o555


# Rank 0 prints every rank's outcome: lines printed by two ranks at once can interleave.
_OPEN_DATASET = (
    "import sys; from mpi4py import MPI; import bbio\n"
    "outcome = 'opened'\n"
    "try:\n"
    "    bbio.open_dataset(MPI.COMM_WORLD, sys.argv[1]).close()\n"
    "except bbio.PermissionDeniedError as exc:\n"
    "    outcome = 'refused: ' + str(exc).replace(chr(10), ' ')\n"
    "outcomes = MPI.COMM_WORLD.gather(outcome)\n"
    "if MPI.COMM_WORLD.rank == 0:\n"
    "    print(chr(10).join(outcomes), flush=True)\n"
)


_READABLE_PROBE = (
    "import json, os, sys; from bbio.stage.walk import readable; "
    "print(json.dumps({p: [readable(p, os.lstat(p)), os.access(p, os.R_OK, effective_ids=True)] "
    "for p in sys.argv[1:]}))"
)


def test_readable_agrees_with_the_kernel_for_another_user(world_tmp):
    """The walk's readability check, run as an unprivileged user on files it owns and
    files it does not, with every combination of read bits."""
    prefix, extra_env = _unprivileged(world_tmp)
    owners = [(os.getuid(), os.getgid())]
    if prefix[:1] == ["runuser"]:
        nobody = pwd.getpwnam("nobody")
        owners.append((nobody.pw_uid, nobody.pw_gid))
    paths = []
    for uid, gid in owners:
        for mode in (0o444, 0o440, 0o404, 0o400, 0o044, 0o040, 0o004, 0o000):
            path = world_tmp / f"f-{uid}-{mode:03o}"
            path.write_bytes(b"data")
            os.chown(path, uid, gid)
            path.chmod(mode)
            paths.append(str(path))
    probe = subprocess.run(
        [*prefix, sys.executable, "-c", _READABLE_PROBE, *paths],
        capture_output=True,
        text=True,
        env={**os.environ, **extra_env},
        timeout=60,
        cwd=world_tmp,
    )
    assert probe.returncode == 0, probe.stderr
    answers = json.loads(probe.stdout)
    assert {p: a for p, (a, b) in answers.items() if a != b} == {}, answers


def test_unreadable_directory_is_named(world_tmp):
    src = world_tmp / "src"
    make_tree(src, {"ok.bin": 100, "locked/inside.bin": 100, "listonly/inside.bin": 100})
    (src / "locked").chmod(0o000)
    (src / "listonly").chmod(0o444)  # its names can be read, not stat'ed
    prefix, extra_env = _unprivileged(world_tmp)
    env = {**os.environ, **MPI_ENV, **extra_env, "BBIO_RANKS_PER_NODE": "1"}
    command = [*prefix, "mpirun", "-n", "2", sys.executable, "-m", "bbio", "stage-in"]

    def error_line(*flags: str) -> str:
        failed = subprocess.run(
            [*command, *flags, str(src), str(world_tmp / "dst" / "{node}")],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            cwd=world_tmp,
        )
        assert failed.returncode != 0
        assert "Traceback" not in failed.stderr
        return next(line for line in failed.stderr.splitlines() if "bbio: error:" in line)

    try:
        everything = error_line()
        excluded = error_line("--exclude", "listonly/*")
    finally:
        (src / "locked").chmod(0o755)
        (src / "listonly").chmod(0o755)
    assert "locked: cannot list directory" in everything, everything
    assert "listonly/inside.bin: cannot stat" in everything, everything
    assert "locked: cannot list directory" in excluded and "listonly" not in excluded, excluded


def test_an_excluded_directory_is_not_entered(world_tmp):
    """private/secret cannot be listed: an exclude glob that covers everything under it
    keeps stage-in and pack out of it; a glob that covers only some names does not."""
    src = world_tmp / "src"
    make_tree(src, {"ok.bin": 100, "private/notes.bin": 100, "private/secret/key.bin": 100})
    (src / "private" / "secret").chmod(0o000)
    prefix, extra_env = _unprivileged(world_tmp)
    env = {**os.environ, **MPI_ENV, **extra_env, "BBIO_RANKS_PER_NODE": "1"}

    def bbio(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*prefix, "mpirun", "-n", "2", sys.executable, "-m", "bbio", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            cwd=world_tmp,
        )

    try:
        staged = bbio("stage-in", "--exclude", "private/*", str(src), str(world_tmp / "a/{node}"))
        packed = bbio("pack", "--exclude", "private/*", str(src), str(world_tmp / "packed"))
        secret = bbio("stage-in", "--exclude", "*secret*", str(src), str(world_tmp / "b/{node}"))
        by_name = bbio("stage-in", "--exclude", "*.bin", str(src), str(world_tmp / "c/{node}"))
    finally:
        (src / "private" / "secret").chmod(0o755)
    assert_ok(staged)
    assert_ok(packed)
    assert_ok(secret)
    for node in ("0", "1"):
        assert sorted(final_files(world_tmp / "a" / node)) == ["ok.bin"]
        assert sorted(final_files(world_tmp / "b" / node)) == ["ok.bin", "private/notes.bin"]
    index = json.loads((world_tmp / "packed" / "bbio-pack.json").read_text())
    assert index["samples"] == 1
    assert by_name.returncode == 1  # "*.bin" does not cover "private/secret/": it is listed
    assert "private/secret: cannot list directory" in by_name.stderr, by_name.stderr


# ----------------------------------------------------------------- 3. progress


def _run_in_pty(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float):
    """Run ``cmd`` with a pseudo-terminal (raw mode) as stdout and stderr; (status, output)."""
    master, slave = pty.openpty()
    tty.setraw(slave)  # no "\n" -> "\r\n": every "\r" seen was written by the program
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, cwd=cwd
        )
    finally:
        os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(cmd, timeout)
            ready, _, _ = select.select([master], [], [], min(left, 1.0))
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        status = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        os.close(master)
        stop(proc)
    return status, b"".join(chunks).decode(errors="replace")


PROGRESS_LINE = re.compile(
    r"\r(?:\x1b\[K)?stage-in: [^\r\n]+ / [^\r\n]+, \d+ / \d+ files, \d+\.\d\d GB/s, ETA "
)


def test_progress_only_on_a_terminal(tmp_path):
    src = tmp_path / "src"
    make_tree(src, {"data/big.bin": 90 << 20, **{f"small/{i}.bin": 1 << 20 for i in range(10)}})
    cmd = ["mpirun", "-n", "2", sys.executable, "-m", "bbio", "stage-in", str(src)]
    env = {**os.environ, **MPI_ENV, "BBIO_RANKS_PER_NODE": "1", "BBIO_PROGRESS": "auto"}

    status, output = _run_in_pty([*cmd, str(tmp_path / "tty/{node}")], env, tmp_path, 90)
    assert status == 0, output
    assert "\r" in output and "GB/s" in output and "ETA" in output, repr(output)
    assert PROGRESS_LINE.search(output), repr(output)
    assert "files copied" in output  # the summary follows the progress line

    piped = stage_in(2, "1", src, str(tmp_path / "pipe/{node}"))
    assert_ok(piped)
    assert summary_count(piped.stdout, "files copied") == 2 * 11
    assert "ETA" not in piped.stdout and "ETA" not in piped.stderr
    assert "stage-in:" not in piped.stdout + piped.stderr


# ------------------------------------------------------------ 4. clear errors


def test_clear_errors(tmp_path):
    missing = tmp_path / "no" / "such-source"
    result = stage_in(2, "1", missing, str(tmp_path / "bb/{node}"), timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("bbio: error:") == 1, result.stderr
    error_line = next(line for line in result.stderr.splitlines() if "bbio: error:" in line)
    assert str(missing) in error_line and "does not exist" in error_line
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "bb").exists()

    bad_mode = stage_in(2, "1", tmp_path, str(tmp_path / "bb/{node}"), "--mode", "mirror")
    assert bad_mode.returncode == 2, bad_mode.stderr
    assert "invalid choice: 'mirror'" in bad_mode.stderr
    assert "Traceback" not in bad_mode.stderr + bad_mode.stdout
    assert not (tmp_path / "bb").exists()


# ------------------------------------------------------ 5. verify finds damage

SMALL_TREE = {
    "a.bin": 70_000,
    "b/c.bin": 1 << 20,
    "b/d.bin": 12_345,
    **{f"e/{i}.bin": 4096 * (i + 1) for i in range(6)},
}


@pytest.fixture(scope="module")
def small_src(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("small") / "src"
    make_tree(src, SMALL_TREE)
    return src


@pytest.mark.parametrize(("n", "rpn"), LAYOUTS)
def test_verify_detects_a_corrupted_byte(tmp_path, small_src, n, rpn):
    dst = tmp_path / "bb"
    assert_ok(stage_in(n, rpn, small_src, str(dst / "{node}")))

    def verify() -> subprocess.CompletedProcess:
        return run_mpi(
            n,
            "-m",
            "bbio",
            "verify",
            str(small_src),
            str(dst / "{node}"),
            env={"BBIO_RANKS_PER_NODE": rpn},
            timeout=60,
            cwd=REPO,
        )

    victim = dst / "1" / "b" / "c.bin"
    before = victim.stat()
    offset = 777_777
    with open(victim, "r+b") as f:
        f.seek(offset)
        original = f.read(1)
        f.seek(offset)
        f.write(bytes([original[0] ^ 0x5A]))
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert victim.stat().st_mtime_ns == before.st_mtime_ns

    damaged = verify()
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    assert damaged.stderr.count("bbio: error:") == 1, damaged.stderr
    assert str(victim) in damaged.stderr
    assert str(dst / "0" / "b" / "c.bin") not in damaged.stderr  # node 0's copy is fine
    assert "Traceback" not in damaged.stderr

    with open(victim, "r+b") as f:
        f.seek(offset)
        f.write(original)
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    repaired = verify()
    assert_ok(repaired)
    assert summary_count(repaired.stdout, "problems") == 0


HOST_WRAPPER = """#!/bin/sh
# each pair of ranks is a "host": its node's burst buffer seen at $ROOT/local
node=$((OMPI_COMM_WORLD_RANK / 2))
exec unshare -m --propagation private sh -c \
    "mount --bind $ROOT/bb/$node/x $ROOT/local && exec \\"\\$@\\"" sh "$@"
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="mount namespaces need root"
)
def test_verify_reads_each_hosts_copy_where_the_path_has_no_node(tmp_path):
    """Real hosts, simulated with a mount namespace per rank: every host has its own
    /local.  Before, verify dealt the files of a path without {node} over all ranks, so
    each host checked a share of its own copy, and a damaged file could pass."""
    src = tmp_path / "src"
    names = [f"f{i:02d}" for i in range(12)]
    make_tree(src, {name: 4096 for name in names})
    assert_ok(stage_in(4, "2", src, str(tmp_path / "bb" / "{node}" / "x")))
    for name in names:  # node 1's copies damaged, same size and mtime
        victim = tmp_path / "bb" / "1" / "x" / name
        before = victim.stat()
        victim.write_bytes(bytes(4096))
        os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    (tmp_path / "local").mkdir()
    wrapper = tmp_path / "host.sh"
    wrapper.write_text(HOST_WRAPPER)
    wrapper.chmod(0o755)
    env = {**os.environ, **MPI_ENV, "ROOT": str(tmp_path), "BBIO_RANKS_PER_NODE": "2"}
    command = ["mpirun", "-n", "4", str(wrapper), sys.executable, "-m", "bbio", "verify"]
    result = subprocess.run(
        [*command, str(src), str(tmp_path / "local")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "12 problem(s)" in result.stderr or all(n in result.stderr for n in names), result.stderr
    assert "Traceback" not in result.stderr


_READ_ONLY_CHANGE = """
import os, sys, threading, time
from pathlib import Path
from mpi4py import MPI
import bbio

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
hot = src / "f"


def change_for_a_while():
    end = time.monotonic() + 0.3
    counter = 0
    while time.monotonic() < end:
        counter += 1
        os.chmod(hot, 0o644)
        with open(hot, "ab") as f:
            f.write(b"+")
        os.chmod(hot, 0o444)
        os.utime(hot, ns=(counter, counter))
        time.sleep(0.0005)


writer = threading.Thread(target=change_for_a_while)
writer.start()
try:
    summary = bbio.stage_in(MPI.COMM_WORLD, src, dst)
finally:
    writer.join()
print(summary.files, (dst / "f").read_bytes() == hot.read_bytes(), oct((dst / "f").stat().st_mode))
"""


@pytest.mark.timeout(120)
def test_a_read_only_file_that_changed_is_copied_again_without_root_powers(tmp_path):
    """Its first copy is sealed read-only, like its source: the retry must not need to
    open that copy for writing (a user's job cannot; root without DAC override stands in)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"v1" * 50)
    os.chmod(src / "f", 0o444)
    dst = tmp_path / "bb"
    caps = "-dac_override,-dac_read_search"
    as_a_user = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]
    command = ["mpirun", "-n", "1", sys.executable, "-c", _READ_ONLY_CHANGE, str(src), str(dst)]
    result = subprocess.run(
        [*(as_a_user if os.geteuid() == 0 else []), *command],
        capture_output=True,
        text=True,
        env={**os.environ, **MPI_ENV, "BBIO_BB_ROOT": str(tmp_path / "bbroot")},
        timeout=100,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1", "True", "0o100444"]


def test_verify_on_fewer_nodes_than_a_shard_stage_in_is_refused(tmp_path, small_src):
    """Before, the files the missing node held were read by no rank, and verify passed."""
    dst = str(tmp_path / "bb" / "{node}")
    assert_ok(stage_in(4, "2", small_src, dst, "--mode", "shard"))
    one_node = run_mpi(
        2, "-m", "bbio", "verify", str(small_src), dst,
        env={"BBIO_RANKS_PER_NODE": "2"}, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert one_node.returncode == 1, one_node.stdout + one_node.stderr
    assert "the transfer left files on 2 nodes, and this verify runs on 1" in one_node.stderr
    assert "Traceback" not in one_node.stderr


OPEN_THE_PACK = """
import sys
from mpi4py import MPI
import bbio
try:
    with bbio.open_dataset(MPI.COMM_WORLD, sys.argv[1]) as ds:
        outcome = f"kind {ds.layout.kind} samples {len(ds)}"
except bbio.BBIOError as exc:
    outcome = f"{type(exc).__name__} {exc}"
outcomes = MPI.COMM_WORLD.allgather(outcome)
if MPI.COMM_WORLD.rank == 0:
    print("\\n".join(outcomes))
"""


def test_a_pack_killed_while_it_writes_is_no_dataset_until_packed_again(tmp_path):
    """Before, the killed pack's directory opened as a directory dataset whose samples were
    its shard files."""
    src, out = tmp_path / "src", tmp_path / "out"
    make_tree(src, {f"d/{i:03d}.bin": 256 << 10 for i in range(300)})
    env = {**os.environ, **MPI_ENV, "BBIO_RANKS_PER_NODE": "1", "BBIO_PROGRESS": "never"}
    command = ["mpirun", "-n", "2", sys.executable, "-m", "bbio", "pack", str(src), str(out)]
    proc = subprocess.Popen([*command, "--shard-size", "1M"], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob("shard-*.h5")):  # the pack is writing: its ranks die
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        for pid in ranks.stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop(proc)
    (tmp_path / "open.py").write_text(OPEN_THE_PACK)
    opened = run_mpi(2, str(tmp_path / "open.py"), str(out), env=env, timeout=60, cwd=REPO)
    assert opened.stdout.count("NotFoundError not a bbio pack yet") == 2, opened.stdout
    assert_ok(run_mpi(2, "-m", "bbio", "pack", str(src), str(out), env=env, cwd=REPO))
    opened = run_mpi(2, str(tmp_path / "open.py"), str(out), env=env, timeout=60, cwd=REPO)
    assert opened.stdout.count("kind packed samples 300") == 2, opened.stdout
