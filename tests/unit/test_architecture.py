"""The package's shape: no import cycles, a light ``import aotdist``, small files, and
every private torch / Accelerate access inside ``aotdist/_compat``."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"aotdist": ROOT / "aotdist", "aotdist.callbacks": ROOT / "callbacks"}
# A smoke alarm for a file that outgrew one concept, not a target: split by concept well
# before a file nears it, never to fit the number.
MAX_LINES = 600

# Attributes of torch / Accelerate objects that are private to those libraries.
PRIVATE_ATTRS = {
    "_call_impl",
    "_compiled_call_impl",
    "_get_fsdp_state",
    "_fsdp_param_group",
    "_unsharded_param",
    "_module_info",
    "_parameters",
    "_orig_size",
    "_old_forward",
    "_shared_state",
    "_is_accelerate_prepared",
    "_get_default_store",
    "current_tx",
    "_save_graph",
}


def _files() -> dict[str, Path]:
    """Module name -> file, for aotdist/ and callbacks/ (installed as aotdist.callbacks)."""
    out = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


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
    files = _files()
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
        for p in _files().values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _private_accesses(source: str) -> list[str]:
    """Private torch names and private attributes of torch / Accelerate objects used in
    code (docstrings and comments are not code)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute):
            name = _dotted(node)
            if (
                name
                and name.startswith("torch.")
                and any(p.startswith("_") and not p.startswith("__") for p in name.split("."))
            ):
                found.append(f"{where}: {name}")
            elif node.attr in PRIVATE_ATTRS:
                found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            mod = node.module
            private_mod = any(p.startswith("_") for p in mod.split("."))
            private_name = any(a.name.startswith("_") for a in node.names)
            if mod.split(".")[0] in ("torch", "accelerate", "lightning") and (
                private_mod or private_name
            ):
                found.append(f"{where}: from {mod} import ...")
        elif isinstance(node, ast.Import):
            found += [
                f"{where}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "torch"
                and any(p.startswith("_") for p in a.name.split("."))
            ]
        elif isinstance(node, ast.Call) and _dotted(node.func) in (
            "getattr",
            "setattr",
            "hasattr",
            "delattr",
        ):
            if (
                len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in PRIVATE_ATTRS
            ):
                found.append(f"{where}: {_dotted(node.func)}(..., {node.args[1].value!r})")
    # torch._dynamo.utils is one access, not also torch._dynamo
    return [f for f in found if not any(g != f and g.startswith(f + ".") for g in found)]


def test_private_access_detector_sees_the_forms_used():
    code = (
        "import torch._dynamo\nfrom torch._inductor import config\n"
        "from torch.utils._pytree import tree_map\nx = torch._dynamo.utils.counters\n"
        "m._get_fsdp_state()\ny = getattr(m, '_old_forward', None)\n"
        "'''torch._dynamo in a docstring'''\n"
    )
    assert len(_private_accesses(code)) == 6


def test_private_torch_access_only_in_compat():
    compat = ROOT / "aotdist" / "_compat"
    bad = {}
    for path in _files().values():
        if compat in path.parents:
            continue
        found = _private_accesses(path.read_text())
        if found:
            bad[str(path.relative_to(ROOT))] = found
    assert not bad, f"private torch/Accelerate access outside aotdist/_compat: {bad}"


def test_every_subpackage_is_packaged():
    """A subpackage missing from pyproject's list works editable and breaks as a wheel."""
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {name for name, path in _files().items() if path.name == "__init__.py"}
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
