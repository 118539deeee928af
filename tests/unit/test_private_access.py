"""Every private access to torch and the host libraries sits in ``aotdist/_compat``.

An allow-list, not a deny-list: outside ``aotdist/_compat`` an underscore attribute
(``x._name``, ``getattr(x, "_name")``) passes only if aotdist defines the name itself
(:func:`own_names`, computed from the sources) or it is one of the stdlib names of
:data:`STDLIB`; a host's private module or name (``torch._dynamo``,
``from lightning.pytorch._x import y``) never passes. The old deny-list
(:data:`PRIVATE_ATTRS`) and the hosts' private names that aotdist also defines
(:data:`SHARED`) never pass by the computed set; a subprocess reads the private names of
the hosts' main objects and fails on a new overlap. Each move into ``_compat`` is one
accessor with its ``checked_on`` record (``tests/unit/test_compat.py``).
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from collections.abc import Iterable, Iterator

from package_sources import ROOT, package_modules

COMPAT = ROOT / "aotdist" / "_compat"

# The host libraries: their private modules and names are reached from aotdist/_compat only.
HOSTS = ("torch", "torchao", "lightning", "pytorch_lightning", "lightning_fabric")
HOSTS += ("accelerate", "transformers", "peft", "diffusers", "trl", "timm", "torchtitan")

# The deny-list this check grew from: private attributes of torch / Accelerate objects,
# never allowed outside aotdist/_compat, whoever else defines a name like them.
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

# A host's private name that aotdist also defines for its own use: never allowed by the
# computed set (``trainer._run()`` is Lightning's); only ``self._x`` inside an aotdist
# class that defines ``_x`` is aotdist's. The host's, then aotdist's definition.
SHARED = {
    "_apply": "nn.Module._apply; RegionalCompile / TrainerRegionalCompile._apply (callbacks)",
    "_run": "lightning Trainer._run; RegionGuardedCall, Trials, Precompiled, ShardedCall._run",
    "_repeated_blocks": "diffusers ModelMixin._repeated_blocks; aotdist.bench.strategies' function",
}

# Python's own private names that aotdist uses, allowed in this spelling only (receiver and
# name), each with why it is not a host's internal. Every entry is used (a test checks).
STDLIB = {
    "sys._getframe": "documented in sys: the warning's stack level (aotdist.log)",
    "os._exit": "documented in os: exit without interpreter teardown (aotdist.launch)",
    "threading._shutdown": "CPython's exit step 1, probed by hasattr (aotdist.launch.teardown)",
    "atexit._run_exitfuncs": "CPython's exit step 2: the atexit handlers (aotdist.launch.teardown)",
    "copyreg._reconstructor": "what object.__reduce_ex__ returns below protocol 2 (per_process)",
}

_ATTR_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _private(name: object) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _named_attribute(node: ast.AST) -> tuple[ast.AST, str] | None:
    """``(receiver, name)`` of ``getattr/setattr/hasattr/delattr(receiver, "name", ...)``."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _ATTR_FUNCTIONS
        and len(node.args) > 1
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[0], node.args[1].value
    return None


def _statements(body: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """The statements of a module or class body, into ``if`` / ``try`` / ``with`` blocks
    but not into the functions and classes it defines."""
    for st in body:
        yield st
        if not isinstance(st, _DEFS):
            for name in ("body", "orelse", "finalbody", "handlers"):
                yield from _statements(getattr(st, name, ()))


def _bound(body: Iterable[ast.AST]) -> set[str]:
    """Names a module or class body binds: its defs, assigned names (dataclass fields
    too), import aliases."""
    out = set()
    for st in _statements(body):
        if isinstance(st, _DEFS):
            out.add(st.name)
        elif isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(st, (ast.Import, ast.ImportFrom)):
            out |= {a.asname for a in st.names if a.asname}
    return out


def _on_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _self_stores(tree: ast.AST) -> set[str]:
    """What ``tree`` assigns on ``self`` (``self._x = ...``, ``setattr(self, "_x", ...)``):
    an attribute of aotdist's own object. Not ``obj._x = ...`` on another: that is how
    ``_compat`` writes into a host's objects (``fn._boxed_call``, ``module._old_forward``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if _on_self(node.value):
                out.add(node.attr)
        elif (named := _named_attribute(node)) and node.func.id == "setattr":
            if _on_self(named[0]):
                out.add(named[1])
    return out


def _class_names(cls: ast.ClassDef) -> set[str]:
    """The names an aotdist class gives its instances: its defs and class-level names,
    and what its methods assign on ``self``."""
    return _bound(cls.body) | _self_stores(cls)


def own_names(sources: Iterable[str]) -> set[str]:
    """The underscore names aotdist defines itself in ``sources`` (its files, _compat
    too): function and class names, names bound at module or class level, attributes
    assigned on ``self``, and every ``_aotdist*`` name, attribute or string (the prefix
    of aotdist's markers on the objects it changes)."""
    names = set()
    for source in sources:
        tree = ast.parse(source)
        names |= _bound(tree.body) | _self_stores(tree)
        for node in ast.walk(tree):
            if isinstance(node, _DEFS):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= _bound(node.body)
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_aotdist"):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith("_aotdist") and node.value.isidentifier():
                    names.add(node.value)
    return {n for n in names if _private(n)}


@functools.cache
def _sources_own_names() -> frozenset[str]:
    return frozenset(own_names(p.read_text() for p in package_modules().values()))


def allowed_names() -> set[str]:
    """aotdist's own names, less the old deny-list and the hosts' names it also defines."""
    return set(_sources_own_names()) - PRIVATE_ATTRS - set(SHARED)


def _walk(node: ast.AST, mine: frozenset[str] = frozenset()) -> Iterator[tuple[ast.AST, frozenset]]:
    """Every node under ``node``, with the names of its innermost enclosing class."""
    for child in ast.iter_child_nodes(node):
        yield child, mine
        inner = frozenset(_class_names(child)) if isinstance(child, ast.ClassDef) else mine
        yield from _walk(child, inner)


def _foreign(receiver: ast.AST, name: str, allowed: set[str], mine: frozenset[str]) -> bool:
    """Whether ``receiver.name`` reaches a name that is not aotdist's."""
    if name in PRIVATE_ATTRS:
        return True
    if not _private(name) or name in allowed:
        return False
    if _on_self(receiver) and name in mine:  # an attribute of this class's own instances
        return False
    return f"{_dotted(receiver)}.{name}" not in STDLIB


def private_accesses(source: str, allowed: set[str]) -> list[str]:
    """The private names of torch and the host libraries that ``source``'s code uses
    (docstrings and comments are not code), given aotdist's own names ``allowed``."""
    found = []
    for node, mine in _walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute):
            name = _dotted(node)
            parts = name.split(".") if name else []
            if parts and parts[0] in HOSTS and any(map(_private, parts)):
                found.append(f"{where}: {name}")
            elif _foreign(node.value, node.attr, allowed, mine):
                found.append(f"{where}: {_dotted(node.value) or '(...)'}.{node.attr}")
        elif named := _named_attribute(node):
            if _foreign(*named, allowed, mine):
                receiver = _dotted(named[0]) or "..."
                found.append(f"{where}: {node.func.id}({receiver}, {named[1]!r})")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts = node.module.split(".")
            if parts[0] in HOSTS and (
                any(map(_private, parts)) or any(_private(a.name) for a in node.names)
            ):
                found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [
                f"{where}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] in HOSTS and any(map(_private, a.name.split(".")))
            ]
    # torch._dynamo.utils is one access, not also torch._dynamo
    return [f for f in found if not any(g != f and g.startswith(f + ".") for g in found)]


def test_private_access_only_in_compat():
    allowed = allowed_names()
    assert {"_aotdist_state", "_fqn_to_region", "_window", "_LOGGER"} <= allowed
    assert not {"_run", "_apply", "_old_forward", "_boxed_call", "_compiled_call_impl"} & allowed
    bad = {}
    for path in package_modules().values():
        if COMPAT in path.parents:
            continue
        found = private_accesses(path.read_text(), allowed)
        if found:
            bad[str(path.relative_to(ROOT))] = found
    assert not bad, (
        f"private names of torch or a host library outside aotdist/_compat: {bad}. Fix: an "
        "accessor in aotdist/_compat (with @checked_on), called from there"
    )


# ------------------------------------------------------------ the detector is falsifiable


def test_the_detector_flags_a_host_s_private_names():
    code = (
        "import torch._dynamo\nfrom torch._inductor import config\n"
        "from torch.utils._pytree import tree_map\nfrom torch import _dynamo\n"
        "x = torch._dynamo.utils.counters\nm._get_fsdp_state()\n"
        "y = getattr(m, '_old_forward', None)\nif trainer._compiler_ctx:\n    pass\n"
        "bits = cast(w)._data\nfrom torchao.float8._x import y\nimport lightning.pytorch._x\n"
        "nn.modules.batchnorm._BatchNorm\nhasattr(mod, '_forward_hooks')\nt.current_tx\n"
        "'''torch._dynamo in a docstring'''\n"
    )
    found = private_accesses(code, allowed=set())
    assert len(found) == 14, found
    assert "line 10: (...)._data" in found and "line 8: trainer._compiler_ctx" in found


def test_the_detector_passes_aotdist_s_own_names_and_only_them():
    allowed = own_names(["class Plan:\n    _plan = None\n"])
    assert allowed == {"_plan"} and private_accesses("self._plan\nx._plan", allowed) == []
    assert private_accesses("self._plans", allowed) == ["line 1: self._plans"]
    marker = "model._aotdist_state = 1\nhasattr(model, '_aotdist_state')\n"
    assert private_accesses(marker, own_names([marker])) == []


def test_a_host_private_name_aotdist_also_defines_is_its_own_on_self_only():
    code = (
        "class Guard:\n    def _run(self):\n        pass\n"
        "    def __call__(self):\n        return self._run()\n"
        "def call(self, trainer):\n    self._run()\n    trainer._run()\n"
        "m._parameters\n"
    )
    own = own_names([code + "self._parameters = {}\n"])
    assert {"_run", "_parameters"} <= own
    found = private_accesses(code, own - PRIVATE_ATTRS - {"_run"})
    assert found == ["line 7: self._run", "line 8: trainer._run", "line 9: m._parameters"]
    assert private_accesses("m._parameters\n", {"_parameters"}) == ["line 1: m._parameters"]


def test_own_names_are_definitions_not_writes_into_other_objects():
    code = (
        "import torch._x as _t\n_A = 1\ntry:\n    _B = 2\nexcept ImportError:\n    pass\n"
        "def _f():\n    fn._boxed_call = True\n    setattr(module, '_old', 1)\n"
        "@dataclass\nclass C:\n    _field: int = 0\n    def _m(self):\n"
        "        self._x = 1\n        setattr(self, '_y', 2)\n"
        "KEY = '_aotdist_keep'\n"
    )
    found = own_names([code])
    assert found == {"_t", "_A", "_B", "_f", "_field", "_m", "_x", "_y", "_aotdist_keep"}


def test_a_stdlib_name_passes_in_its_own_spelling_only():
    code = "sys._getframe(1)\nos._exit(0)\nhasattr(threading, '_shutdown')\nframe._getframe\n"
    assert private_accesses(code, allowed=set()) == ["line 4: frame._getframe"]


# --------------------------------------------------- the allow-lists stay true as hosts move

_HOST_OBJECTS = """
import importlib, json
import torch
from torch import nn

objects = [nn.Module(), nn.Linear(1, 1), nn.BatchNorm1d(1), nn.Dropout(), torch.empty(0)]
objects.append(nn.Parameter(torch.empty(0)))
classes = {
    "torch.fx": ["GraphModule", "Graph", "Node", "Tracer", "Interpreter"],
    "torch.autograd": ["Function"],
    "torch.distributed.tensor": ["DTensor"],
    "torch.distributed.fsdp": ["FSDPModule"],
    "lightning.pytorch": ["Trainer", "LightningModule", "Callback"],
    "accelerate": ["Accelerator"],
    "accelerate.hooks": ["ModelHook"],
    "accelerate.state": ["AcceleratorState"],
    "torchao.float8.float8_linear": ["Float8Linear"],
    "torchao.float8.float8_training_tensor": ["Float8TrainingTensor"],
    "transformers": ["PreTrainedModel", "PretrainedConfig", "Trainer", "TrainerCallback"],
    "diffusers": ["ModelMixin"],
    "peft": ["PeftModel"],
}
for module, names in classes.items():
    try:
        objects += [getattr(importlib.import_module(module), n) for n in names]
    except ImportError:  # an optional host that is not installed
        pass
names = {n for o in objects for n in dir(o) if n.startswith("_") and not n.startswith("__")}
print(json.dumps(sorted(names)))
"""


def test_no_name_aotdist_defines_is_also_a_host_s_private_name_unless_listed():
    out = subprocess.run(
        [sys.executable, "-c", _HOST_OBJECTS], capture_output=True, text=True, check=True
    )
    host = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert {"_apply", "_parameters", "_base"} <= host  # the hosts' objects were read
    own = _sources_own_names()
    clash = (own & host) - PRIVATE_ATTRS - set(SHARED)
    assert not clash, (
        f"aotdist defines {sorted(clash)}, also private names of a host's objects: add each "
        "to SHARED (the host's and aotdist's definition), or rename aotdist's"
    )
    assert set(SHARED) <= own, f"stale SHARED entries: {sorted(set(SHARED) - own)}"


def _spelled(source: str) -> set[str]:
    """Every ``receiver.name`` that ``source`` spells, as an attribute or by getattr & co."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            out.add(f"{_dotted(node.value)}.{node.attr}")
        elif named := _named_attribute(node):
            out.add(f"{_dotted(named[0])}.{named[1]}")
    return out


def test_every_stdlib_entry_is_used():
    used = set().union(*(_spelled(p.read_text()) for p in package_modules().values()))
    assert set(STDLIB) <= used, f"stale STDLIB entries: {sorted(set(STDLIB) - used)}"
