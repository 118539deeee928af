"""Region calls flattened after AOTAutograd, before the compiler (a measured lever).

Dynamo and AOTAutograd trace each region once (``invoke_subgraph``); :func:`inline_regions`
then copies every call's partitioned forward or backward body into the graph being
compiled, so Inductor lowers, fuses and plans buffers across block boundaries as a
whole-model compile does (vLLM's way), at the cost of lowering every block again.
:func:`inline_backend` is that compile; ``scripts/gpu_probe.py`` measures it
(``aotdist+inline``). It is not a user option: docs/bench/levers.md (lever 1) has why.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch


def _calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph
    ]


def inline_regions(gm: torch.fx.GraphModule) -> int:
    """Replaces every ``invoke_subgraph`` call in ``gm`` (nested ones too) by a copy of its
    body, in place; returns how many calls were replaced."""
    return _inline(gm)


def _inline(gm: torch.fx.GraphModule) -> int:
    count = 0
    for node in _calls(gm):
        attr, operands = node.args[0], node.args[2:]
        body = getattr(gm, str(attr.target))
        count += _inline(body)
        env = dict(zip(body.graph.find_nodes(op="placeholder"), operands, strict=True))
        with gm.graph.inserting_before(node):
            for sub in body.graph.nodes:
                if sub.op in ("placeholder", "output"):
                    continue
                if sub.op == "get_attr":  # a constant or a module of the body: hoist it
                    name = f"{attr.target}_{sub.target}".replace(".", "_")
                    if not hasattr(gm, name):
                        setattr(gm, name, getattr(body, str(sub.target)))
                    env[sub] = gm.graph.get_attr(name)
                    env[sub].meta = dict(sub.meta)
                    continue
                env[sub] = gm.graph.node_copy(sub, env.__getitem__)
        results = body.graph.output_node().args[0]
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(env[results[user.args[1]]])
                gm.graph.erase_node(user)
        if node.users:
            raise RuntimeError(f"inline_regions: {node} is used other than by getitem")
        gm.graph.erase_node(node)
        if not attr.users:
            gm.graph.erase_node(attr)
        count += 1
    if count:
        used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        for name, _ in list(gm.named_children()):
            if isinstance(getattr(gm, name), torch.fx.GraphModule) and name not in used:
                delattr(gm, name)
        gm.graph.lint()
        gm.recompile()
    return count


def inline_backend(mode: str | None = None, options: dict | None = None) -> Callable:
    """Inductor (aotdist's options, ``mode``) on graphs whose region calls are inlined."""
    from aotdist import _compat
    from aotdist.backends.aot import aot_backend
    from aotdist.backends.named import inductor_options

    wrapper = _compat.inductor_wrapper(mode, inductor_options(options), None)
    return aot_backend(wrapper, on_graph=lambda gm, kind: inline_regions(gm))
