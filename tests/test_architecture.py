"""docs/architecture.md stays true: every module sits in one layer and imports only what it may."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "bbio"

# Keep in step with the table in docs/architecture.md.
LAYERS = {
    "api": {"bbio"},
    "core": {
        "bbio._version",
        "bbio.errors",
        "bbio.arguments",
        "bbio.config",
        "bbio.report",
        "bbio.transfer",
        "bbio.transfer.manifest",
        "bbio.stage",
        "bbio.stage.plan",
        "bbio.read",
        "bbio.read.plan",
        "bbio.read.sampler",
        "bbio.checkpoint",
        "bbio.checkpoint.layout",
    },
    "native": {"bbio._native"},
    "shell": {
        "bbio.mpi",
        "bbio.info",
        "bbio.slurm",
        "bbio.transfer.files",
        "bbio.stage.walk",
        "bbio.stage.progress",
        "bbio.stage.executors",
        "bbio.stage.run",
        "bbio.stage.verify",
        "bbio.stage.pack",
        "bbio.stage.registry",
        "bbio.read.datasets",
        "bbio.read.loader",
        "bbio.checkpoint.writer",
        "bbio.checkpoint.drain",
        "bbio.checkpoint.globalview",
        "bbio.checkpoint.restore",
        "bbio.checkpoint.checkpointer",
        "bbio.checkpoint.admin",
    },
    "entry": {
        "bbio.__main__",
        "bbio.cli",
        "bbio.demo",
        "bbio.demo.__main__",
        "bbio.demo.job",
        "bbio.bench",
        "bbio.bench.__main__",
        "bbio.bench.copy",
        "bbio.bench.stage",
        "bbio.bench.read",
        "bbio.bench.read_model",
        "bbio.bench._read_mpiio",
        "bbio.bench.checkpoint",
        "bbio.bench.plot",
        "bbio.bench.table",
    },
}
MAY_IMPORT = {
    "api": {"core", "native", "shell"},
    "core": {"core"},
    "native": {"core"},
    "shell": {"core", "native", "shell"},
    "entry": {"core", "native", "shell", "entry"},
}
# Third-party modules a layer may import; MPI only inside functions (never at import time).
THIRD_PARTY = {
    "api": set(),
    "core": {"numpy", "tomli"},
    "native": {"numpy"},
    "shell": {"numpy", "mpi4py", "h5py"},
    "entry": {"numpy", "mpi4py", "h5py", "crc32c", "matplotlib", "torch"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.Module):
    """(imported module, at module level?) for every import statement."""
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in top_level
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # "from bbio import _native" imports bbio._native
                submodule = f"{node.module}.{alias.name}"
                yield (submodule if layer_of(submodule) else node.module), id(node) in top_level


def layer_of(name: str) -> str | None:
    for layer, modules in LAYERS.items():
        if name in modules:
            return layer
    return None


def all_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield module_name(path), ast.parse(path.read_text())


def test_every_module_has_a_layer():
    unplaced = [name for name, _ in all_modules() if layer_of(name) is None]
    assert not unplaced, f"add these to LAYERS and docs/architecture.md: {unplaced}"


def test_layers_import_only_what_they_may():
    stdlib = set(__import__("sys").stdlib_module_names)
    problems = []
    for name, tree in all_modules():
        layer = layer_of(name)
        for imported, at_top in imports(tree):
            root = imported.split(".")[0]
            if imported == "bbio._bbio_native" or imported.startswith("bbio._bbio_native"):
                if name != "bbio._native":
                    problems.append(f"{name} imports the compiled extension")
            elif root == "bbio":
                target = layer_of(imported) or layer_of(imported.rsplit(".", 1)[0])
                if target not in MAY_IMPORT[layer]:
                    problems.append(f"{name} ({layer}) imports {imported} ({target})")
            elif root in stdlib or root == "__future__":
                continue
            elif root not in THIRD_PARTY[layer]:
                problems.append(f"{name} ({layer}) imports third-party {imported}")
            if root in {"mpi4py", "h5py", "matplotlib", "crc32c", "torch"} and at_top:
                problems.append(f"{name} imports {imported} at import time")
    assert not problems, "\n".join(problems)
