"""The benchmark harness: registry, JSON layout, and the copy suite end to end."""

from __future__ import annotations

import json

import pytest

import bbio
from bbio.bench import Results
from bbio.bench.__main__ import build_parser
from tests.conftest import run_python


def test_results_keep_values_and_medians():
    results = Results()
    for value in (3.0, 1.0, 2.0):
        results.add("case", "bbio", "GB_per_s", "GB/s", value)
    measurement = results.get("case", "bbio", "GB_per_s")
    assert measurement.values == [3.0, 1.0, 2.0]
    assert measurement.to_json()["median"] == 2.0
    assert "case" in results.table()


def test_suites_register_themselves():
    parser = build_parser()
    args = parser.parse_args(["copy", "--quick", "--json", "x.json", "--dir", "/tmp"])
    assert (args.suite, args.quick, args.json, args.dir) == ("copy", True, "x.json", "/tmp")


@pytest.mark.timeout(400)  # its subprocess may take 300 s
def test_copy_suite_quick_writes_documented_json(tmp_path):
    out = tmp_path / "copy.json"
    result = run_python(
        "-m",
        "bbio.bench",
        "copy",
        "--quick",
        "--json",
        str(out),
        "--dir",
        str(tmp_path),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert doc["suite"] == "copy"
    assert doc["ranks"] == 1
    assert doc["nodes"] == 1
    assert {"cpu", "cores", "mpi", "bbio", "crc32c_hardware"} <= set(doc["machine"])
    seen = {(r["case"], r["system"], r["metric"]) for r in doc["results"]}
    for system in ("bbio", "shutil", "cp", "memcpy"):
        assert ("copy-256MiB", system, "GB_per_s") in seen
    for system in ("bbio", "crc32c", "zlib"):
        assert ("crc32c", system, "GB_per_s") in seen
    for entry in doc["results"]:
        assert entry["unit"] == "GB/s"
        assert entry["values"] and all(v > 0 for v in entry["values"])
    assert list(tmp_path.iterdir()) == [out], "the suite left files behind"


def test_plot_draws_the_chosen_metrics_and_refuses_unknown_ones(tmp_path):
    from bbio.bench.plot import main as plot_main

    result = {"case": "c", "system": "bbio", "unit": "GB/s", "values": [1.0, 3.0], "median": 2.0}
    doc = {"results": [{**result, "metric": "GB_per_s"}, {**result, "metric": "ratio"}]}
    source = tmp_path / "r.json"
    source.write_text(json.dumps(doc))
    png = tmp_path / "r.png"
    options = ["--metrics", "GB_per_s", "--log", "GB_per_s"]
    assert plot_main([str(source), "-o", str(png), *options]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(bbio.UsageError, match="no results for metric"):
        plot_main([str(source), "-o", str(png), "--metrics", "nope"])


def test_table_prints_medians_and_target_ratios(tmp_path, capsys):
    from bbio.bench.table import main as table_main

    def result(case, system, metric, median, values=()):
        return {
            "case": case,
            "system": system,
            "metric": metric,
            "median": median,
            "values": list(values) or [median],
        }

    doc = {
        "results": [
            result("16MiB", "bbio", "seconds", 0.5),
            result("16MiB", "bb-write", "seconds", 0.25),
            result("16MiB", "bbio-drain", "GB_per_s", 0.2),
            result("16MiB", "pfs-write", "GB_per_s", 0.25),
            result("64MiB", "bbio", "seconds", 2.0),
            result("step", "bbio", "GB_per_s", 1.0, [1.0, 1.0, 0.25]),  # 3 GB in 6 s
            result("step", "independent", "GB_per_s", 0.5, [0.5, 0.5, 0.5]),
        ]
    }
    source = tmp_path / "r.json"
    source.write_text(json.dumps(doc))
    assert table_main([str(source), "--systems", "bb-write,bbio"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "| case | bb-write | bbio |",
        "| --- | --- | --- |",
        "| 16MiB | 0.25 | 0.5 |",
        "| 64MiB | - | 2 |",
    ]
    per_step = [str(source), "--ratio", "bbio/independent", "--metric", "GB_per_s"]
    assert table_main(per_step) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "| step | 2 |"  # medians
    assert table_main([*per_step, "--run-rate"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "| step | 1 |"  # 0.5 GB/s over the run
    ratios = ["--ratio", "bbio/bb-write", "--ratio", "bbio-drain@GB_per_s/pfs-write@GB_per_s"]
    assert table_main([str(source), *ratios]) == 0
    assert capsys.readouterr().out.splitlines()[2:] == ["| 16MiB | 2 | 0.8 |"]
    later = tmp_path / "r-run2.json"
    later.write_text(json.dumps({"results": [result("16MiB", "bbio", "seconds", 0.3)]}))
    assert table_main([str(source), str(later), "--systems", "bbio", "--per-file"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "| run, case | bbio |",
        "| --- | --- |",
        "| r, 16MiB | 0.5 |",  # nothing sets it apart: its whole name
        "| r, 64MiB | 2 |",
        "| run2, 16MiB | 0.3 |",
    ]
    with pytest.raises(bbio.UsageError, match="no results for metric"):
        table_main([str(source), "--metric", "nope"])
    with pytest.raises(bbio.UsageError, match="SYSTEM/SYSTEM"):
        table_main([str(source), "--ratio", "bbio"])
    with pytest.raises(bbio.UsageError, match=r"system\(s\) \['nope'\]"):
        table_main([str(source), "--systems", "bbio,nope"])
