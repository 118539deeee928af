"""Graph-mode FSDP's gathering: how one sharded parameter becomes the full tensor where a
module reads it, inside the compiled graph.

A module that graph-mode FSDP shards gets a class with one property per parameter
(:func:`_gather_class`); reading it all-gathers the local shard over the shard group with
differentiable functional collectives (:func:`gather`), whose backward reduce-scatters
the gradient there and all-reduces it over the replicas. Float8 weights are cast and
gathered as float8 bytes; ``reshard_after_forward`` keeps a saved gathered tensor as its
shard and gathers it again in backward. Sharding the model: :mod:`aotdist.fsdp.graph`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from aotdist import _compat
from aotdist._compat.distributed import all_gather_single, reduce_scatter_single
from aotdist._compat.modules import view_base
from aotdist._compat.torchao import float8_weight_bits
from aotdist.per_process import made_class
from aotdist.version import __version__

FLOAT8_SCALE = "aotdist_float8_scale"  # a Float8Linear's weight scale (non-persistent buffer)


@dataclass(frozen=True)
class GatherSpec:
    """How one parameter is gathered: a constant of its module's class (one per shape)."""

    shape: tuple[int, ...]  # the full (unsharded) shape
    group: str  # the shard group's name (functional collectives take it in graphs)
    world: int  # the shard group's size
    reshard: bool
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    replicate_group: str | None = None  # HSDP: gradients are averaged over it too
    float8: torch.dtype | None = None  # float8.fsdp_all_gather: gathered in this dtype

    @property
    def padded(self) -> int:
        """The first dim padded to a multiple of the world size."""
        chunk = -(-self.shape[0] // self.world) if self.shape else 1
        return chunk * self.world


def _all_gather(x: torch.Tensor, group: str) -> torch.Tensor:
    funcol = _compat.functional_collectives()
    return funcol.wait_tensor(all_gather_single()(x, 0, group))


def _reduce_scatter_avg(x: torch.Tensor, group: str) -> torch.Tensor:
    funcol = _compat.functional_collectives()
    return funcol.wait_tensor(reduce_scatter_single()(x, "avg", 0, group))


def _all_reduce(x: torch.Tensor, group: str, op: str = "avg") -> torch.Tensor:
    funcol = _compat.functional_collectives()
    return funcol.wait_tensor(funcol.all_reduce(x, op, group))


def _pad0(t: torch.Tensor, size: int) -> torch.Tensor:
    if t.shape[0] == size:
        return t
    return torch.cat([t, t.new_zeros((size - t.shape[0], *t.shape[1:]))])


class _GatherShard(torch.autograd.Function):
    """All-gather of a ``Shard(0)`` local shard; backward: reduce-scatter, averaged."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: GatherSpec) -> torch.Tensor:
        ctx.spec, ctx.local_rows, ctx.local_dtype = spec, local.shape[0], local.dtype
        x = local if spec.param_dtype is None else local.to(spec.param_dtype)
        x = _pad0(x, spec.padded // spec.world).contiguous()
        full = _all_gather(x, spec.group)
        if spec.reshard and not torch.compiler.is_compiling():
            full._aotdist_regather = (local, spec)  # eager: see _pack_gathered
        return full if spec.padded == spec.shape[0] else full[: spec.shape[0]]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _scatter_grad(ctx, grad), None


def _scatter_grad(ctx, grad: torch.Tensor) -> torch.Tensor:
    """A gathered parameter's gradient reduce-scattered (and averaged) to its shard."""
    spec = ctx.spec
    g = grad if spec.reduce_dtype is None else grad.to(spec.reduce_dtype)
    g = _pad0(g, spec.padded).contiguous()
    out = _reduce_scatter_avg(g, spec.group)
    if spec.replicate_group is not None:  # HSDP: the shard, averaged over the replicas
        out = _all_reduce(out, spec.replicate_group)
    return out[: ctx.local_rows].to(ctx.local_dtype)


class _GradToShard(torch.autograd.Function):
    """Forward: a stand-in of the full parameter's shape without storage (an expanded
    zero); backward: the full gradient reduce-scattered to the local shard. It carries
    the gradient of a float8-gathered weight, whose forward value comes from elsewhere."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: GatherSpec, dtype: torch.dtype) -> torch.Tensor:
        ctx.spec, ctx.local_rows, ctx.local_dtype = spec, local.shape[0], local.dtype
        return local.new_zeros((), dtype=dtype).expand(spec.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _scatter_grad(ctx, grad), None, None


class _AsFloat8Weight(torch.autograd.Function):
    """The gathered float8 bytes as torchao's ``Float8TrainingTensor`` (weight role); the
    gradient passes through to ``carrier``, as in torchao's own ``_ToFloat8ConstrFunc``."""

    @staticmethod
    def forward(ctx, carrier: torch.Tensor, bits: torch.Tensor, scale: torch.Tensor, mm_config):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(
            bits, scale, carrier.dtype, mm_config, gemm_input_role=GemmInputRole.WEIGHT
        )

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None, None


def _float8_parts(local: torch.Tensor, spec: GatherSpec, scale: torch.Tensor, mm_config):
    """``float8.fsdp_all_gather``, what torchao's ``fsdp_pre_all_gather`` does under FSDP2,
    inside the region: the local shard cast to float8 with the weight's precomputed
    tensorwise scale and the float8 bytes all-gathered. Returns them with the carrier of
    the weight's high-precision gradient (reduce-scattered in backward). Plain tensors
    only: a tensor subclass may not leave a checkpointed function on torch 2.11."""
    bits = float8_weight_bits(local.detach(), scale, spec.float8, mm_config)
    raw = _pad0(bits.view(torch.uint8), spec.padded // spec.world).contiguous()
    full = _all_gather(raw, spec.group).view(spec.float8)  # uint8: gloo has no float8
    full = full if spec.padded == spec.shape[0] else full[: spec.shape[0]]
    return full, _GradToShard.apply(local, spec, spec.param_dtype or local.dtype)


class _AverageGrad(torch.autograd.Function):
    """A replicated (0-dim) parameter: identity forward, gradient averaged over the mesh."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: GatherSpec) -> torch.Tensor:
        ctx.spec, ctx.local_dtype = spec, local.dtype
        return local.clone() if spec.param_dtype is None else local.to(spec.param_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        g = grad if spec.reduce_dtype is None else grad.to(spec.reduce_dtype)
        out = _all_reduce(g.contiguous(), spec.group)
        if spec.replicate_group is not None:
            out = _all_reduce(out, spec.replicate_group)
        return out.to(ctx.local_dtype), None


def _recompute_policy(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_RECOMPUTE  # everything in a gather: pad, cast, collective


def _recompute_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_recompute_policy)


# else AOTAutograd's cache bypasses every graph with a gather ("SAC context_fn does not
# have a cache_hash attribute"), and each warm start traces and partitions again
_recompute_context.cache_hash = f"aotdist {__version__}: gathers MUST_RECOMPUTE"


def _gather_fn(local: torch.Tensor, spec: GatherSpec, *float8):
    if float8:
        return _float8_parts(local, spec, *float8)
    fn = _AverageGrad if not spec.shape else _GatherShard
    return fn.apply(local, spec)


def gather(local: torch.Tensor, spec: GatherSpec, *float8) -> torch.Tensor:
    """The full parameter from this rank's local shard (differentiable, traceable).

    ``float8``: ``(scale, linear_mm_config)`` of a ``Float8Linear`` weight whose spec
    gathers in float8; the result is then torchao's ``Float8TrainingTensor`` (what
    ``fsdp_post_all_gather`` makes under FSDP2), made of the gathered bytes."""
    if (
        spec.reshard
        and spec.shape
        and torch.is_grad_enabled()
        and local.requires_grad
        and torch.compiler.is_compiling()
    ):
        from torch.utils.checkpoint import checkpoint

        out = checkpoint(
            _gather_fn, local, spec, *float8, use_reentrant=False, context_fn=_recompute_context
        )
    else:
        out = _gather_fn(local, spec, *float8)
    if float8:
        full, carrier = out
        return _AsFloat8Weight.apply(carrier, full, *float8)
    return out


def _pack_gathered(t: torch.Tensor):
    """Eager ``reshard_after_forward``: a gathered parameter (or a view of one) that autograd
    saves is kept as its local shard and gathered again when backward unpacks it."""
    base = t if hasattr(t, "_aotdist_regather") else view_base(t)
    src = getattr(base, "_aotdist_regather", None) if base is not None else None
    if src is None:
        return t
    return (src, tuple(t.size()), tuple(t.stride()), t.storage_offset())


def _unpack_gathered(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    (local, spec), size, stride, offset = packed
    with torch.no_grad():
        x = local if spec.param_dtype is None else local.to(spec.param_dtype)
        full = _all_gather(_pad0(x, spec.padded // spec.world).contiguous(), spec.group)
    return full.as_strided(size, stride, offset)


def _param_property(name: str) -> property:
    def getter(self):
        p = _compat.param_slots(self)[name]
        if p is None or isinstance(p, torch.distributed.tensor.DTensor):
            return p  # outside a forward: the sharded DTensor, as under FSDP2
        spec = type(self)._aotdist_gather[name]
        if spec.float8 is not None:
            return gather(p, spec, getattr(self, FLOAT8_SCALE), self.linear_mm_config)
        return gather(p, spec)

    return property(getter, lambda self, value: nn.Module.__setattr__(self, name, value))


@functools.cache
def _gather_class(base: type, specs: tuple[tuple[str, GatherSpec], ...]) -> type:
    """``base`` with a gathering property per parameter; one class per (base, specs)."""
    namespace = {name: _param_property(name) for name, _ in specs}
    namespace.update(_aotdist_gather=dict(specs), _aotdist_gather_base=base)
    return made_class(
        base,
        namespace,
        remake=(_gather_class, (base, specs)),  # saved guards
        pickles_as_base=True,
    )
