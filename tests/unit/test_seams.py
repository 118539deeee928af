"""The package's seams and words: what a newcomer meets first stays readable.

Internal helpers keep their leading underscore (shared inside the package, never outside
it), ``__all__`` lives only on a face and lists public names only, the core has few
top-level entries, module docstrings say what and why in a few lines, and
nothing a user reads carries an issue number of this project.
"""

from __future__ import annotations

import ast
import re

import pytest
from package_sources import ROOT, package_modules

# Modules that are faces though not a package's __init__ (each package's __init__ is the
# face of its package): what users and the integrations import (test_architecture's
# PUBLIC_FACES). Every other module is internal and carries no __all__.
LEAF_FACES = ("aotdist.errors", "aotdist.float8", "aotdist.log", "aotdist.metrics")
# Code outside the package: it uses aotdist's public names only.
OUTSIDE = [ROOT / "callbacks", ROOT / "recipes", ROOT / "scripts"]
# Smoke alarms for neglect, not targets (add a package by concept before nearing them).
MAX_TOP_LEVEL = 25
MAX_MODULE_DOCSTRING = 15  # lines: what and why; measurements and narratives go to docs/
# Documents a user reads (the bench report text is checked through its renderer's source).
USER_TEXT = ["README.md", "docs/**/*.md", "CONTRIBUTING.md", "aotdist/bench/report.py"]
ISSUE_NUMBER = re.compile(r"(?<![\w/-])(?:issue|Issue|ISSUE)s?\s+#?\d+|(?<![\w/.-])#\d{1,4}\b")


def _private_imports(source: str) -> list[str]:
    """``from aotdist... import _name``: a private name taken from another module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aotdist"):
            found += [
                f"line {node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__") and a.name != "_compat"
            ]
    return found


def _dunder_all(source: str) -> list[str]:
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and getattr(node.targets[0], "id", None) == "__all__"
        ):
            return [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
    return []


def test_private_import_detector_sees_a_private_name():
    assert _private_imports("from aotdist.x import a, _b\nfrom torch import _c\n") == [
        "line 1: from aotdist.x import _b"
    ]
    assert _private_imports("from aotdist import _compat\n") == []


def test_no_private_name_imported_from_outside_the_package():
    """Inside aotdist a helper shared by two modules keeps its underscore; code outside
    it (the integrations, the recipes, the scripts) uses public names only."""
    bad = {
        str(p.relative_to(ROOT)): f
        for folder in OUTSIDE
        for p in sorted(folder.rglob("*.py"))
        if (f := _private_imports(p.read_text()))
    }
    assert not bad, f"outside the package, import public names only: {bad}"


def test_dunder_all_detector_reads_the_list():
    assert _dunder_all("import os\n__all__ = ['a', 'b']\n") == ["a", "b"]
    assert _dunder_all("def f():\n    __all__ = ['a']\n") == []  # a module's, not a function's


def test_dunder_all_only_on_faces():
    """An internal module's names are not an API: no ``__all__`` to make them look like one."""
    modules = package_modules()
    faces = {m for m, p in modules.items() if p.name == "__init__.py"} | set(LEAF_FACES)
    assert set(LEAF_FACES) <= set(modules), set(LEAF_FACES) - set(modules)
    bad = sorted(m for m, p in modules.items() if m not in faces and _dunder_all(p.read_text()))
    assert not bad, f"internal modules with an __all__ (drop it, or make the module a face): {bad}"
    missing = sorted(m for m in LEAF_FACES if not _dunder_all(modules[m].read_text()))
    assert not missing, f"faces without an __all__: {missing}"


def test_no_private_name_in_any_dunder_all():
    bad = {
        str(p.relative_to(ROOT)): [
            n for n in _dunder_all(p.read_text()) if n.startswith("_") and not n.startswith("__")
        ]
        for p in package_modules().values()
    }
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"__all__ lists public names only: {bad}"


def test_core_has_few_top_level_entries():
    entries = sorted(
        p.name
        for p in (ROOT / "aotdist").iterdir()
        if p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir())
    )
    assert len(entries) <= MAX_TOP_LEVEL, f"{len(entries)} entries: {entries}"


def test_module_docstrings_are_short():
    long = {}
    for path in package_modules().values():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=True) or ""
        if len(doc.splitlines()) > MAX_MODULE_DOCSTRING:
            long[str(path.relative_to(ROOT))] = len(doc.splitlines())
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING} lines (move to docs/): {long}"


def test_issue_number_detector():
    assert ISSUE_NUMBER.search("Targets (issue 16)")
    assert ISSUE_NUMBER.search("see #24 for the sweep")
    assert not ISSUE_NUMBER.search("pytorch/pytorch#181208 and vLLM#33357")
    assert not ISSUE_NUMBER.search("pytorch#192631, [link](#limits), color #fff")


def test_no_issue_numbers_in_what_users_read():
    found = {}
    for pattern in USER_TEXT:
        for path in ROOT.glob(pattern):
            hits = [m.group(0) for m in ISSUE_NUMBER.finditer(path.read_text())]
            if hits:
                found[str(path.relative_to(ROOT))] = hits[:5]
    assert not found, f"issue numbers in user-facing text: {found}"


@pytest.mark.parametrize("name", ["Tracker", "track", "CompileMetrics"])
def test_metrics_is_part_of_the_public_face(name):
    import aotdist

    assert "metrics" in aotdist.__all__ and hasattr(aotdist.metrics, name)


def test_every_error_and_warning_is_on_one_face():
    """The library's errors and warnings on the root face; the tools' errors (a benchmark
    that failed, a rank of a multi-process test) on the tool's own face only."""
    import aotdist
    import aotdist.bench
    import aotdist.errors
    import aotdist.testing

    tools = {"BenchError": aotdist.bench, "DistributedTestError": aotdist.testing}
    tools["DistributedTimeoutError"] = aotdist.testing
    classes = [n for n in aotdist.errors.__all__ if isinstance(getattr(aotdist.errors, n), type)]
    missing = [n for n in classes if n not in tools and n not in aotdist.__all__]
    assert not missing, f"add to aotdist.__all__: {missing}"
    for name, face in tools.items():
        assert name in face.__all__ and name not in aotdist.__all__, name


def test_arguments_after_the_first_are_keyword_only_with_the_old_form_deprecated():
    import aotdist
    from aotdist.testing.models import TinyGPT

    model = TinyGPT(depth=2)
    with pytest.warns(
        DeprecationWarning,
        match=r"find_regions: passing include by position.*"
        r"Fix: pass include=\.\.\.",
    ):
        old = aotdist.find_regions(model, "GPTBlock")
    assert [r.name for r in old] == [
        r.name for r in aotdist.find_regions(model, include="GPTBlock")
    ]
    with pytest.raises(TypeError, match="multiple values"):
        aotdist.find_regions(model, "GPTBlock", include="GPTBlock")
    with pytest.raises(TypeError, match="at most 3 keyword arguments"):
        aotdist.find_regions(model, None, None, 2, 4)
