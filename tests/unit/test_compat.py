"""The compatibility layer's fallbacks, the optional-dependency errors and the str enums."""

from __future__ import annotations

import contextlib
import importlib
import json
import pkgutil
import sys
import types

import pytest
import torch

import aotdist
from aotdist import _compat, metrics
from aotdist._compat import CHECKED_ON, checked_on
from aotdist._compat.extras import require
from aotdist.cache.store import CacheStatus
from aotdist.compile.state import CompileMode
from aotdist.errors import MissingDependencyError
from aotdist.testing import TinyGPT, example_inputs


def test_missing_optional_dependency_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now raises ImportError
    monkeypatch.delitem(sys.modules, "torchao.float8", raising=False)
    with pytest.raises(MissingDependencyError, match=r"pip install 'aotdist\[float8\]'") as info:
        require("torchao.float8", feature="float8.enabled")
    assert info.value.extra == "float8" and isinstance(info.value, ImportError)


def test_metrics_figure_is_none_not_zero_when_the_torch_field_is_missing(monkeypatch):
    fields = _compat.compilation_metric_fields()
    assert fields is not None and "inductor_cumulative_compile_time_us" in fields
    monkeypatch.setattr(
        _compat,
        "compilation_metric_fields",
        lambda: fields - {"inductor_cumulative_compile_time_us"},
    )
    model = TinyGPT(depth=2)
    aotdist.compile_regions(model, backend="aot_eager")
    (x,), _ = example_inputs(model)
    torch._dynamo.reset()
    with metrics.track(model) as m:
        model(x).sum().backward()
    assert m.backend_seconds is None and m.aot_autograd_seconds is None
    assert m.dynamo_seconds is not None and m.dynamo_seconds > 0  # its fields exist
    assert "backend n/a" in m.summary() and "aot_autograd n/a" in m.summary()
    assert json.loads(json.dumps(m.to_dict()))["backend_seconds"] is None


def test_runtime_records_are_not_counted_as_compiled_frames():
    """torch logs run-time work in the compile-metrics table too (``is_runtime``: recording
    a CUDA graph under ``mode="reduce-overhead"`` on a later step). Seen on an H100: a
    steady step reported ``frames 1`` with nothing compiled. Emulated here the way torch's
    cudagraph trees log it: a timed event outside any compile, then the flush that
    Inductor's compiled code runs."""
    from torch._dynamo import utils as dynamo_utils

    model = TinyGPT(depth=2)
    aotdist.compile_regions(model, backend="aot_eager")
    (x,), _ = example_inputs(model)
    model(x).sum().backward()
    with metrics.track(model) as m:
        with dynamo_utils.dynamo_timed(
            "cudagraphify",
            is_backward=False,
            dynamo_compile_column_us="runtime_cudagraphify_time_us",
        ):
            model(x).sum().backward()
        dynamo_utils.get_runtime_metrics_context().finish()
    new = [r for r in dynamo_utils.get_compilation_metrics() if getattr(r, "is_runtime", False)]
    assert new, "torch no longer logs run-time records this way: rewrite this emulation"
    assert m.frames_compiled == 0 and m.recompiles == [], m.summary()


def test_modes_are_strings():
    assert CompileMode.FRAMES == "frames" and f"{CompileMode.GRAPH}" == "graph"
    assert json.dumps({"s": CacheStatus.LOADED}) == '{"s": "loaded"}'
    assert CompileMode("graph") is CompileMode.GRAPH


def _body(*, used_unknown: bool = False) -> torch.fx.GraphModule:
    """A backward body as Dynamo traces it inside a region: ``grad`` has metadata, the
    unused inputs (an autograd.Function's) have none."""
    g = torch.fx.Graph()
    grad = g.placeholder("grad")
    grad.meta["example_value"] = torch.empty(2, 3)
    unused = g.placeholder("unused_0")
    out = g.call_function(torch.mul, (grad, unused if used_unknown else 2.0))
    g.output((out,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_subgraph_dedup_tolerates_unused_placeholders_without_metadata():
    import torch._dynamo.variables.higher_order_ops as hop
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()
    with pytest.raises(KeyError, match="example_value"):  # the torch behaviour worked around
        hop.are_same_graph_modules("f", _body(), _body(), fake)
    with _compat.tolerant_subgraph_dedup():
        assert hop.are_same_graph_modules("f", _body(), _body(), fake) is True
        # a placeholder of unknown metadata that the body reads: not the same (no crash)
        assert (
            hop.are_same_graph_modules(
                "f", _body(used_unknown=True), _body(used_unknown=True), fake
            )
            is False
        )
        with _compat.tolerant_subgraph_dedup():  # nested: still the one wrapper
            assert hop.are_same_graph_modules("f", _body(), _body(), fake) is True
    assert not hasattr(hop.are_same_graph_modules, "_aotdist_original")  # restored


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def _calls(target) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.empty(2)
    g.output((g.call_function(target, (x,)),))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_subgraph_dedup_matches_trampolines_of_one_autograd_function():
    """torch 2.11 traces each ``autograd.Function.apply`` as a fresh trampoline closure."""
    import torch._dynamo.variables.higher_order_ops as hop
    from torch._dynamo.variables.misc import produce_trampoline_autograd_apply as trampoline
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()
    a, b = _calls(trampoline(_Twice)), _calls(trampoline(_Twice))
    other = _calls(trampoline(type("_Other", (_Twice,), {})))
    assert hop.are_same_graph_modules("f", a, b, fake) is False  # torch alone: not the same
    with _compat.tolerant_subgraph_dedup():
        assert hop.are_same_graph_modules("f", a, b, fake) is True
        assert hop.are_same_graph_modules("f", a, other, fake) is False

    def target(gm):
        return next(n.target for n in gm.graph.nodes if n.op == "call_function")

    assert target(b) is not target(a)  # restored


def _count_schema_builds(monkeypatch) -> list:
    """Counts the runs of torch's own ``invoke_subgraph`` ``gen_schema`` (each one re-traces
    a region body)."""
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    runs = []
    original = InvokeSubgraphHOP.gen_schema

    def counting(self, *args, **kwargs):
        runs.append(args[1])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(InvokeSubgraphHOP, "gen_schema", counting)
    return runs


@pytest.mark.parametrize("cached", [False, True])
def test_region_schema_is_built_once_per_region_not_per_call_site(monkeypatch, cached):
    """AOTAutograd asks for a region's schema at every call site (metadata collection and
    joint trace); with the memo inside aotdist's compiled call it is built once."""
    from aotdist.compile import guard as recovery

    if not cached:
        monkeypatch.setattr(
            recovery._compat, "cached_subgraph_schemas", lambda: contextlib.nullcontext()
        )
    runs = _count_schema_builds(monkeypatch)
    torch.manual_seed(0)
    model = TinyGPT(depth=6)
    eager = TinyGPT(depth=6)
    eager.load_state_dict(model.state_dict())
    aotdist.compile_regions(model, backend="aot_eager")
    (x,), _ = example_inputs(model)
    torch._dynamo.reset()
    model(x).float().square().mean().backward()
    eager(x).float().square().mean().backward()
    if cached:  # one schema per region body (forward, its fw/bw graphs), not per call site
        assert runs and len(runs) == len(set(runs)) <= 3, runs
    else:  # torch alone: the body re-traced at every call site, at least once each
        assert max(runs.count(r) for r in set(runs)) >= 6, runs
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_region_schema_memo_keys_on_operand_metadata_and_restores():
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP, invoke_subgraph

    def body(a, b):
        return (a * b,)

    gm = torch.fx.symbolic_trace(body)
    x, y = torch.randn(2, 3), torch.randn(4, 3)
    original = InvokeSubgraphHOP.gen_schema
    with _compat.cached_subgraph_schemas():
        with _compat.cached_subgraph_schemas():  # nested: still the one memo
            assert InvokeSubgraphHOP.gen_schema._aotdist_original is original
        first = invoke_subgraph.gen_schema(gm, "sg", x, x)
        assert invoke_subgraph.gen_schema(gm, "sg", x.clone(), x.clone()) is not first  # aliasing
        same = invoke_subgraph.gen_schema(gm, "sg", x, x)
        other = invoke_subgraph.gen_schema(gm, "sg", y, y)
        assert same is first and other is not first
        assert str(other) == str(original(invoke_subgraph, gm, "sg", y, y))
    assert InvokeSubgraphHOP.gen_schema is original  # restored
    assert invoke_subgraph.gen_schema(gm, "sg", x, x) is not first


def test_recomputable_reductions_is_scoped():
    import torch._functorch.config as functorch_config

    assert functorch_config.ban_recompute_reductions is True  # torch's default
    with _compat.recomputable_reductions():
        assert functorch_config.ban_recompute_reductions is False
        with _compat.recomputable_reductions():  # nested: a no-op
            assert functorch_config.ban_recompute_reductions is False
        assert functorch_config.ban_recompute_reductions is False
    assert functorch_config.ban_recompute_reductions is True


def test_flat_nested_subgraph_refs_names_a_nested_graph_module_by_a_top_level_alias():
    from torch.fx.experimental.proxy_tensor import PythonKeyTracer

    inner = torch.fx.symbolic_trace(lambda a: (a + 1,))
    outer = torch.fx.symbolic_trace(lambda a: (a * 2,))
    outer.add_submodule("repeated_subgraph1", inner)
    tracer = PythonKeyTracer()
    tracer.root = torch.nn.Module()
    tracer.root.add_module("repeated_subgraph0", outer)
    tracer.graph = torch.fx.Graph(tracer_cls=PythonKeyTracer)
    original = PythonKeyTracer.create_node
    with pytest.raises(AttributeError, match="repeated_subgraph0.repeated_subgraph1"):
        tracer.create_node("get_attr", "repeated_subgraph0.repeated_subgraph1", (), {})
    with _compat.flat_nested_subgraph_refs():
        with _compat.flat_nested_subgraph_refs():  # nested: still the one wrapper
            assert PythonKeyTracer.create_node._aotdist_original is original
        first = tracer.create_node("get_attr", "repeated_subgraph0.repeated_subgraph1", (), {})
        again = tracer.create_node("get_attr", "repeated_subgraph0.repeated_subgraph1", (), {})
        plain = tracer.create_node("get_attr", "repeated_subgraph0", (), {})
    assert "." not in first.target and again.target == first.target  # one alias per module
    assert tracer.root.get_submodule(first.target) is inner and plain.target == "repeated_subgraph0"
    assert PythonKeyTracer.create_node is original  # restored


# Public names of aotdist._compat's modules that are not accessors: pure Python that reaches
# no torch / Accelerate / Lightning / torchao internal, so no torch version to check them on.
NOT_ACCESSORS = {
    "aotdist._compat._base.checked_on",  # the decorator itself
    "aotdist._compat._base.attr",  # importlib + getattr: its callers carry the record
    "aotdist._compat._base.unavailable",  # builds aotdist's own error
    "aotdist._compat.enums.StrEnum",  # backport of Python 3.11's enum.StrEnum
    "aotdist._compat.deprecation.positional_after_first_deprecated",  # aotdist's own call forms
    "aotdist._compat.extras.require",  # imports an optional dependency by name
}


def _compat_modules() -> list[types.ModuleType]:
    names = [f"aotdist._compat.{m.name}" for m in pkgutil.iter_modules(_compat.__path__)]
    return [_compat, *map(importlib.import_module, names)]


def _unchecked(module: types.ModuleType, exempt: set[str] = frozenset()) -> list[str]:
    """The public functions and classes defined in ``module`` (not imported into it) that
    carry no ``checked_on`` record, or one naming a version CI does not run."""
    bad = []
    for name, obj in vars(module).items():
        if name.startswith("_") or not callable(obj):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if f"{module.__name__}.{name}" in exempt:
            continue
        record = getattr(obj, "__dict__", {}).get("__aotdist_checked_on__")
        if (
            not isinstance(record, tuple)
            or not record[0]
            or not set(record[0]) <= set(CHECKED_ON)
            or not isinstance(record[1], str)
        ):
            bad.append(name)
    return bad


def test_every_compat_accessor_records_the_torch_versions_it_was_checked_on():
    modules = _compat_modules()
    bad = {m.__name__: names for m in modules if (names := _unchecked(m, NOT_ACCESSORS))}
    assert not bad, f"add @checked_on(...) (aotdist._compat._base) to: {bad}"
    defined = {f"{m.__name__}.{n}" for m in modules for n in vars(m)}
    assert NOT_ACCESSORS <= defined, NOT_ACCESSORS - defined  # no stale exemption
    checked = [
        obj
        for m in modules
        for name, obj in vars(m).items()
        if "__aotdist_checked_on__" in getattr(obj, "__dict__", {}) and obj.__module__ == m.__name__
    ]
    assert len(checked) > 80  # the check saw the accessors, not an empty package
    assert CHECKED_ON == ("2.11", "2.14")  # what .ci/run installs (2.11.0, 2.14.1)


def test_the_record_check_flags_an_accessor_without_one_or_with_a_version_ci_does_not_run():
    module = types.ModuleType("aotdist._compat.dummy")

    def checked():
        pass

    def unchecked():
        pass

    def claims_215():
        pass

    def _private():
        pass

    claims_215.__aotdist_checked_on__ = (("2.11", "2.15"), "")  # as if written by hand
    for fn in (checked, unchecked, claims_215, _private):
        fn.__module__ = module.__name__
        setattr(module, fn.__name__, fn)
    checked_on("2.11", "2.14")(checked)
    module.imported = contextlib.nullcontext  # defined elsewhere: not this module's
    assert _unchecked(module) == ["unchecked", "claims_215"]
    assert _unchecked(module, {"aotdist._compat.dummy.unchecked"}) == ["claims_215"]


def test_checked_on_refuses_a_version_ci_does_not_run_and_returns_the_function_itself():
    with pytest.raises(ValueError, match=r"'2\.99'.*2\.11, 2\.14"):
        checked_on("2.99")
    with pytest.raises(ValueError, match="2.15"):
        checked_on("2.11", "2.15")
    with pytest.raises(ValueError):
        checked_on()

    @contextlib.contextmanager
    def scope():
        yield 1

    marked = checked_on("2.14", note="why")(scope)
    assert marked is scope and marked.__aotdist_checked_on__ == (("2.14",), "why")
    with marked() as value:  # still the context manager, not a wrapper around it
        assert value == 1
    assert _compat.precompile_unavailable.cache_info  # functools.cache's, under the record


def _print_readable_calls(monkeypatch, run) -> int:
    """How many times ``GraphModule.print_readable`` runs during ``run()``."""
    calls = []
    original = torch.fx.GraphModule.print_readable

    def counted(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.GraphModule, "print_readable", counted)
    run()
    monkeypatch.setattr(torch.fx.GraphModule, "print_readable", original)
    return len(calls)


def test_graph_text_is_built_only_when_a_logger_reads_it(monkeypatch):
    """AOTAutograd prints its joint, forward and backward graphs to text on every compile;
    aotdist's compiled call builds that text only when a log reads it."""
    import logging

    # pytest's log capture hangs handlers on torch's structured-trace logger, which reads
    # the text; a training process has none of them
    monkeypatch.setattr(logging.getLogger("torch.__trace"), "handlers", [])

    def train(compile_fn):
        def run():
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = TinyGPT(depth=2)
            (x,), _ = example_inputs(model)
            compile_fn(model)(x).float().sum().backward()

        return run

    plain = _print_readable_calls(
        monkeypatch, train(lambda m: torch.compile(m, backend="aot_eager"))
    )
    assert plain >= 3, plain  # joint, forward, backward: torch builds them unread

    def regions(model):
        aotdist.compile_regions(model, backend="aot_eager")
        return model

    assert _print_readable_calls(monkeypatch, train(regions)) == 0
    torch._logging.set_logs(aot_graphs=True)  # a reader: the text is built as torch does
    try:
        assert _print_readable_calls(monkeypatch, train(regions)) >= 2
    finally:
        torch._logging.set_logs()
    assert not hasattr(
        importlib.import_module("torch._functorch._aot_autograd.graph_compile")._log_joint_graph,
        "_aotdist_original",
    )  # restored after the compile
