"""The ``Example::`` of every public entry point runs as written (CPU, ``aot_eager``).

Each example is taken from its docstring (the indented block after ``Example::``) and run
in a fresh namespace; each ends with an ``assert`` on what it produced.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

import pytest

ENTRY_POINTS = [
    ("aotdist", "compile_regions", None),
    ("aotdist", "parallelize", None),
    ("aotdist.callbacks", "RegionalCompile", "lightning.pytorch"),
    ("aotdist.callbacks", "RegionalCompileHook", "accelerate"),
    ("aotdist.callbacks", "prepare", "accelerate"),
    ("aotdist.callbacks", "TrainerRegionalCompile", "transformers"),
]


def example_of(obj) -> str:
    """The dedented literal block after the ``Example::`` line of ``obj``'s docstring."""
    lines = (inspect.getdoc(obj) or "").splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "Example::"]
    assert starts, f"{obj.__qualname__}: no Example:: section in its docstring"
    block = []
    for line in lines[starts[0] + 1 :]:
        if line.strip() and not line.startswith((" ", "\t")):
            break  # the next section, back at the docstring's own indentation
        block.append(line)
    code = textwrap.dedent("\n".join(block)).strip()
    assert code, f"{obj.__qualname__}: empty Example:: block"
    return code + "\n"


def test_example_extraction_stops_at_the_next_section():
    def f():
        """Does f.

        Example::

            x = 1

            assert x == 1

        Note:
            Not code.
        """

    assert example_of(f) == "x = 1\n\nassert x == 1\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("module", "name", "needs"), ENTRY_POINTS, ids=[f"{m}.{n}" for m, n, _ in ENTRY_POINTS]
)
def test_entry_point_example_runs(module, name, needs, tmp_path, monkeypatch):
    if needs is not None:
        pytest.importorskip(needs)
    code = example_of(getattr(importlib.import_module(module), name))
    asserts = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Assert)]
    assert asserts, f"{module}.{name}: the example should assert on its result"
    monkeypatch.chdir(tmp_path)  # anything an example writes (lightning_logs) stays here
    namespace = {"__name__": f"example_{name}"}
    exec(compile(code, f"<{module}.{name} Example>", "exec"), namespace)  # noqa: S102
