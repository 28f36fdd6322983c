"""Markdown tables from benchmark JSON: ``python -m bbio.bench.table RESULT.json ...``.

One row per case, one column per system: the median of ``--metric``.  With
``--ratio A/B`` (repeatable) the columns are instead the ratios of two
systems' medians (``bbio/bb-write``; ``SYSTEM@METRIC`` picks another metric),
the form the issues' targets take.  The docs' tables are printed this way.
With ``--run-rate`` a per-step rate (GB/s, samples/s) is summarised by its
harmonic mean instead: the rate over the whole run, total work over total
time, when every step does the same work (the read suite's steps do).
With ``--per-file`` every file gets its own rows, labelled by what sets its
name apart from the others' (``run28c, 16MiB``): runs side by side.
Nothing here is collective: it reads JSON files, without MPI.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bbio.errors import UsageError


def medians(
    documents: list[dict], run_rates: frozenset[str] = frozenset()
) -> dict[tuple[str, str, str], float]:
    """{(case, system, metric): median} over the results of ``documents`` (later files win);
    for the metrics in ``run_rates``, the harmonic mean of the values (the rate over the run)."""
    return {
        (r["case"], r["system"], r["metric"]): (
            _run_rate(r["values"]) if r["metric"] in run_rates else float(r["median"])
        )
        for doc in documents
        for r in doc["results"]
    }


def per_file(
    named: list[tuple[str, dict]], run_rates: frozenset[str] = frozenset()
) -> dict[tuple[str, str, str], float]:
    """As :func:`medians`, one row per file and case: the case ``"LABEL, CASE"``, where
    LABEL is what sets the file's name apart from the others' (its whole name if
    nothing does)."""
    names = [name for name, _ in named]
    shared = _shared_prefix_length(names) if len(names) > 1 else 0
    found = {}
    for name, doc in named:
        label = name[shared:].lstrip("-_.") or name
        for (case, system, metric), value in medians([doc], run_rates).items():
            found[(f"{label}, {case}", system, metric)] = value
    return found


def _shared_prefix_length(names: list[str]) -> int:
    """How many leading characters all ``names`` share."""
    first, last = min(names), max(names)
    length = 0
    while length < min(len(first), len(last)) and first[length] == last[length]:
        length += 1
    return length


def _run_rate(values: list[float]) -> float:
    if not values or min(values) <= 0:
        raise UsageError(
            "--run-rate needs positive per-step rates", hint="use it with GB_per_s or samples_per_s"
        )
    return len(values) / sum(1.0 / v for v in values)


def _cases(found: dict[tuple[str, str, str], float]) -> list[str]:
    return list(dict.fromkeys(case for case, _, _ in found))


def _format(value: float, digits: int) -> str:
    text = f"{value:.{digits}g}"
    return f"{value:.0f}" if "e+" in text else text


def median_table(
    found: dict[tuple[str, str, str], float],
    metric: str,
    systems: list[str] | None,
    digits: int,
    rows_are: str = "case",
) -> str:
    """Cases by systems: the medians of ``metric`` (``systems``: the columns, in order;
    ``rows_are``: the first column's heading)."""
    present = [s for c, s, m in found if m == metric]
    if not present:
        metrics = sorted({m for _, _, m in found})
        raise UsageError(f"no results for metric {metric!r}", hint=f"the files have {metrics}")
    unknown = [name for name in systems or () if name not in present]
    if unknown:
        raise UsageError(
            f"no {metric} results for system(s) {unknown}",
            hint=f"the files have {sorted(set(present))}",
        )
    columns = systems or list(dict.fromkeys(present))
    rows = [[rows_are, *columns], ["---"] * (len(columns) + 1)]
    for case in _cases(found):
        cells = [found.get((case, s, metric)) for s in columns]
        if any(cell is not None for cell in cells):
            rows.append([case, *("-" if c is None else _format(c, digits) for c in cells)])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def _operand(text: str, metric: str) -> tuple[str, str]:
    system, _, other = text.partition("@")
    return system, other or metric


def ratio_table(
    found: dict[tuple[str, str, str], float],
    ratios: list[str],
    metric: str,
    digits: int,
    rows_are: str = "case",
) -> str:
    """Cases by ratios ``A/B`` of two systems' medians (of ``metric`` unless ``@METRIC``;
    ``rows_are``: the first column's heading)."""
    pairs = []
    for text in ratios:
        top, slash, bottom = text.partition("/")
        if not slash or not top or not bottom:
            raise UsageError(f"a ratio is SYSTEM/SYSTEM, got {text!r}", hint="e.g. bbio/bb-write")
        pairs.append((_operand(top, metric), _operand(bottom, metric)))
    rows = [[rows_are, *ratios], ["---"] * (len(ratios) + 1)]
    for case in _cases(found):
        cells = []
        for (a, am), (b, bm) in pairs:
            num, den = found.get((case, a, am)), found.get((case, b, bm))
            cells.append("-" if num is None or not den else _format(num / den, digits))
        if any(cell != "-" for cell in cells):
            rows.append([case, *cells])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m bbio.bench.table", description=__doc__)
    parser.add_argument("json", nargs="+", type=Path, help="result files of python -m bbio.bench")
    parser.add_argument("--metric", default="seconds", help="the metric (default: seconds)")
    parser.add_argument("--systems", help="comma-separated columns (default: every system)")
    parser.add_argument("--ratio", action="append", default=[], help="a column A/B (repeatable)")
    parser.add_argument("--digits", type=int, default=3, help="significant digits (default 3)")
    parser.add_argument(
        "--run-rate",
        action="store_true",
        help="harmonic mean of the values (a rate over the whole run) instead of the median",
    )
    parser.add_argument(
        "--per-file",
        action="store_true",
        help="rows for each file and case, labelled by what sets the file's name apart",
    )
    args = parser.parse_args(argv)
    shown = {args.metric} | {_operand(t, args.metric)[1] for r in args.ratio for t in r.split("/")}
    run_rates = frozenset(shown if args.run_rate else ())
    documents = [json.loads(p.read_text()) for p in args.json]
    if args.per_file:
        named = [(path.stem, doc) for path, doc in zip(args.json, documents, strict=True)]
        found = per_file(named, run_rates)
        rows_are = "run, case"
    else:
        found, rows_are = medians(documents, run_rates), "case"
    if args.ratio and args.systems:
        raise UsageError("--systems and --ratio do not go together", hint="give one of them")
    if args.ratio:
        print(ratio_table(found, args.ratio, args.metric, args.digits, rows_are))
    else:
        systems = args.systems.split(",") if args.systems else None
        print(median_table(found, args.metric, systems, args.digits, rows_are))
    return 0


if __name__ == "__main__":
    sys.exit(main())
