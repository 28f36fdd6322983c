"""Configuration precedence: defaults < TOML file < BBIO_* environment < arguments."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from bbio.config import Config, load_config
from bbio.errors import ConfigError


def test_defaults_without_file_or_environment(monkeypatch):
    monkeypatch.setattr("bbio.config.SITE_CONFIG_FILE", Path("/nonexistent/bbio.toml"))
    config = load_config(env={})
    assert config == Config()
    assert config.job_id == "local"
    assert config.ranks_per_node is None
    with pytest.raises(ConfigError, match=r"BBIO_PFS_ROOT.*--pfs-root.*pfs_root="):
        config.pfs_dir()


def test_precedence(tmp_path):
    toml = tmp_path / "bbio.toml"
    toml.write_text('bb_root = "/file/bb/{node}"\npfs_root = "/file/pfs"\nranks_per_node = 8\n')
    env = {"BBIO_CONFIG": str(toml), "BBIO_PFS_ROOT": "/env/pfs", "BBIO_RANKS_PER_NODE": "4"}
    config = load_config(env=env, ranks_per_node=2)
    assert config.bb_root == "/file/bb/{node}"
    assert config.pfs_root == "/env/pfs"
    assert config.ranks_per_node == 2
    assert load_config(env=env, ranks_per_node=None).ranks_per_node == 4


def test_placeholders_and_slurm_job_id():
    env = {
        "SLURM_JOB_ID": "4242",
        "BBIO_BB_ROOT": "/bb/{job}/node{node}",
        "BBIO_PFS_ROOT": "/p/{job}",
    }
    config = load_config(env=env)
    assert config.job_id == "4242"
    assert config.bb_dir(3) == Path("/bb/4242/node3")
    assert config.pfs_dir() == Path("/p/4242")
    assert load_config(env={**env, "BBIO_JOB_ID": "override"}).job_id == "override"


def test_virtual_nodes_on_one_machine_need_their_own_directories():
    config = load_config(env={"BBIO_RANKS_PER_NODE": "2"})
    assert config.node_dir("/bb/{node}/data", 1, nodes_on_host=2) == Path("/bb/1/data")
    assert config.node_dir("/local/bb", 1, nodes_on_host=1) == Path("/local/bb")  # real hosts
    with pytest.raises(ConfigError, match=r"2 virtual nodes.*share.*/bb/data") as info:
        config.node_dir("/bb/data", 0, nodes_on_host=2)
    assert "{node}" in str(info.value)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"BBIO_RANKS_PER_NODE": "two"}, "BBIO_RANKS_PER_NODE.*must be an integer"),
        ({"BBIO_RANKS_PER_NODE": "0"}, "at least 1"),
        ({"BBIO_CONFIG": "/nonexistent/file.toml"}, r"does not exist.*bbio --config"),
        ({"BBIO_JOB_ID": "", "SLURM_JOB_ID": "4242"}, "BBIO_JOB_ID: job_id must not be empty"),
        ({"BBIO_BB_ROOT": ""}, "BBIO_BB_ROOT: bb_root must not be empty"),
        ({"BBIO_READ_MIN_SAVING": "150"}, "read_min_saving must be at most 100, got 150"),
        ({"BBIO_IO_THREADS": "1_000"}, "io_threads must be an integer, got '1_000'"),
        ({"BBIO_IO_THREADS": " 8 "}, "io_threads must be an integer, got ' 8 '"),
        ({"BBIO_IO_THREADS": "+8"}, "io_threads must be an integer, got '\\+8'"),
        ({"BBIO_IO_THREADS": "-3"}, "io_threads must be at least 1, got -3"),
        ({"BBIO_BB_ROOT": "/bb\0/{node}"}, "bb_root must not contain a NUL"),  # was ValueError
        # before, too large for C: an OverflowError deep in a copy, naming no setting
        (
            {"BBIO_STAGE_FILES_IN_FLIGHT": "9999999999"},
            "BBIO_STAGE_FILES_IN_FLIGHT: stage_files_in_flight must be at most 2147483647",
        ),
        (
            {"BBIO_COPY_BUFFER_SIZE": "99999999999999999999"},
            "copy_buffer_size must be at most 4611686018427387904",
        ),
    ],
)
def test_bad_values_name_their_source(env, message):
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def test_the_largest_values_are_accepted():
    config = load_config(env={"BBIO_IO_THREADS": "2147483647", "BBIO_CHUNK_SIZE": str(2**62)})
    assert (config.io_threads, config.chunk_size) == (2**31 - 1, 2**62)


def test_numpy_integers_are_integers_in_arguments():
    """Before, ``io_threads=np.int64(8)`` was refused as not an integer."""
    config = load_config(env={}, io_threads=np.int64(8), ranks_per_node=np.int32(2))
    assert (config.io_threads, config.ranks_per_node) == (8, 2)
    assert type(config.io_threads) is int
    with pytest.raises(ConfigError, match="io_threads must be an integer"):
        load_config(env={}, io_threads=np.bool_(True))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("ranks_per_node = true", "ranks_per_node must be an integer, got True"),
        ("copy_buffer_size = 2.9", "copy_buffer_size must be an integer, got 2.9"),
        ('job_id = ""', "job_id must not be empty"),
    ],
)
def test_bad_values_in_the_file_name_it(tmp_path, line, message):
    toml = tmp_path / "bbio.toml"
    toml.write_text(line + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file {toml}: {message}")):
        load_config(config_file=toml, env={})


def test_empty_optional_settings_in_the_environment_are_not_set_there(tmp_path):
    config = load_config(env={"BBIO_PFS_ROOT": "", "BBIO_USER": "", "BBIO_STRIPE_SIZE": ""})
    assert config.pfs_root is None and config.user is None and config.stripe_size is None
    slurm = {"SLURM_JOB_USER": "alice", "BBIO_USER": ""}
    assert load_config(env=slurm).user == "alice"
    toml = tmp_path / "bbio.toml"
    toml.write_text('pfs_root = "/pfs/x"\n')
    assert load_config(config_file=toml, env={"BBIO_PFS_ROOT": ""}).pfs_root == "/pfs/x"
    toml.write_text('pfs_root = ""\n')  # in the file, an empty string unsets it
    assert load_config(config_file=toml, env={}).pfs_root is None


def test_user_comes_from_bbio_user_else_slurm_job_user_else_the_login_name(monkeypatch):
    monkeypatch.setattr("getpass.getuser", lambda: "login-name")
    assert load_config(env={}).expand("/bb/{user}") == Path("/bb/login-name")
    slurm = {"SLURM_JOB_USER": "alice"}
    assert load_config(env=slurm).expand("/bb/{user}") == Path("/bb/alice")
    assert load_config(env={**slurm, "BBIO_USER": "bob"}).expand("/bb/{user}") == Path("/bb/bob")


def test_unknown_and_malformed_file(tmp_path):
    toml = tmp_path / "bbio.toml"
    toml.write_text('bb_rot = "/typo"\n')
    with pytest.raises(ConfigError, match=r"unknown setting.*bb_rot"):
        load_config(config_file=toml, env={})
    toml.write_text("bb_root = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(config_file=toml, env={})
    with pytest.raises(ConfigError, match="unknown setting 'nope'"):
        load_config(env={}, nope=1)
    toml.write_bytes(b'bb_root = "/bb/\xff"\n')  # not UTF-8
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(config_file=toml, env={})
    with pytest.raises(ConfigError, match=r"cannot be read.*readable TOML file"):
        load_config(env={"BBIO_CONFIG": str(tmp_path)})  # a directory


def test_an_empty_bbio_config_is_unset(tmp_path, monkeypatch):
    monkeypatch.setattr("bbio.config.SITE_CONFIG_FILE", tmp_path / "none.toml")
    assert load_config(env={"BBIO_CONFIG": ""}).pfs_root is None


def test_every_setting_is_documented_with_its_variable_and_choices():
    from bbio.config import SETTINGS

    table = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in table.splitlines() if "| `" in line}
    for name, field in SETTINGS.items():
        assert name in rows, f"docs/configuration.md has no row for {name}"
        assert f"BBIO_{name.upper()}" in rows[name]
        for choice in field.metadata["choices"]:
            assert f"`{choice}`" in rows[name], f"{name}: choice {choice} is not documented"


@pytest.mark.parametrize(("node_ranks", "each"), [(1, 32), (2, 16), (3, 11), (4, 8), (64, 1)])
def test_staging_shares_the_files_in_flight_of_a_node_among_its_ranks(node_ranks, each):
    assert Config(stage_files_in_flight=32).stage_threads(node_ranks) == each
