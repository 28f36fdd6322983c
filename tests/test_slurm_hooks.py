"""``bbio slurm prolog|epilog``: the job's burst-buffer directory, created and drained away."""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bbio import slurm
from bbio.checkpoint import drain, layout
from bbio.config import Config
from bbio.errors import ConfigError, IOFailure, PermissionDeniedError
from tests.conftest import run_python
from tests.test_ckpt_drain import two_node_save

NOBODY = pwd.getpwnam("nobody")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the hooks run as root (chown, setuid)")
JOB = slurm.Job("4242", "nobody", NOBODY.pw_uid, NOBODY.pw_gid)


@pytest.fixture
def site():
    """A node as a site sets it up: ``local/`` (the burst buffers' root, root's, 0755)
    and ``pfs/`` (the user's PFS directory), in a directory the user can traverse
    (pytest's temporary directories are root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="bbio-hooks-", dir="/tmp"))
    try:
        base.chmod(0o755)
        (base / "local").mkdir(mode=0o755)
        (base / "pfs").mkdir()
        os.chown(base / "pfs", NOBODY.pw_uid, NOBODY.pw_gid)
        yield base
    finally:
        subprocess.run(["rm", "-rf", "--", str(base)], check=True)  # trees of any depth


def hook_env(site: Path, bb_root: str | None = None) -> dict:
    """A hook's environment under slurmd, with the site file ``site``/bbio.toml: its
    ``bb_root`` (default ``site``/local/{user}/bbio-{job}/{node}) is what the hooks use."""
    site_file = site / "bbio.toml"
    bb_root = bb_root or str(site / "local" / "{user}" / "bbio-{job}" / "{node}")
    site_file.write_text(f'bb_root = "{bb_root}"\npfs_root = "{site / "pfs"}"\n')
    return {
        "SLURM_JOB_ID": JOB.id,
        "SLURM_JOB_USER": JOB.user,
        "SLURM_JOB_UID": str(JOB.uid),
        "SLURM_JOB_GID": str(JOB.gid),
        "BBIO_CONFIG": str(site_file),
        "BBIO_JOB_ID": "not-the-slurm-job",  # the hooks use Slurm's job id regardless
    }


def chown_tree(path: Path, uid: int, gid: int) -> None:
    """What the job's ranks write is the user's (``chown -R``: trees of any depth)."""
    subprocess.run(["chown", "-R", "-h", f"{uid}:{gid}", "--", str(path)], check=True)


@as_root
def test_the_epilog_drains_as_the_user_and_removes_the_job_directory_as_root(site):
    env = hook_env(site)
    created = run_python("-m", "bbio", "slurm", "prolog", env=env)
    assert created.returncode == 0, created.stderr
    job_dir = site / "local" / "nobody" / "bbio-4242"  # {user}: the job's, not root
    st = job_dir.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (JOB.uid, JOB.gid, 0o700)
    assert job_dir.parent.stat().st_uid == 0  # the user cannot remove the job directory
    journals = two_node_save(job_dir, 7, 1.5, pfs_root=site / "pfs")  # the job's 2 nodes here
    chown_tree(job_dir, JOB.uid, JOB.gid)
    removed = run_python("-m", "bbio", "slurm", "epilog", "--timeout", "60", env=env)
    assert removed.returncode == 0, removed.stderr
    assert f"{job_dir} removed" in removed.stdout
    assert not job_dir.exists() and job_dir.parent.is_dir()
    pfs_step = site / "pfs" / layout.step_dirname(7)
    assert drain.read_manifest(pfs_step)["time"] == 1.5  # both nodes' files, committed
    for node in (0, 1):
        assert (pfs_step / layout.node_filename(node)).stat().st_uid == JOB.uid
    assert len(journals) == 2


@as_root
def test_epilog_keeps_what_it_cannot_drain_and_fails(site):
    env = hook_env(site)
    assert run_python("-m", "bbio", "slurm", "prolog", env=env).returncode == 0
    job_dir = site / "local" / "nobody" / "bbio-4242"
    journal = drain.journal_dir(job_dir / "0" / layout.CKPT_DIR / "run")
    journal.mkdir(parents=True)
    step = layout.step_dirname(5)
    task = drain.Task("run", 5, 0, 1, str(journal.parent / step), str(site / "pfs" / step), 3)
    drain.add_task(journal, task)  # its node file is missing: the copy cannot succeed
    chown_tree(job_dir, JOB.uid, JOB.gid)
    result = run_python("-m", "bbio", "slurm", "epilog", "--timeout", "2", env=env)
    assert result.returncode == 1
    assert "could not drain" in result.stderr and "is kept" in result.stderr
    assert job_dir.exists() and drain.task_path(journal, 5).exists()
    assert "step 5 set aside: its burst-buffer copy is gone" in result.stderr, result.stderr
    last_line = result.stderr.strip().splitlines()[-1]  # what the admin does about it
    assert "set aside is never drained" in last_line and f"{job_dir}" in last_line
    assert "remove it by hand, then resume the node" in last_line


def test_hooks_outside_slurm_say_so():
    result = run_python("-m", "bbio", "slurm", "prolog", env={"SLURM_JOB_ID": ""})
    assert result.returncode == 1
    assert "not run by Slurm" in result.stderr


def test_the_job_directory_is_bb_root_up_to_the_job_and_journals_are_found_below(tmp_path):
    site = slurm.Site(Config(bb_root=str(tmp_path / "{job}" / "n{node}")))
    job_dir = tmp_path / "4242"
    assert slurm.job_dir(site, JOB) == job_dir
    for where in ("n0", "n3", "n3/own-root"):  # own-root: a checkpointer given its bb_root
        drain.journal_dir(job_dir / where / layout.CKPT_DIR / "run").mkdir(parents=True)
    (job_dir / "n5" / layout.CKPT_DIR / "run").mkdir(parents=True)  # no journal
    (job_dir / "elsewhere").mkdir()
    (job_dir / "n9").symlink_to(job_dir / "n0", target_is_directory=True)
    found = slurm.journals_under(job_dir)
    expected = [job_dir / "n0", job_dir / "n3", job_dir / "n3" / "own-root"]
    assert found == [drain.journal_dir(d / layout.CKPT_DIR / "run") for d in expected]


@as_root
def test_the_prolog_hands_over_no_directory_it_did_not_make_for_the_user(site):
    env = hook_env(site)
    job_dir = site / "local" / "nobody" / "bbio-4242"
    job_dir.parent.mkdir(parents=True)
    job_dir.symlink_to(site / "pfs", target_is_directory=True)  # swapped in before the prolog
    linked = run_python("-m", "bbio", "slurm", "prolog", env=env)
    assert linked.returncode == 1 and "is not a directory" in linked.stderr
    assert (site / "pfs").stat().st_mode & 0o777 != 0o700  # not chmodded through the link
    job_dir.unlink()
    job_dir.mkdir()
    os.chown(job_dir, 1, 1)  # made by someone else (uid 1) before the job
    taken = run_python("-m", "bbio", "slurm", "prolog", env=env)
    assert taken.returncode == 1 and "belongs to uid 1" in taken.stderr
    assert job_dir.stat().st_uid == 1


@pytest.mark.parametrize(
    ("bb_root", "says"),
    [
        ("/tmp/bbio-{user}/bb/{node}", "has no {job}"),
        ("/local/{node}-{job}", "beside {job}"),
        ("local/{job}", "not an absolute path"),
        # before, accepted: root's home in the hooks, the user's home in the job
        ("~/bbio/{job}", "not an absolute path.*root's home"),
    ],
)
def test_a_bb_root_the_hooks_cannot_manage_per_job_is_refused(bb_root, says):
    with pytest.raises(ConfigError, match=says):
        slurm.job_dir(slurm.Site(Config(bb_root=bb_root)), JOB)


def test_an_empty_job_user_is_refused():
    """{user} would else be root's name in the job's directory."""
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_USER": "", "SLURM_JOB_UID": "65534"}
    with pytest.raises(ConfigError, match="SLURM_JOB_USER is empty"):
        slurm.Job.from_env(env)


def nest(root: Path, depth: int) -> Path:
    """``root``/d/d/.../d, ``depth`` directories deep (deeper than Python recurses)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)
    return root


@as_root
def test_a_job_directory_deeper_than_python_recurses_is_drained_and_removed(site):
    """Before, a path longer than PATH_MAX in it failed the epilog for good ("File name
    too long" while looking for journals), and the node stayed drained."""
    env = hook_env(site)
    assert run_python("-m", "bbio", "slurm", "prolog", env=env).returncode == 0
    job_dir = site / "local" / "nobody" / "bbio-4242"
    two_node_save(job_dir, 7, 1.5, pfs_root=site / "pfs")
    (job_dir / "deep").mkdir()
    nest(job_dir / "deep", 2100)  # a path of over 4200 characters: longer than PATH_MAX
    chown_tree(job_dir, JOB.uid, JOB.gid)
    removed = run_python("-m", "bbio", "slurm", "epilog", "--timeout", "60", env=env)
    assert removed.returncode == 0, removed.stderr[-2000:]
    assert not job_dir.exists()
    assert drain.read_manifest(site / "pfs" / layout.step_dirname(7))["time"] == 1.5


def a_job_whose_drain_hangs(site: Path, env: dict) -> tuple[Path, list[Path]]:
    """The prolog's job directory with a save of two nodes queued, node 0's record
    replaced by a FIFO (the drain's open() of it never returns); the directory and the
    nodes' journals."""
    assert run_python("-m", "bbio", "slurm", "prolog", env=env).returncode == 0
    job_dir = site / "local" / "nobody" / "bbio-4242"
    journals = two_node_save(job_dir, 7, 1.5, pfs_root=site / "pfs")
    record = drain.pending(journals[0])[0].source.parent / layout.node_record_name(0)
    record.unlink()
    os.mkfifo(record)
    return job_dir, journals


@as_root
def test_an_epilog_stuck_on_a_fifo_the_job_left_ends_at_its_timeout(site):
    """A record replaced by a FIFO: the drain's open() never returns.  The epilog must
    end, keep the data and fail, not hold the node for ever, and drain the other
    journals meanwhile (before, one child drained them one after another, and the
    other node's journal was never tried)."""
    env = hook_env(site)
    job_dir, journals = a_job_whose_drain_hangs(site, env)
    chown_tree(job_dir, JOB.uid, JOB.gid)
    code = (
        "from bbio import slurm, cli; slurm.ENDING_GRACE_SECONDS = 2; raise SystemExit(cli.main())"
    )
    started = time.monotonic()
    result = run_python("-c", code, "slurm", "epilog", "--timeout", "3", env=env, timeout=120)
    assert time.monotonic() - started < 60
    assert result.returncode == 1, result.stderr[-2000:]
    assert "not drained within 5 s: killed" in result.stderr and "is kept" in result.stderr
    assert job_dir.exists()
    assert str(journals[0]) in result.stderr and str(journals[1]) not in result.stderr
    assert (site / "pfs" / layout.step_dirname(7) / layout.node_record_name(1)).exists()


@as_root
@pytest.mark.parametrize("planted", ["symlink", "directory"])
def test_the_hooks_refuse_a_parent_of_the_job_directory_that_a_user_owns(site, planted):
    """``bb_root`` under a sticky, world-writable directory (as /tmp): a user who makes
    its next component first, a symlink to a directory of root's, had the prolog make
    directories there, hand the job's over, and the epilog delete it."""
    shared = site / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = site / "victim"
    victim.mkdir()
    planted_path = shared / "bbio"
    if planted == "symlink":
        planted_path.symlink_to(victim)
    else:
        planted_path.mkdir()
    os.lchown(planted_path, JOB.uid, JOB.gid)
    env = hook_env(site, bb_root=str(shared / "bbio" / "{user}" / "{job}"))
    refused = run_python("-m", "bbio", "slurm", "prolog", env=env)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert f"{planted_path} is uid {JOB.uid}'s" in refused.stderr, refused.stderr
    assert not (victim / JOB.user).exists()  # before: made there, through the symlink
    job_dir = planted_path / JOB.user / JOB.id  # as if a job had left it there
    job_dir.mkdir(parents=True)
    (job_dir / "important").write_text("root's")
    refused = run_python("-m", "bbio", "slurm", "epilog", env=env)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert f"{planted_path} is uid {JOB.uid}'s" in refused.stderr, refused.stderr
    assert (job_dir / "important").read_text() == "root's"


@as_root
def test_the_hooks_refuse_a_parent_with_an_acl(site):
    """A directory of root's, mode 0755, whose ACL lets the user write in it (it shows as
    0775 with group root): before, accepted."""
    parent = site / "acl"
    parent.mkdir(mode=0o755)
    entries = [(0x01, 7, 0xFFFFFFFF), (0x02, 7, JOB.uid), (0x04, 5, 0xFFFFFFFF)]
    entries += [(0x10, 7, 0xFFFFFFFF), (0x20, 5, 0xFFFFFFFF)]  # mask, other
    acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)
    try:
        os.setxattr(parent, "system.posix_acl_access", acl)
    except OSError as exc:
        pytest.skip(f"no POSIX ACLs here: {exc}")
    env = hook_env(site, bb_root=str(parent / "{job}"))
    refused = run_python("-m", "bbio", "slurm", "prolog", env=env)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert f"{parent} is uid 0's, mode drwxrwxr-x, with an ACL" in refused.stderr


@as_root
def test_the_epilog_drains_many_journals_a_few_at_a_time(site):
    """One child per journal, at most ``DRAINS_AT_ONCE`` at a time: a job that left many
    (empty) journals is drained and removed (before, a child each at once ran out of
    file descriptors, and left the children it had started running)."""
    env = hook_env(site)
    assert run_python("-m", "bbio", "slurm", "prolog", env=env).returncode == 0
    job_dir = site / "local" / "nobody" / "bbio-4242"
    for name in range(2 * slurm.DRAINS_AT_ONCE + 1):
        drain.journal_dir(job_dir / "0" / layout.CKPT_DIR / f"c{name}").mkdir(parents=True)
    chown_tree(job_dir, JOB.uid, JOB.gid)
    removed = run_python("-m", "bbio", "slurm", "epilog", "--timeout", "60", env=env)
    assert removed.returncode == 0, removed.stderr[-2000:]
    assert not job_dir.exists()


def test_find_s_message_for_a_directory_removed_during_the_walk_is_not_a_failure(tmp_path):
    """A job's process that removes a directory while the epilog walks the tree: before,
    ``find``'s "No such file or directory" failed the epilog."""
    (tmp_path / "a" / "ckpt" / "x" / drain.JOURNAL).mkdir(parents=True)
    assert slurm.journals_under(tmp_path) == [tmp_path / "a" / "ckpt" / "x" / drain.JOURNAL]
    assert slurm.journals_under(tmp_path / "gone") == []


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The failed hook's stderr, checked to be one line of bbio's and no traceback."""
    assert result.returncode == 1, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bbio: error: "), result.stderr[-2000:]
    return lines[0]


@as_root
def test_an_admins_bbio_variables_do_not_move_the_job_directory(site):
    """The epilog run by hand from a shell that exports ``BBIO_BB_ROOT`` (its admin's own):
    before, it looked there, said "nothing to do" and left the job's directory with its
    queued checkpoint."""
    elsewhere = site / "elsewhere"
    env = {
        **hook_env(site),
        "BBIO_BB_ROOT": str(elsewhere / "{job}"),
        "BBIO_PFS_ROOT": str(elsewhere / "pfs"),
    }
    assert run_python("-m", "bbio", "slurm", "prolog", env=env).returncode == 0
    job_dir = site / "local" / "nobody" / "bbio-4242"
    two_node_save(job_dir, 7, 1.5, pfs_root=site / "pfs")
    chown_tree(job_dir, JOB.uid, JOB.gid)
    removed = run_python("-m", "bbio", "slurm", "epilog", env=env)
    assert removed.returncode == 0, removed.stderr[-2000:]
    assert f"{job_dir} removed" in removed.stdout
    assert drain.read_manifest(site / "pfs" / layout.step_dirname(7))["time"] == 1.5
    assert not elsewhere.exists()


@as_root
def test_an_epilog_without_a_time_limit_drains_and_removes(site):
    """``BBIO_EPILOG_TIMEOUT=inf``: before, an OverflowError traceback (the wait for the
    drains took the whole timeout, in milliseconds, as a C int)."""
    env = hook_env(site)
    assert run_python("-m", "bbio", "slurm", "prolog", env=env).returncode == 0
    job_dir = site / "local" / "nobody" / "bbio-4242"
    two_node_save(job_dir, 7, 1.5, pfs_root=site / "pfs")
    chown_tree(job_dir, JOB.uid, JOB.gid)
    removed = run_python("-m", "bbio", "slurm", "epilog", "--timeout", "inf", env=env)
    assert removed.returncode == 0, removed.stderr[-2000:]
    assert not job_dir.exists()
    assert drain.read_manifest(site / "pfs" / layout.step_dirname(7))["time"] == 1.5


@pytest.mark.parametrize("timeout", ["abc", "-1", "nan"])
def test_a_bad_epilog_timeout_is_one_line_naming_bbio_epilog_timeout(tmp_path, timeout):
    """Before, "abc" was a usage message of two lines, and -1 or nan did not say where the
    value came from."""
    result = run_python(
        "-m", "bbio", "slurm", "epilog", "--timeout", timeout, env=hook_env(tmp_path)
    )
    error = one_line_error(result)
    assert f"timeout {timeout!r}" in error and "Set BBIO_EPILOG_TIMEOUT" in error


def test_the_hooks_read_only_the_site_file_named_by_bbio_config(tmp_path):
    site_file = tmp_path / "site.toml"
    site_file.write_text(f'bb_root = "{tmp_path}/{{job}}"\n')
    env = {"BBIO_CONFIG": str(site_file), "BBIO_BB_ROOT": "/elsewhere/{job}", "BBIO_USER": "x"}
    site = slurm.Site.load(None, env)
    assert site.file == str(site_file)
    assert slurm.job_dir(site, JOB) == tmp_path / "4242"


def fill_up(path: Path) -> None:
    """Write ``path`` until its file system is full, as a job that filled it."""
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)


@contextlib.contextmanager
def tmpfs(where: Path, options: str):
    """A small tmpfs mounted on ``where`` (root only), unmounted at the end."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=True)


@as_root
@pytest.mark.parametrize(
    ("options", "refused", "failing"),
    [
        ("ro,size=1m", "Read-only file system", "nobody"),  # the first parent it makes
        ("size=1m,nr_inodes=2", "No space left on device", "nobody/bbio-4242"),  # out of inodes
    ],
)
def test_a_prolog_on_a_burst_buffer_that_refuses_says_why_in_one_line(
    site, options, refused, failing
):
    """Before, a traceback (OSError from mkdir)."""
    env = hook_env(site)
    with tmpfs(site / "local", options):
        error = one_line_error(run_python("-m", "bbio", "slurm", "prolog", env=env))
        assert f"{refused} [{site / 'local' / failing}]" in error
        assert "resume the node" in error
        assert not (site / "local" / "nobody" / "bbio-4242").exists()


def can_drop(capabilities: str) -> bool:
    """Can this process run a program without ``capabilities`` (setpriv, as root)?"""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    drop = [f"--bounding-set=-{capabilities}", f"--inh-caps=-{capabilities}"]
    return subprocess.run(["setpriv", *drop, "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not can_drop("chown"), reason="needs root and setpriv to drop CAP_CHOWN")
def test_a_prolog_without_cap_chown_says_so_and_makes_nothing(site):
    """Before, a traceback (PermissionError from fchown), and a root-owned 0700 directory
    left that the job could not use."""
    drop = ["setpriv", "--bounding-set=-chown", "--inh-caps=-chown"]
    result = subprocess.run(
        [*drop, sys.executable, "-m", "bbio", "slurm", "prolog"],
        capture_output=True,
        text=True,
        env={**os.environ, **hook_env(site)},
        timeout=60,
    )
    error = one_line_error(result)
    assert "without CAP_CHOWN" in error and "Run it as root" in error
    assert str(site / "local" / "nobody" / "bbio-4242") in error
    assert not (site / "local" / "nobody").exists()


@as_root
def test_a_directory_the_prolog_made_but_could_not_hand_over_is_removed(tmp_path, monkeypatch):
    def failing_fchown(fd: int, uid: int, gid: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fchown", failing_fchown)
    site = slurm.Site(Config(bb_root=str(tmp_path / "{job}")))
    with pytest.raises(IOFailure, match=r"cannot give the job's burst-buffer directory to uid"):
        slurm.prolog(site, JOB)
    assert not (tmp_path / "4242").exists()


def test_a_relative_bb_root_is_refused_naming_the_site_file(tmp_path):
    """Before, the prolog made directories relative to its working directory, then failed
    with a traceback."""
    env = hook_env(tmp_path, bb_root="local/bbio/{job}")
    error = one_line_error(run_python("-m", "bbio", "slurm", "prolog", env=env, cwd=tmp_path))
    site_file = tmp_path / "bbio.toml"
    assert f"local/bbio/{{job}} (from the site file {site_file}) is not an absolute" in error
    assert list(tmp_path.iterdir()) == [site_file]


@pytest.mark.parametrize("variable", ["SLURM_JOB_UID", "SLURM_JOB_GID"])
@pytest.mark.parametrize("value", ["-1", "99999999999", "4294967295", "7x"])
def test_a_job_uid_or_gid_out_of_range_is_refused_naming_the_variable(variable, value):
    """Before, 99999999999 failed the prolog with an OverflowError traceback (and left the
    directory), and -1 left a directory of root's that the job could not use."""
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_USER": "nobody", "SLURM_JOB_UID": "65534"}
    with pytest.raises(ConfigError, match=rf"{variable}='{value}' is not a user or group id"):
        slurm.Job.from_env({**env, variable: value})


def test_mounts_below_a_job_directory_are_read_from_mountinfo_deepest_first():
    mountinfo = (
        b"22 1 0:21 / / rw - ext4 /dev/sda1 rw\n"
        b"47 22 0:42 / /bb/4242 rw - tmpfs tmpfs rw\n"  # the job's directory itself: kept
        b"48 47 0:43 / /bb/4242/0/data rw - fuse.sshfs u@h: rw\n"
        b"49 48 0:44 / /bb/4242/0/data/in\\040it rw - tmpfs tmpfs rw\n"  # a space, escaped
        b"50 22 0:45 / /bb/42420/x rw - tmpfs tmpfs rw\n"  # another job's
    )
    assert slurm.mounts_below(Path("/bb/4242"), mountinfo) == [
        Path("/bb/4242/0/data/in it"),
        Path("/bb/4242/0/data"),
    ]


@as_root
@pytest.mark.parametrize("through_a_symlink", [False, True])
def test_an_epilog_unmounts_what_the_job_left_mounted_and_deletes_nothing_on_it(
    site, through_a_symlink
):
    """A file system left mounted in the job's directory (a user's FUSE mount): the
    removal deleted the files on it, then failed on its mount point (busy), and Slurm
    drained the node.  Also with ``bb_root`` through a symlink of root's (as
    ``/local -> /mnt/nvme``), where the kernel lists the mount under the real path."""
    bb_root = None
    if through_a_symlink:
        (site / "local").mkdir(exist_ok=True)
        (site / "link").symlink_to(site / "local")
        bb_root = str(site / "link" / "{user}" / "bbio-{job}" / "{node}")
    env = hook_env(site, bb_root=bb_root)
    assert run_python("-m", "bbio", "slurm", "prolog", env=env).returncode == 0
    job_dir = site / "local" / "nobody" / "bbio-4242"
    mount_point = job_dir / "0" / "mounted data"
    mount_point.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount_point)], check=True)
    try:
        (mount_point / "kept.txt").write_text("not the job's to delete")
        holder = os.open(mount_point, os.O_RDONLY)  # what was mounted, reachable after
        try:
            removed = run_python("-m", "bbio", "slurm", "epilog", env=env)
            assert removed.returncode == 0, removed.stderr
            assert not job_dir.exists()
            with open(os.open("kept.txt", os.O_RDONLY, dir_fd=holder)) as kept:
                assert kept.read() == "not the job's to delete"
        finally:
            os.close(holder)
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], capture_output=True)


def reachable(path: Path) -> bool:
    try:
        os.lstat(path)
    except OSError:
        return False
    return True


@as_root
@pytest.mark.skipif(shutil.which("bindfs") is None, reason="needs bindfs (scripts/setup-env.sh)")
def test_an_epilog_drains_and_removes_past_a_dead_fuse_mount_the_job_left(site):
    """A FUSE mount whose process ended with the job ("Transport endpoint is not
    connected"): the search for journals failed on it, so every epilog of the job
    failed, drained nothing, and Slurm drained the node."""
    env = hook_env(site)
    assert run_python("-m", "bbio", "slurm", "prolog", env=env).returncode == 0
    job_dir = site / "local" / "nobody" / "bbio-4242"
    two_node_save(job_dir, 7, 1.5, pfs_root=site / "pfs")
    mounted = site / "user-files"
    mounted.mkdir()
    (mounted / "kept.txt").write_text("the user's")
    mount_point = job_dir / "0" / "data"
    mount_point.mkdir()
    chown_tree(job_dir, JOB.uid, JOB.gid)
    fuse = subprocess.Popen(["bindfs", "-f", str(mounted), str(mount_point)])
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mount_point):
            assert fuse.poll() is None and time.monotonic() < deadline, "bindfs did not mount"
            time.sleep(0.05)
        fuse.kill()
        fuse.wait()
        while reachable(mount_point):  # once FUSE's cached attributes expire
            assert time.monotonic() < deadline, "the killed FUSE mount stayed reachable"
            time.sleep(0.1)
        removed = run_python("-m", "bbio", "slurm", "epilog", "--timeout", "60", env=env)
        assert removed.returncode == 0, removed.stderr[-2000:]
        assert not job_dir.exists()
        assert drain.read_manifest(site / "pfs" / layout.step_dirname(7))["time"] == 1.5
        assert (mounted / "kept.txt").read_text() == "the user's"
    finally:
        fuse.kill()
        subprocess.run(["umount", "--lazy", str(mount_point)], capture_output=True)


@as_root
def test_an_epilog_that_cannot_remove_the_job_directory_names_the_full_path(tmp_path):
    """Before, the error named the file relative to its directory (``[x]``)."""
    (tmp_path / "local").mkdir()
    with tmpfs(tmp_path / "local", "size=1m"):
        job_dir = tmp_path / "local" / JOB.id
        (job_dir / "0").mkdir(parents=True)
        (job_dir / "0" / "x").write_text("output")
        subprocess.run(["mount", "-o", "remount,ro", str(tmp_path / "local")], check=True)
        site = slurm.Site(Config(bb_root=str(tmp_path / "local" / "{job}" / "{node}")))
        with pytest.raises(PermissionDeniedError) as refused:
            slurm.epilog(site, JOB, 10)
        assert refused.value.path == str(job_dir / "0" / "x")
        assert "Read-only file system" in str(refused.value)


@as_root
@pytest.mark.parametrize("timeout", ["60", "1e7"])  # 1e7: before, an OverflowError in poll()
def test_an_epilog_on_a_full_burst_buffer_makes_room_then_drains(site, timeout):
    """The job filled its burst buffer: the drain could not write its status and records
    there, drained nothing, and every run of the epilog failed the same way."""
    env = hook_env(site)
    with tmpfs(site / "local", "size=8m,mode=0755"):
        assert run_python("-m", "bbio", "slurm", "prolog", env=env).returncode == 0
        job_dir = site / "local" / "nobody" / "bbio-4242"
        two_node_save(job_dir, 7, 1.5, pfs_root=site / "pfs")
        results = job_dir / "0" / "results"
        results.mkdir()
        (results / "link").symlink_to(site / "pfs")  # removed, not followed
        fill_up(results / "filler")
        chown_tree(job_dir, JOB.uid, JOB.gid)
        removed = run_python("-m", "bbio", "slurm", "epilog", "--timeout", timeout, env=env)
        assert removed.returncode == 0, removed.stderr
        assert not job_dir.exists()
    assert drain.read_manifest(site / "pfs" / layout.step_dirname(7))["time"] == 1.5
    assert (site / "pfs").is_dir()


@as_root
def test_making_room_and_draining_share_the_epilogs_timeout(site):
    """Making room (slowed here by 5 s) and the drains had a timeout each: with a drain
    stuck on a FIFO the job left, an epilog of timeout 8 ran 5 + 8 + its grace, past
    the ``PrologEpilogTimeout`` the admin guide asks for, and Slurm killed it first."""
    env = hook_env(site)
    with tmpfs(site / "local", "size=8m,mode=0755"):
        job_dir, _ = a_job_whose_drain_hangs(site, env)
        fill_up(job_dir / "0" / "filler")
        chown_tree(job_dir, JOB.uid, JOB.gid)
        code = (  # the epilog timed from its start: not the interpreter's
            "import sys, time\n"
            "from bbio import slurm, cli\n"
            "slurm.ENDING_GRACE_SECONDS = 2\n"
            "make_room = slurm._remove_all_but_checkpoints\n"
            "slurm._remove_all_but_checkpoints = lambda *a: (time.sleep(5), make_room(*a))\n"
            "started = time.monotonic()\n"
            "code = cli.main()\n"
            "print(f'took {time.monotonic() - started:.2f}', file=sys.stderr)\n"
            "raise SystemExit(code)\n"
        )
        result = run_python("-c", code, "slurm", "epilog", "--timeout", "8", env=env)
        assert result.returncode == 1, result.stderr[-2000:]
        assert "not drained within 10 s: killed" in result.stderr, result.stderr[-2000:]
        took = float(result.stderr.split("took ")[-1])
        assert took < 12.5, f"the epilog took {took:.1f} s: timeout 8, grace 2 (before: 15)"
        assert job_dir.exists() and not (job_dir / "0" / "filler").exists()
    assert (site / "pfs" / layout.step_dirname(7) / layout.node_record_name(1)).exists()


def test_making_room_walks_a_tree_of_any_depth_and_keeps_the_checkpoints(tmp_path):
    """A journal 1,100 directories deep: the walk recursed, and the epilog died of a
    RecursionError at every run."""
    root = tmp_path / "job"
    root.mkdir()
    try:
        inner = Path(os.path.join(nest(root, 1100), *["d"] * 1100))
        journal = inner / layout.CKPT_DIR / "run" / drain.JOURNAL
        journal.mkdir(parents=True)
        (journal / "task").write_text("{}")
        (inner / "output.bin").write_bytes(b"x")
        (root / "results").mkdir()
        (root / "results" / "big.bin").write_bytes(b"x" * 100)
        (root / "link").symlink_to(root / "results")
        slurm._remove_all_but_checkpoints(root, [journal])
        assert (journal / "task").exists()
        assert not (inner / "output.bin").exists()
        assert sorted(os.listdir(root)) == ["d"]
    finally:  # deeper than pytest's own clean-up (shutil.rmtree) recurses
        subprocess.run(["rm", "-rf", "--", str(root)], check=True)


@as_root
def test_the_epilog_makes_room_as_the_jobs_user(site):
    """As root, the walk that makes room could be led by the job's processes (a directory
    swapped for a symlink while it ran) to delete files elsewhere: it runs as the job's
    user, who may delete only what the user could.  What it cannot delete is passed
    over, named, and the drain follows."""
    env = hook_env(site)
    with tmpfs(site / "local", "size=8m,mode=0755"):
        assert run_python("-m", "bbio", "slurm", "prolog", env=env).returncode == 0
        job_dir = site / "local" / "nobody" / "bbio-4242"
        two_node_save(job_dir, 7, 1.5, pfs_root=site / "pfs")
        chown_tree(job_dir, JOB.uid, JOB.gid)
        roots = job_dir / "0" / "a-roots"
        roots.mkdir(mode=0o755)
        (roots / "precious").write_bytes(b"root's")
        filler = job_dir / "0" / "z-results"
        filler.mkdir()
        fill_up(filler / "big")
        chown_tree(filler, JOB.uid, JOB.gid)
        removed = run_python("-m", "bbio", "slurm", "epilog", "--timeout", "60", env=env)
        assert removed.returncode == 0, removed.stderr
        assert "making room as nobody failed" in removed.stderr
        assert str(roots / "precious") in removed.stderr, removed.stderr
        assert not job_dir.exists()  # removed as root once drained
    assert drain.read_manifest(site / "pfs" / layout.step_dirname(7))["time"] == 1.5
