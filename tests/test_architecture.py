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
        "bbio.checkpoint.mapped",
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
        "bbio.checkpoint.drainer",
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
# Shell modules that run without mpirun (the drain process, `bbio ckpt`, the Slurm hooks):
# they import neither mpi4py nor a module that uses MPI (modules_using_mpi), even inside
# functions.  (Importing any bbio module runs bbio/__init__.py, which loads bbio.mpi
# without starting MPI: these modules never call into it.)
NO_MPI = {
    "bbio.checkpoint.drain",
    "bbio.checkpoint.drainer",
    "bbio.checkpoint.admin",
    "bbio.slurm",
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


def imports(tree: ast.Module, name: str, is_package: bool):
    """(imported module, at import time?) for every import statement of module ``name``:
    relative imports resolved; at import time unless inside a function (module level,
    also within ``try``, ``if``, ``with`` or a class body)."""
    package = name if is_package else name.rpartition(".")[0]
    for node, at_import_time in statements(tree.body, True):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, at_import_time
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:  # "from bbio import _native" imports bbio._native
                submodule = f"{module}.{alias.name}"
                yield (submodule if layer_of(submodule) else module), at_import_time


def statements(body, at_import_time: bool):
    """Every node under ``body``, with whether it runs when its module is imported."""
    for node in body:
        yield node, at_import_time
        inside = at_import_time and not isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        )
        for child in ast.iter_child_nodes(node):
            yield from statements([child], inside)


def layer_of(name: str) -> str | None:
    for layer, modules in LAYERS.items():
        if name in modules:
            return layer
    return None


def all_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield module_name(path), ast.parse(path.read_text()), path.name == "__init__.py"


def test_every_module_has_a_layer():
    unplaced = [name for name, _, _ in all_modules() if layer_of(name) is None]
    assert not unplaced, f"add these to LAYERS and docs/architecture.md: {unplaced}"


def test_layers_import_only_what_they_may():
    stdlib = set(__import__("sys").stdlib_module_names)
    mpi_users = modules_using_mpi()
    problems = []
    for name, tree, is_package in all_modules():
        layer = layer_of(name)
        for imported, at_top in imports(tree, name, is_package):
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
            if name in NO_MPI and (root == "mpi4py" or imported in mpi_users):
                problems.append(f"{name} (shell, no MPI) imports {imported}, which uses MPI")
    assert not problems, "\n".join(problems)


def modules_using_mpi() -> set[str]:
    """bbio.mpi, and the modules that import mpi4py or bbio.mpi (anywhere in them)."""
    users = {"bbio.mpi"}
    for name, tree, is_package in all_modules():
        for imported, _ in imports(tree, name, is_package):
            if imported.split(".")[0] == "mpi4py" or imported == "bbio.mpi":
                users.add(name)
    return users


def test_the_rules_catch_what_they_are_for():
    """Relative imports, imports inside a module-level try, and MPI in a no-MPI module."""
    source = (
        "try:\n    from mpi4py import MPI\nexcept ImportError:\n    pass\n"
        "from .checkpoint import checkpointer\n"
        "def later():\n    from bbio import mpi\n"
    )
    found = set(imports(ast.parse(source), "bbio.report", False))
    assert found == {
        ("mpi4py", True),
        ("bbio.checkpoint.checkpointer", True),
        ("bbio.mpi", False),
    }, found
    found = set(imports(ast.parse("from .. import report\n"), "bbio.stage.plan", False))
    assert found == {("bbio.report", True)}, found
