"""The package layout: one top-level name, and imports that point one way.

Engine (ragkv.engine, ragkv.fusion, ragkv.sparse) and leaves (ragkv.kernels, ragkv.store)
never import the application (ragkv.app), ingestion, the API, the CLI or the benchmarks.
The one exception is the shared errors module (ragkv.errors), which every layer may import
and which imports nothing of ragkv.
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
SHARED_ERRORS = "ragkv.errors"
"""The one module outside the layers: the error for unusable input that every layer raises."""

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
    # The API converts requests and responses: it composes nothing below the application
    # (the errors it maps to statuses come from one module, ragkv.app.errors).
    "ragkv.api": ("ragkv.app", "ragkv.api"),
}

# What the API may not import of the application: the model thread's machinery and what it
# assembles are the engine client's (ragkv.app.server.EngineClient), which the routes call.
NOT_FOR_THE_API = (
    "ragkv.app.scheduler",
    "ragkv.app.live_fidelity",
    "ragkv.app.runtime",
    "ragkv.app.storage",
    "ragkv.app.server.worker",
    "ragkv.app.server.model_work",
    "ragkv.app.server.client",
)

MAX_FUNCTION_LINES = 60
"""The longest function (its def to its last line) in ragkv/api and ragkv/app."""


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
            if not within(imported, ALLOWED[layer] + (SHARED_ERRORS,)):
                violations.append(f"{module} imports {imported}")
    assert not violations, "\n".join(violations)


def test_the_shared_errors_module_is_the_only_module_outside_a_layer():
    """Besides the package's own entry points, no module sits beside the layers."""
    top_level = sorted(module_name(path) for path in PACKAGE.glob("*.py"))
    assert top_level == ["ragkv", "ragkv.__main__", SHARED_ERRORS], top_level
    assert ragkv_imports(PACKAGE / "errors.py") == set()


def test_the_checker_sees_a_violation(tmp_path):
    """The walk above must catch a lazy import inside a function."""
    fake = PACKAGE / "engine" / "_layout_probe.py"
    fake.write_text("def f():\n    from ragkv.store.blob import encode_blob\n")
    try:
        assert "ragkv.store.blob" in ragkv_imports(fake)
        assert not within("ragkv.store.blob", ALLOWED["ragkv.engine"])
    finally:
        fake.unlink()


def test_the_api_may_import_only_the_application():
    api = ALLOWED["ragkv.api"]
    assert within("ragkv.app.request_types", api) and within("ragkv.app.errors", api)
    below_the_application = ("ragkv.engine.generation", "ragkv.fusion", "ragkv.sparse", "ragkv.ingest.registry")
    for below in below_the_application + ("ragkv.store.url", "ragkv.store.errors", "ragkv.ingest.errors"):
        assert not within(below, api), below


def test_the_api_imports_no_scheduler_worker_or_runtime():
    found = [
        f"{path.relative_to(REPO)} imports {imported}"
        for path in sorted((PACKAGE / "api").rglob("*.py"))
        for imported in sorted(ragkv_imports(path))
        if within(imported, NOT_FOR_THE_API + ENGINE)
    ]
    assert not found, "\n".join(found)


def _client_members() -> set[str]:
    """The engine client's public methods, properties and attributes."""
    tree = ast.parse((PACKAGE / "app" / "server" / "client.py").read_text())
    (client,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "EngineClient"]
    members = {node.name for node in client.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(client):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if isinstance(node.ctx, ast.Store):
                members.add(node.attr)
    return {name for name in members if not name.startswith("_")}


def api_reach_ins(path: Path, members: set[str]) -> list[str]:
    """Where `path` reaches past the engine client: an attribute `runtime` of anything, or a
    member of `<...>.client` that is not one of the client's public `members`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        through_client = isinstance(node.value, ast.Attribute) and node.value.attr == "client"
        if node.attr == "runtime" or through_client and node.attr not in members:
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
    return found


def test_routes_call_the_engine_client_and_reach_no_further():
    members = _client_members()
    assert {"query", "chat", "ingest", "documents", "stats"} <= members
    assert not {"runtime", "worker", "sessions", "work", "ingest_records"} & members
    found = [hit for path in sorted((PACKAGE / "api").rglob("*.py")) for hit in api_reach_ins(path, members)]
    assert not found, "\n".join(found)


def test_the_reach_in_check_sees_one(tmp_path):
    probe = tmp_path / "probe.py"
    reaching = "state.client._worker, state.client.runtime, state.runtime"
    probe.write_text(f"def f(state):\n    return {reaching}, state.client.chat\n")
    assert len(api_reach_ins(probe, _client_members())) == 3


def long_functions(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} has {lines} lines")
    return found


def test_no_function_of_the_api_or_the_application_is_long():
    found = long_functions(PACKAGE / "api") + long_functions(PACKAGE / "app")
    assert not found, "\n".join(found)


def engine_attribute_writes(path: Path) -> list[str]:
    """Where `path` sets an attribute on an engine (`engine.x = ...`, `self.engine.x = ...`,
    `setattr(engine, ...)`): state the application would attach to the Engine."""

    def is_engine(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Name)
            and node.id == "engine"
            or isinstance(node, ast.Attribute)
            and node.attr == "engine"
        )

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and is_engine(node.value):
            found.append(f"{path}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if node.args and is_engine(node.args[0]):
                found.append(f"{path}:{node.lineno} setattr")
    return found


def test_nothing_outside_the_engine_attaches_state_to_it():
    """The Engine carries what it builds; what calibration stored is the application's
    (ragkv.app.calibrated.Calibrated, owned by the Runtime)."""
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if not within(module_name(path), ("ragkv.engine",))
        for hit in engine_attribute_writes(path)
    ]
    assert not found, "\n".join(found)


def test_the_attachment_check_sees_one(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(engine, runtime):\n    engine.codebook = 1\n    runtime.engine.x = 2\n    setattr(engine, 'y', 3)\n"
    )
    assert len(engine_attribute_writes(probe)) == 3


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
