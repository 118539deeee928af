"""The package's shape: no import cycles, the layers in order, a light ``import aotdist``,
small files, every subpackage packaged (private accesses: ``test_private_access.py``)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from package_sources import ROOT, SOURCES, package_modules

# A smoke alarm for a file that outgrew one concept, not a target: split by concept well
# before a file nears it, never to fit the number.
MAX_LINES = 600


def _imports(module: str, path: Path) -> set[str]:
    """Modules of the package that ``module`` imports, at any level (function bodies too)."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")
                pkg = pkg if is_package else pkg[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    files = package_modules()
    graph = {}
    for module, path in files.items():
        deps = set()
        for name in _imports(module, path):
            # "from aotdist.x import y" depends on aotdist.x (and on aotdist.x.y if a module)
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module and name != "aotdist":
                deps.add(name)
            elif name == "aotdist" and module != "aotdist":
                deps.add("aotdist")
        graph[module] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            # importing a package's submodule runs the package's __init__ first, and that
            # __init__ may import the submodule back: not a cycle between concepts
            if node.startswith(dep + "."):
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_detector_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_in_the_package():
    graph = _graph()
    assert "aotdist.compile" in graph and "aotdist.backends.recording" in graph["aotdist.compile"]
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


# The layers, lowest first: a module may import its own layer and those below it, never
# one above. The tools (the last group) may import the core; the core never imports them.
LAYERS = (
    ("aotdist.errors", "aotdist.version", "aotdist.log", "aotdist.config", "aotdist._compat"),
    ("aotdist.regions", "aotdist.float8", "aotdist.per_process"),
    ("aotdist.fixes",),
    ("aotdist.backends",),
    ("aotdist.fsdp",),
    ("aotdist.compile",),
    ("aotdist.metrics", "aotdist.capture", "aotdist.cache"),
    ("aotdist.parallelize",),
    ("aotdist.pipelining",),
    ("aotdist",),
    ("aotdist.callbacks",),
    ("aotdist.launch",),
    ("aotdist.testing",),
    ("aotdist.bench", "aotdist.simulate"),
    ("aotdist.check",),
    ("aotdist.cli",),
)
TOOLS = ("aotdist.launch", "aotdist.testing", "aotdist.bench", "aotdist.simulate")
TOOLS += ("aotdist.check", "aotdist.cli")

# What the integrations (callbacks/) may import: the public faces, and the compatibility
# layer for host-library accessors.
PUBLIC_FACES = (
    "aotdist",
    "aotdist.cache",
    "aotdist.compile",
    "aotdist.config",
    "aotdist.errors",
    "aotdist.float8",
    "aotdist.fsdp",
    "aotdist.log",
    "aotdist.metrics",
    "aotdist.testing",
)


def _layer(module: str) -> int:
    """The index in :data:`LAYERS` of the group holding ``module`` (its longest prefix)."""
    best, found = -1, None
    for i, group in enumerate(LAYERS):
        for prefix in group:
            hit = module == prefix or (prefix != "aotdist" and module.startswith(prefix + "."))
            if hit and len(prefix) > best:
                best, found = len(prefix), i
    if found is None and module.startswith("aotdist"):
        found = LAYERS.index(("aotdist",)) if module == "aotdist" else None
    assert found is not None, f"{module} is in no layer: add it to LAYERS"
    return found


def _root_names() -> set[str]:
    """Names the root binds to a function of the module of that name
    (``from aotdist.parallelize import parallelize``): importing them is the root's face."""
    return {
        a.name
        for node in ast.parse((ROOT / "aotdist" / "__init__.py").read_text()).body
        if isinstance(node, ast.ImportFrom)
        for a in node.names
        if node.module == f"aotdist.{a.name}"
    }


def _direct_imports(module: str, path: Path, files: dict[str, Path]) -> set[str]:
    """The package's modules ``module`` names in its imports: ``from aotdist import cache``
    is ``aotdist.cache``, not the root (the root's own ``__init__`` runs for any import)."""
    root_names = _root_names()
    found = set()
    for name in _imports(module, path):
        if name in files:
            found.add(name)
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # the root's parallelize is the function, not the module
        if isinstance(node, ast.ImportFrom) and node.module == "aotdist" and not node.level:
            shadowed = {f"aotdist.{a.name}" for a in node.names if a.name in root_names}
            found = (found - shadowed) | ({"aotdist"} if shadowed else set())
    # "from aotdist.x import y": drop aotdist.x when only its submodules were named
    explicit = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            if subs <= set(files):
                continue
            explicit.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            explicit.add("<relative>")
        elif isinstance(node, ast.Import):
            explicit.update(a.name for a in node.names)
    resolved = set()
    for name in found:
        subs_only = name not in explicit and any(f.startswith(name + ".") for f in found)
        if not subs_only or "<relative>" in explicit:
            resolved.add(name)
    return {n for n in resolved if n != module}


def test_layer_order_has_no_upward_import():
    files = package_modules()
    upward = []
    for module, path in files.items():
        mine = _layer(module)
        for dep in _direct_imports(module, path, files):
            if module.startswith(dep + "."):  # a package's __init__ runs first anyway
                continue
            if _layer(dep) > mine:
                upward.append(f"{module} -> {dep}")
    assert not upward, f"upward imports (see LAYERS): {upward}"


def test_the_core_never_imports_the_tools():
    files = package_modules()
    bad = [
        f"{module} -> {dep}"
        for module, path in files.items()
        if not module.startswith(TOOLS)
        for dep in _direct_imports(module, path, files)
        if dep.startswith(TOOLS)
    ]
    assert not bad, f"the core imports a tool: {bad}"


def test_layer_check_sees_an_upward_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from aotdist import cache\nfrom aotdist.compile.state import X\n")
    files = {"aotdist.cache": path, "aotdist.compile.state": path, "aotdist.backends.x": path}
    deps = _direct_imports("aotdist.backends.x", path, files)
    assert deps == {"aotdist.cache", "aotdist.compile.state"}
    assert _layer("aotdist.compile.state") > _layer("aotdist.backends.x")


def test_no_cycles_between_packages():
    """Between top-level packages too (compile <-> fsdp was one), not only modules."""
    files = package_modules()

    def package(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:3] if parts[1:2] == ["callbacks"] else parts[:2])

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        for dep in _direct_imports(module, path, files):
            a, b = package(module), package(dep)
            if a != b and a != "aotdist" and b != "aotdist":
                graph.setdefault(a, set()).add(b)
    cycle = _cycle(graph)
    assert cycle is None, f"package cycle: {' -> '.join(cycle)}"


def test_integrations_import_only_public_faces():
    files = package_modules()
    bad = [
        f"{module} -> {dep}"
        for module, path in files.items()
        if module.startswith("aotdist.callbacks")
        for dep in _direct_imports(module, path, files)
        if not dep.startswith(("aotdist.callbacks", "aotdist._compat")) and dep not in PUBLIC_FACES
    ]
    assert not bad, f"callbacks/ imports aotdist internals (use a public face): {bad}"


# compile, capture and the cache ask a model's sharding (aotdist.fsdp.sharding_of) how it
# compiles and how its call sees its parameters; no mode's own module is theirs to import.
MODE_MODULES = ("aotdist.fsdp.gather", "aotdist.fsdp.graph", "aotdist.fsdp.hooks")
ASK_THE_SHARDING = ("aotdist.compile", "aotdist.capture", "aotdist.cache")


def test_compile_capture_and_cache_reach_a_mode_only_through_its_sharding():
    files = package_modules()
    bad = [
        f"{module} -> {dep}"
        for module, path in files.items()
        if module.startswith(ASK_THE_SHARDING)
        for dep in _direct_imports(module, path, files)
        if dep.startswith(MODE_MODULES)
    ]
    assert not bad, f"ask aotdist.fsdp.sharding_of(model) instead: {bad}"


def test_import_aotdist_is_light():
    code = (
        "import sys, json, aotdist; print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('aotdist', 'lightning', 'accelerate', 'torchao', "
        "'torchvision', 'matplotlib', 'transformers'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "aotdist" in loaded
    assert not [m for m in loaded if m.startswith("aotdist.testing")], loaded
    assert not [m for m in loaded if not m.startswith("aotdist")], loaded


def test_no_file_outgrew_a_concept():
    long = {
        str(p.relative_to(ROOT)): n
        for p in package_modules().values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_every_subpackage_is_packaged():
    """A subpackage missing from pyproject's list works editable and breaks as a wheel."""
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {name for name, path in package_modules().items() if path.name == "__init__.py"}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_no_data_files_ship_inside_the_package():
    # Benchmark results and other generated files belong in docs/, not in the wheel.
    shipped = [
        p
        for src in SOURCES.values()
        for p in src.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc", ".typed")
    ]
    assert shipped == [], f"move these out of the package (e.g. to docs/): {shipped}"


def test_readme_names_only_exported_testing_helpers():
    import aotdist.testing

    for name in ("assert_parity", "run_distributed", "TinyGPT", "example_inputs"):
        assert name in aotdist.testing.__all__ and hasattr(aotdist.testing, name), name
