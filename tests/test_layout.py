"""The package layout: one top-level name, and imports that point one way.

Engine (ragkv.engine, ragkv.fusion, ragkv.sparse) and leaves (ragkv.kernels, ragkv.store)
never import the application (ragkv.app), ingestion, the API, the CLI or the benchmarks.
Checked on the source's import statements (including imports inside functions), so a
lazy import cannot slip past.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ragkv"

ENGINE = ("ragkv.engine", "ragkv.fusion", "ragkv.sparse")
LEAVES = ("ragkv.kernels", "ragkv.store")
APPLICATION = ("ragkv.app", "ragkv.ingest", "ragkv.api", "ragkv.cli", "ragkv.bench", "ragkv.vllm")

# Error types every layer may raise and the API maps to statuses: the API may import these
# modules of lower layers, and nothing else of them.
SHARED_ERRORS = ("ragkv.ingest.errors", "ragkv.store.errors")

# What each layer may import from ragkv; anything else of ragkv is a violation.
ALLOWED = {
    "ragkv.kernels": ("ragkv.kernels",),
    "ragkv.store": ("ragkv.store",),
    "ragkv.engine": ENGINE + ("ragkv.kernels",),
    "ragkv.fusion": ENGINE + ("ragkv.kernels",),
    "ragkv.sparse": ENGINE + ("ragkv.kernels",),
    "ragkv.ingest": ENGINE + LEAVES + ("ragkv.ingest",),
    "ragkv.app": ENGINE + LEAVES + ("ragkv.ingest", "ragkv.app"),
    # The vLLM connector is a front end like the API, composing the application's parts.
    "ragkv.vllm": ENGINE + LEAVES + ("ragkv.ingest", "ragkv.app", "ragkv.vllm"),
    # The API converts requests and responses: it composes nothing below the application.
    "ragkv.api": ("ragkv.app", "ragkv.api") + SHARED_ERRORS,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def ragkv_imports(path: Path) -> set[str]:
    """Absolute ragkv module names imported anywhere in `path` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "ragkv" or name.startswith("ragkv.")}


def layer_of(module: str) -> str | None:
    for layer in ALLOWED:
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_every_subpackage_has_a_layer():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    known = {name.split(".")[1] for name in ENGINE + LEAVES + APPLICATION}
    assert subpackages <= known, f"subpackages without a layer: {subpackages - known}"


def test_imports_point_one_way():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        layer = layer_of(module)
        if layer is None:
            continue
        for imported in sorted(ragkv_imports(path)):
            if imported == "ragkv" or imported.count(".") == 1 and imported.split(".")[1] in {"__version__"}:
                continue
            if not within(imported, ALLOWED[layer]):
                violations.append(f"{module} imports {imported}")
    assert not violations, "\n".join(violations)


def test_the_checker_sees_a_violation(tmp_path):
    """The walk above must catch a lazy import inside a function."""
    fake = PACKAGE / "engine" / "_layout_probe.py"
    fake.write_text("def f():\n    from ragkv.store.blob import encode_blob\n")
    try:
        assert "ragkv.store.blob" in ragkv_imports(fake)
        assert not within("ragkv.store.blob", ALLOWED["ragkv.engine"])
    finally:
        fake.unlink()


def test_the_api_may_import_only_the_application_and_shared_errors():
    api = ALLOWED["ragkv.api"]
    assert within("ragkv.app.request_types", api) and within("ragkv.store.errors", api)
    below_the_application = ("ragkv.engine.generation", "ragkv.fusion", "ragkv.sparse", "ragkv.ingest.registry")
    for below in below_the_application + ("ragkv.store.url",):
        assert not within(below, api), below


def test_no_endpoint_imports_another_endpoint():
    """ragkv/api/<endpoint>/ (a folder with a router.py) imports ragkv.api's shared modules and
    ragkv.api.common, never another endpoint's folder."""
    api = PACKAGE / "api"
    endpoints = sorted(folder.name for folder in api.iterdir() if (folder / "router.py").is_file())
    assert {"chat", "completions", "documents", "embeddings", "query", "responses", "system"} <= set(endpoints)
    crossings = []
    for name in endpoints:
        for path in (api / name).glob("*.py"):
            for imported in ragkv_imports(path):
                other = imported.split(".")[2] if imported.count(".") >= 2 else None
                if other in endpoints and other != name:
                    crossings.append(f"{path.relative_to(REPO)} imports {imported}")
    assert not crossings, crossings


@pytest.mark.slow
def test_wheel_installs_no_top_level_name_but_ragkv(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("ragkv-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        top_level = {name.split("/")[0] for name in archive.namelist()}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"ragkv"}


def import_cycles(prefix: str) -> list[set[str]]:
    """Groups of modules under `prefix` that import each other in a ring (any import, those
    under TYPE_CHECKING and inside functions included)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = {name: path for name, path in modules.items() if within(name, (prefix,)) and name != prefix}
    graph = {
        name: {other for other in ragkv_imports(path) if other in modules and other != name}
        for name, path in modules.items()
    }

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for other in graph[todo.pop()] - seen:
                seen.add(other)
                todo.append(other)
        return seen

    reach = {name: reachable(name) for name in graph}
    cycles = {
        frozenset({name} | {other for other in reach[name] if name in reach[other]})
        for name in graph
        if name in reach[name]
    }
    return [set(cycle) for cycle in cycles]


def test_engine_modules_import_without_cycles():
    """The forward loop (model.py) picks its decode backend; the compiled step is built from
    the spec and weights and never reads the loop's model back."""
    assert import_cycles("ragkv.engine") == []
