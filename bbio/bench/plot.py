"""Plot benchmark JSON files: ``python -m bbio.bench.plot RESULT.json... -o PNG``.

One panel per metric; within it, groups of bars by case, one bar per system
(the median, with the min-max range as an error bar).  Needs matplotlib
(``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bbio.errors import DependencyError, UsageError


def pyplot():
    """matplotlib's pyplot, drawing to files (Agg), or a clear error without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise DependencyError(
            "plotting needs matplotlib", hint="pip install -e '.[bench]'"
        ) from exc
    return plt


def plot(
    documents: list[dict],
    output: Path,
    title: str | None = None,
    metrics: list[str] | None = None,
    log_metrics: list[str] | None = None,
) -> None:
    """Draw the medians of the results of ``documents`` into ``output``.

    ``metrics`` picks the panels (default: every metric), ``log_metrics`` the
    panels drawn on a logarithmic axis.
    """
    plt = pyplot()
    results = [r for doc in documents for r in doc["results"]]
    found = list(dict.fromkeys(r["metric"] for r in results))
    unknown = sorted(set(metrics or []) - set(found))
    if unknown:
        raise UsageError(f"no results for metric(s) {unknown}", hint=f"the files have {found}")
    metrics = metrics or found
    fig, axes = plt.subplots(len(metrics), 1, figsize=(10, 3.6 * len(metrics)), squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics, strict=True):
        chosen = [r for r in results if r["metric"] == metric]
        cases = list(dict.fromkeys(r["case"] for r in chosen))
        systems = list(dict.fromkeys(r["system"] for r in chosen))
        palette = plt.get_cmap("tab10" if len(systems) <= 10 else "tab20").colors
        colors = {s: palette[i % len(palette)] for i, s in enumerate(systems)}
        labelled = set()
        for j, case in enumerate(cases):
            here = [r for r in chosen if r["case"] == case]
            width = 0.8 / len(here)
            for i, r in enumerate(here):
                system = r["system"]
                ax.bar(
                    j + (i - (len(here) - 1) / 2) * width,
                    r["median"],
                    width,
                    yerr=[[r["median"] - min(r["values"])], [max(r["values"]) - r["median"]]],
                    capsize=2,
                    color=colors[system],
                    label=None if system in labelled else system,
                )
                labelled.add(system)
        ax.set_xticks(range(len(cases)), cases)
        ax.set_ylabel(f"{metric} ({chosen[0]['unit']})")
        if metric in (log_metrics or []):
            ax.set_yscale("log")
        ax.legend(fontsize="small", ncol=min(len(systems), 5))
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m bbio.bench.plot", description=__doc__)
    parser.add_argument("json", nargs="+", type=Path, help="result files of python -m bbio.bench")
    parser.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    parser.add_argument("--title", help="figure title")
    parser.add_argument("--metrics", help="comma-separated metrics to draw (default: all)")
    parser.add_argument("--log", default="", help="comma-separated metrics on a log axis")
    args = parser.parse_args(argv)
    documents = [json.loads(p.read_text()) for p in args.json]
    metrics = args.metrics.split(",") if args.metrics else None
    plot(documents, args.output, args.title, metrics, [m for m in args.log.split(",") if m])
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
