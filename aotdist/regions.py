"""Region discovery: structural signatures, equivalence classes, include/exclude selection.

A *region* is a set of submodules ("instances") that share one structural signature:
the same class, the same parameter and buffer names, shapes, dtypes and tensor types,
the same tree of child classes and the same plain configuration attributes. Instances of
one region can share one compiled subgraph, each call feeding its own weights.

Discovery looks everywhere in the module tree (``nn.ModuleList``, ``nn.Sequential``,
``nn.ModuleDict``, plain attributes), groups candidates by signature and keeps the
outermost repeated unit: a transformer block wins over the MLP inside it. A model that
declares its blocks (diffusers' ``_repeated_blocks``, a list of class names) has those
chosen first within it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from aotdist._compat.deprecation import positional_after_first_deprecated
from aotdist._compat.models import declared_repeated_blocks
from aotdist.errors import ConfigError

# Containers that have no forward of their own: never a region.
_NO_FORWARD = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class Region:
    """One equivalence class of structurally identical submodules.

    Attributes:
        name: Unique, human-readable name of the region within its plan.
        module_type: The class shared by every instance.
        fqns: Fully qualified names of the instances, in module-tree order.
        signature: Short hex digest of the structural signature.
        params_per_instance: Number of parameter elements in one instance.
    """

    name: str
    module_type: type
    fqns: tuple[str, ...]
    signature: str
    params_per_instance: int = 0

    @property
    def count(self) -> int:
        """Number of instances."""
        return len(self.fqns)

    def to_dict(self) -> dict:
        """JSON-able description."""
        return {
            "name": self.name,
            "module_type": _qualname(self.module_type),
            "fqns": list(self.fqns),
            "signature": self.signature,
            "params_per_instance": self.params_per_instance,
        }


class RegionPlan(Sequence[Region]):
    """The regions chosen for a model: a sequence of :class:`Region`, printable as a table."""

    def __init__(self, regions: Iterable[Region]):
        self._regions = tuple(regions)
        names = [r.name for r in self._regions]
        if len(set(names)) != len(names):
            raise ConfigError(f"region names must be unique, got {names}")
        seen: dict[str, str] = {}
        for r in self._regions:
            for fqn in r.fqns:
                if fqn in seen:
                    raise ConfigError(
                        f"module {fqn!r} is in regions {seen[fqn]!r} and {r.name!r}; "
                        "a module can belong to one region only"
                    )
                seen[fqn] = r.name

    def __getitem__(self, index):  # type: ignore[override]
        return self._regions[index]

    def __len__(self) -> int:
        return len(self._regions)

    def __iter__(self) -> Iterator[Region]:
        return iter(self._regions)

    def __repr__(self) -> str:
        return f"RegionPlan({[r.name for r in self._regions]})"

    def by_name(self, name: str) -> Region:
        """Returns the region called ``name``.

        Raises:
            KeyError: No region has that name; the message lists the names.
        """
        for r in self._regions:
            if r.name == name:
                return r
        raise KeyError(f"no region {name!r}; regions: {[r.name for r in self._regions]}")

    def region_of(self, fqn: str) -> Region | None:
        """The region whose instance is ``fqn``, or ``None``."""
        for r in self._regions:
            if fqn in r.fqns:
                return r
        return None

    @property
    def fqns(self) -> list[str]:
        """Every instance FQN of every region."""
        return [f for r in self._regions for f in r.fqns]

    def to_dict(self) -> dict:
        """JSON-able description."""
        return {"regions": [r.to_dict() for r in self._regions]}

    def __str__(self) -> str:
        header = ("region", "class", "count", "params/inst", "instances")
        rows = [
            (
                r.name,
                r.module_type.__name__,
                str(r.count),
                f"{r.params_per_instance:,}",
                abbreviate_fqns(r.fqns),
            )
            for r in self._regions
        ]
        if not rows:
            return "RegionPlan: no repeated regions found"
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in rows]
        return "\n".join(lines)


def abbreviate_fqns(fqns: Sequence[str], limit: int = 3) -> str:
    """``blocks.0 .. blocks.31`` style summary of a list of FQNs."""
    if not fqns:
        return ""
    split = [re.match(r"^(.*?)(\d+)$", f) for f in fqns]
    if all(split) and len({m.group(1) for m in split}) == 1:  # type: ignore[union-attr]
        prefix = split[0].group(1)  # type: ignore[union-attr]
        nums = [int(m.group(2)) for m in split]  # type: ignore[union-attr]
        if nums == list(range(nums[0], nums[0] + len(nums))) and len(nums) > 2:
            return f"{prefix}{{{nums[0]}..{nums[-1]}}}"
        return f"{prefix}{{{','.join(map(str, nums))}}}"
    if len(fqns) <= limit:
        return ", ".join(fqns)
    return ", ".join(fqns[:limit]) + f", ... (+{len(fqns) - limit})"


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _region_base_class(module: nn.Module) -> type:
    """The class marking subclasses, looking through aotdist's marking subclass."""
    return getattr(type(module), "_aotdist_base", type(module))


def _user_class(module: nn.Module) -> type:
    """The user's class, for names and patterns: also looks through FSDP2's subclass.

    ``fully_shard`` swaps an instance's class for ``FSDP<Name>(FSDPModule, <Name>)``.
    """
    cls = _region_base_class(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__.startswith("FSDP"):
        return bases[1]
    return cls


def _tensor_desc(t: torch.Tensor) -> tuple:
    desc: tuple = (tuple(t.shape), str(t.dtype), t.device.type, type(t).__name__)
    # Subclasses (Float8 weights, DTensor) describe their inner tensors too.
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, nn.Parameter):
        try:
            names, _ = flatten()
            desc += tuple((n, type(getattr(t, n)).__name__) for n in names)
        except Exception:  # a subclass whose flatten needs more context: type is enough
            pass
    return desc


def _plain_attrs(module: nn.Module) -> tuple:
    """Configuration attributes of torch.nn's own modules (``stride``, ``eps``, ``p``...).

    A user module's attributes other than bools are left out: they are often bookkeeping
    that differs per instance (``layer_idx`` in transformers' attention) and would split every stack of
    blocks into singletons. That is safe: when such an attribute does change what a block
    computes, Dynamo's reuse guards see it and trace another subgraph (the metrics then
    show ``subgraphs > 1``); results stay right.
    """
    if not type(module).__module__.startswith("torch.nn."):
        # A user module's flags (T5's is_decoder, is_causal) do select what it computes:
        # encoder and decoder layers of one class are two regions, not one split by guards.
        return tuple(
            sorted(
                (k, repr(v))
                for k, v in vars(module).items()
                if not k.startswith("_") and k != "training" and type(v) is bool
            )
        )
    items = []
    for key, value in vars(module).items():
        if key.startswith("_"):
            continue
        if isinstance(value, _PLAIN) or (
            isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value)
        ):
            items.append((key, repr(value)))
    return tuple(sorted(items))


def structural_signature(module: nn.Module) -> str:
    """A short digest that is equal for modules one compiled subgraph can serve.

    It covers the module class, every submodule's class and plain configuration
    attributes (``stride``, ``eps``, ``p``...), and every parameter's and buffer's name,
    shape, dtype, device type and tensor type (Float8 and DTensor subclasses included).
    """
    parts: list = []
    for name, sub in module.named_modules():
        parts.append(("m", name, _qualname(_region_base_class(sub)), _plain_attrs(sub)))
    for name, p in module.named_parameters():
        parts.append(("p", name, p.requires_grad, _tensor_desc(p)))
    for name, b in module.named_buffers():
        parts.append(("b", name, _tensor_desc(b)))
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:12]


def _as_patterns(value, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    try:
        patterns = tuple(value)
    except TypeError:
        raise ConfigError(
            f"{key} must be a class name, an FQN glob pattern or a list of them; "
            f"got {type(value).__name__} {value!r}"
        ) from None
    bad = [p for p in patterns if not isinstance(p, str) or not p]
    if bad:
        raise ConfigError(f"{key} entries must be non-empty strings; got {bad!r}")
    return patterns


def _matches(pattern: str, fqn: str, module: nn.Module) -> bool:
    cls = _user_class(module)
    return pattern in (cls.__name__, cls.__qualname__, _qualname(cls)) or fnmatch.fnmatchcase(
        fqn, pattern
    )


def _is_inside(fqn: str, outer: str) -> bool:
    return fqn.startswith(outer + ".")


def _unknown_pattern_error(key: str, unknown: list[str], modules: list[tuple[str, nn.Module]]):
    counts: dict[str, int] = {}
    for _, m in modules:
        name = _user_class(m).__name__
        counts[name] = counts.get(name, 0) + 1
    classes = ", ".join(
        f"{n} (x{c})" for n, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:25]
    )
    examples = ", ".join(f for f, _ in modules[:6])
    return ConfigError(
        f"{key}: {unknown!r} matched no module of this model. A pattern is a class name "
        f"or a glob over module FQNs. Classes found: {classes}. FQNs look like: {examples}."
    )


@positional_after_first_deprecated
def find_regions(
    model: nn.Module,
    *,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    min_repeats: int = 2,
) -> RegionPlan:
    """Finds the repeated regions of ``model``.

    Args:
        model: The model to analyse. It is not modified.
        include: Class names or FQN glob patterns (``"layers.*"``) of the modules that may
            become region instances. ``None`` considers every module with children, the
            blocks a model declares in ``_repeated_blocks`` (diffusers) first: no region
            then holds a declared block.
            An included module may be a leaf (a lone ``Linear``).
        exclude: Class names or FQN glob patterns of modules that never become instances.
            Modules inside an excluded module can still form regions of their own.
        min_repeats: The fewest instances a region needs.

    Returns:
        The plan, outermost regions only, in module-tree order.

    Raises:
        ConfigError: ``min_repeats`` is not a positive int, or an ``include``/``exclude``
            pattern matches no module (the message lists the classes found).
    """
    if isinstance(min_repeats, bool) or not isinstance(min_repeats, int) or min_repeats < 1:
        raise ConfigError(f"min_repeats must be an int >= 1; got {min_repeats!r}")
    includes = _as_patterns(include, "include")
    excludes = _as_patterns(exclude, "exclude")
    modules = list(model.named_modules())[1:]  # the root is never a region
    for key, patterns in (("include", includes), ("exclude", excludes)):
        unknown = [p for p in patterns if not any(_matches(p, f, m) for f, m in modules)]
        if unknown:
            raise _unknown_pattern_error(key, unknown, modules)

    declared = () if includes else _declared_blocks(model)
    groups: dict[tuple[str, bool], list[tuple[str, nn.Module]]] = {}
    for fqn, mod in modules:
        if isinstance(mod, _NO_FORWARD):
            continue
        seeded = _is_declared(fqn, mod, declared)
        if seeded:
            pass  # a declared block is a candidate as it is (unless excluded)
        elif includes:
            if not any(_matches(p, fqn, mod) for p in includes):
                continue
        elif not any(True for _ in mod.children()):
            continue  # a lone leaf op is not worth a region unless asked for
        if any(_matches(p, fqn, mod) for p in excludes):
            continue
        groups.setdefault((structural_signature(mod), seeded), []).append((fqn, mod))

    # Declared blocks first, then outermost first: shallower groups claim their subtrees
    # before nested ones are seen.
    def depth(item: tuple[tuple[str, bool], list]) -> tuple[bool, int, int]:
        fqns = [f for f, _ in item[1]]
        return (not item[0][1], min(f.count(".") for f in fqns), order[fqns[0]])

    order = {fqn: i for i, (fqn, _) in enumerate(modules)}
    chosen: list[tuple[str, list[tuple[str, nn.Module]]]] = []
    claimed: list[str] = []
    seeds: list[str] = []
    for (sig, seeded), members in sorted(groups.items(), key=depth):
        free = [(f, m) for f, m in members if not any(_is_inside(f, c) for c in claimed)]
        # Nor may a unit hold a declared block: the model said where its regions are.
        free = [(f, m) for f, m in free if not any(_is_inside(c, f) for c in seeds)]
        if len(free) < min_repeats:
            continue
        # A member containing another member (a recursive structure) keeps the outer one.
        free = [(f, m) for f, m in free if not any(_is_inside(f, g) for g, _ in free)]
        if len(free) < min_repeats:
            continue
        chosen.append((sig, free))
        claimed.extend(f for f, _ in free)
        if seeded:
            seeds.extend(f for f, _ in free)

    if includes and not chosen:
        matched = {f: m for f, m in modules if any(_matches(p, f, m) for p in includes)}
        sizes = sorted((len(g) for g in groups.values()), reverse=True)
        raise ConfigError(
            f"include={list(includes)} matched {len(matched)} module(s) "
            f"({abbreviate_fqns(list(matched))}) but no {min_repeats} of them share a "
            f"structural signature (group sizes: {sizes}); they differ in class, parameter "
            "shapes/dtypes or torch.nn configuration. Fix: include modules that repeat, "
            "or pass min_repeats=1 to compile each one as its own region."
        )
    chosen.sort(key=lambda item: order[item[1][0][0]])
    names = _region_names(chosen)
    regions = [
        Region(
            name=name,
            module_type=_region_base_class(members[0][1]),
            fqns=tuple(f for f, _ in members),
            signature=sig,
            params_per_instance=sum(p.numel() for p in members[0][1].parameters()),
        )
        for name, (sig, members) in zip(names, chosen, strict=True)
    ]
    return RegionPlan(regions)


def _declared_blocks(model: nn.Module) -> tuple[tuple[str, frozenset[str]], ...]:
    """The blocks ``model`` declares as its repeated ones: ``(fqn prefix, class names)`` for
    each submodule whose class sets a non-empty ``_repeated_blocks`` (diffusers' models, for
    their ``compile_repeated_blocks()``; ``""`` is the root)."""
    found = []
    for fqn, mod in model.named_modules():
        names = declared_repeated_blocks(type(mod))
        if isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names):
            found.append((fqn, frozenset(names)))
    return tuple(found)


def _is_declared(fqn: str, module: nn.Module, declared) -> bool:
    name = _user_class(module).__name__
    return any(
        name in names and (not prefix or _is_inside(fqn, prefix)) for prefix, names in declared
    )


def _region_names(chosen: list[tuple[str, list[tuple[str, nn.Module]]]]) -> list[str]:
    """Class name, disambiguated by the instances' common FQN prefix when a class repeats."""
    by_class: dict[str, int] = {}
    for _, members in chosen:
        cls = _user_class(members[0][1]).__name__
        by_class[cls] = by_class.get(cls, 0) + 1
    names: list[str] = []
    for _, members in chosen:
        cls = _user_class(members[0][1]).__name__
        if by_class[cls] == 1:
            names.append(cls)
            continue
        parents = {f.rsplit(".", 1)[0] if "." in f else "" for f, _ in members}
        suffix = parents.pop() if len(parents) == 1 else members[0][0]
        name = f"{cls}@{suffix}" if suffix else f"{cls}#{len(names)}"
        while name in names:
            name += "'"
        names.append(name)
    return names
