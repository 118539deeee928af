"""``aotdist plan`` for expert parallelism: the token counts a mixture-of-experts step
reads on the host (``.tolist()`` to size its all-to-all), known under fake tensors by
assuming balanced routing, or routing that sends the traced rank F x the mean tokens.

Fake tensors hold no values, so :class:`BalancedRouting` keeps a real value beside each
small fake tensor whose value follows from known ones (factories that are not random,
bookkeeping on them; never a random op's, so not the data's or randomly initialized
weights'), and answers a routing decision on unknown scores (``topk``, ``argmax``,
``max``/``min`` over a dim) with a round-robin choice: token ``i``'s ``j``-th of ``k``
experts is ``(i * k + j) % experts``. Under the fake process group every rank routes as
the traced one (exactly balanced when tokens x k is a multiple of the experts): an
all-to-all returns, from each rank, what this rank sends itself. It also counts the
step's all-to-alls (count, bytes sent, forward and backward) by mesh dimension.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from aotdist._compat.distributed import (
    data_dependent_errors,
    group_named,
    group_of,
    is_fake,
    run_real,
    storage_id,
)
from aotdist._compat.ops import op_schema
from aotdist.errors import ConfigError

ASSUMPTION = (
    "balanced routing: each rank's tokens spread evenly over the experts (every "
    "router top-k replaced by a round-robin choice), every rank routing alike"
)
LIMIT = 1 << 22  # elements: a larger tensor is activations, never bookkeeping
_DECISIONS = {"aten::topk": 1, "aten::max.dim": 1, "aten::min.dim": 1}  # -> indices output
_ARG = ("aten::argmax", "aten::argmin")
_ALL_TO_ALL = ("c10d::alltoall_base_", "_c10d_functional::all_to_all_single")


def imbalanced(factor: float, ranks: int) -> str:
    """The assumption of a plan whose hottest rank receives ``factor`` x the mean tokens."""
    return (
        f"imbalanced routing: the hottest rank (the one planned) receives {factor:g}x the "
        f"mean tokens ({factor:g}/{ranks} of every rank's router choices go to its experts, "
        "the rest spread evenly over the others), every rank routing alike"
    )


class BalancedRouting:
    """The ``values`` of :func:`aotdist._compat.distributed.fake_tensor_mode`.

    Args:
        group_dims: Process group name -> mesh dimension name (all-to-alls counted by it).
        imbalance: The hottest rank's tokens over the mean: 1 is balanced; F > 1 sends
            ``F / world`` of the choices to rank 0's experts (the rank traced), as
            :func:`aotdist.testing.moe.planned_choice` does.
    """

    def __init__(self, group_dims: dict[str, str], imbalance: float = 1.0):
        self.group_dims = group_dims
        self.imbalance = imbalance
        self.values = WeakTensorKeyDictionary()  # fake tensor -> its real value
        self.by_storage: dict[int, list] = {}  # storage -> weakrefs of valued fake tensors
        self.phase: str | None = None  # "forward" / "backward" while counting, else None
        self.all_to_all: dict[tuple[str, str], list[int]] = {}  # (phase, dim) -> count, bytes

    def dispatch(self, func, args, kwargs, fake):
        name = func.name()
        if name == "aten::_local_scalar_dense":
            value = self.values.get(args[0])
            if value is None:
                raise ConfigError(
                    "plan: the model reads a tensor's value on the host (.item(), .tolist()) "
                    f"that the plan cannot know under {ASSUMPTION}: a value computed from the "
                    "weights or the data, not from the router's choices. Fix: size the "
                    "all-to-all from the router's top-k (token counts per expert), or plan "
                    "without that read"
                )
            return value.item()
        try:
            out = fake(func, args, kwargs)
        except data_dependent_errors():  # an output shape from values: from the known ones
            real = self._real(func, args, kwargs)
            if real is None:
                raise
            out = _map(lambda t: self._fake_like(t, fake), real)
            self._keep(out, real)
            return out
        if name.startswith(("c10d::", "_c10d_functional::")):
            self._collective(name, args, out)
            return out
        # a random op's values are no more known than the weights' and the data's
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        real = None if seeded else self._real(func, args, kwargs, out)
        if real is not None:
            self._keep(out, real)
        elif name in _DECISIONS or name in _ARG:
            self._decision(name, args, kwargs, out)
        else:
            self._forget_written(func, args, kwargs)
        return out

    def _value(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if not is_fake(t):
            return t  # a real tensor (a constant)
        return self.values.get(t, _UNKNOWN)

    def _real(self, func, args, kwargs, out: Any = None) -> Any | None:
        """``func`` on the inputs' values, if all are known and every tensor small."""
        if any(t.numel() > LIMIT for t in _leaves(out)):
            return None  # checked first: a factory of the weights' size allocates for real
        mapped = _map(self._value, (args, kwargs))
        if any(v is _UNKNOWN or v.numel() > LIMIT for v in _leaves(mapped)):
            return None
        real = run_real(func, *mapped)
        return None if any(t.numel() > LIMIT for t in _leaves(real)) else real

    def _keep(self, out: Any, real: Any) -> None:
        for f, r in zip(_leaves(out), _leaves(real), strict=False):
            if is_fake(f) and f.shape == r.shape:
                self._set(f, r)

    def _set(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        self.values[fake] = real
        key = storage_id(fake.untyped_storage())
        self.by_storage.setdefault(key, []).append(weakref.ref(fake))

    def _forget_written(self, func, args, kwargs) -> None:
        """An op wrote unknown values into a tensor: it and its views are unknown now."""
        schema = op_schema(func)
        if schema is None:
            return
        flat_args = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args) :]]
        for arg, value in zip(schema.arguments, flat_args, strict=False):
            written = arg.alias_info is not None and arg.alias_info.is_write
            for t in _leaves(value) if written else ():
                self._forget(t)

    def _forget(self, t: torch.Tensor) -> None:
        for ref in self.by_storage.pop(storage_id(t.untyped_storage()), []):
            other = ref()
            if other is not None:
                self.values.pop(other, None)

    def _decision(self, name: str, args, kwargs, out) -> None:
        """A routing choice on unknown scores: round-robin over the experts."""
        scores = args[0]
        if name == "aten::topk":
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            indices = out[1].movedim(dim, -1)
        else:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            indices = out[_DECISIONS[name]] if name in _DECISIONS else out
        if dim is None or indices.numel() > LIMIT:
            return
        import torch.distributed as dist

        from aotdist.testing.moe import planned_choice

        top_k = indices.shape[-1] if name == "aten::topk" else 1
        choice = planned_choice(
            indices.numel() // top_k,
            top_k,
            scores.shape[dim],
            ranks=dist.get_world_size(),
            imbalance=self.imbalance,
        ).view(indices.shape)
        if name == "aten::topk":
            self._set(out[1], choice.movedim(-1, dim).contiguous())
        else:
            self._set(indices, choice)

    def _collective(self, name: str, args, out) -> None:
        if name == "_c10d_functional::wait_tensor":
            value = self._value(args[0])
            if value is not _UNKNOWN:
                self._set(out, value)
            return
        if name not in _ALL_TO_ALL:
            for t in _leaves((args, out)):  # another collective: values unknown
                if is_fake(t):
                    self._forget(t)
            return
        if name == "c10d::alltoall_base_":
            output, source = args[0], args[1]
            group, splits = group_of(list(args)), args[4]
        else:
            output, source, splits, group = out, args[0], args[2], args[3]
            if not isinstance(group, str):
                group = group_of([group])
        group_name = group if isinstance(group, str) else group.group_name
        if self.phase is not None:
            key = (self.phase, self.group_dims.get(group_name, group_name))
            seen = self.all_to_all.setdefault(key, [0, 0])
            seen[0] += 1
            seen[1] += source.numel() * source.element_size()
        self._forget(output)
        value = self._value(source)
        if value is _UNKNOWN:
            return
        size, rank = _size_and_rank(group_name)
        splits = [int(s) for s in splits] or [value.shape[0] // size] * size
        start = sum(splits[:rank])
        mine = value[start : start + splits[rank]]  # what this rank sends itself
        received = torch.cat([mine] * size)
        if received.shape == output.shape:  # every rank routes as this one
            self._set(output, received)

    def _fake_like(self, real: Any, fake) -> Any:
        if not isinstance(real, torch.Tensor):
            return real
        return fake(
            torch.ops.aten.empty_strided.default,
            (real.shape, real.stride()),
            {"dtype": real.dtype, "device": torch.device("cpu")},
        )


class _Unknown:
    pass


_UNKNOWN = _Unknown()


def _size_and_rank(group_name: str) -> tuple[int, int]:
    import torch.distributed as dist

    group = group_named(group_name)
    return dist.get_world_size(group), dist.get_rank(group)


def _map(fn, tree: Any) -> Any:
    """``fn`` over the leaves of an op's (nested lists, tuples, dicts) arguments."""
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(fn, t) for t in tree)
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    return fn(tree)


def _leaves(tree: Any, also: Any = _UNKNOWN) -> list:
    """The tensors (and ``also``'s) among ``tree``'s leaves, in order."""
    found: list = []
    _map(lambda t: found.append(t) if isinstance(t, torch.Tensor) or t is also else None, tree)
    return found
