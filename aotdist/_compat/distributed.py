"""torch's private distributed pieces: the functional collectives graph-mode FSDP calls
by the names this torch has, and for a world without devices the fake process group and
fake tensors (``aotdist plan``, the test helpers)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from aotdist._compat._base import attr, checked_on, unavailable
from aotdist._compat.compiler import functional_collectives


@checked_on("2.11", "2.14")
@contextlib.contextmanager
def ops_observed(note: Callable[[str, list], None]) -> Iterator[None]:
    """Within: ``note(name, leaves)`` before every op that dispatches (its schema name,
    ``c10d::send``, and the flattened arguments: tensors and process groups among them),
    with a ``TorchDispatchMode`` (``torch.utils._python_dispatch``). A process group comes
    as the ``ScriptObject`` the op takes: :func:`group_of` reads it."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Observer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            note(func.name(), tree_leaves(args))
            return func(*args, **(kwargs or {}))

    with Observer():
        yield


@checked_on("2.11", "2.14")
def group_of(leaves: list) -> Any:
    """The process group among a c10d op's arguments (``ProcessGroup.unbox`` of its
    ``ScriptObject``), or ``None``."""
    import torch
    import torch.distributed as dist

    for a in leaves:
        if isinstance(a, torch.ScriptObject):
            return dist.ProcessGroup.unbox(a)
        if isinstance(a, dist.ProcessGroup):
            return a
    return None


@checked_on("2.11", "2.14")
def group_named(name: str) -> Any:
    """The process group of a functional collective's ``group_name``
    (``torch.distributed.distributed_c10d._resolve_process_group``).

    Raises:
        TorchFeatureUnavailable: This torch has no such resolver.
    """
    resolve = attr("torch.distributed.distributed_c10d", "_resolve_process_group")
    if resolve is None:
        raise unavailable("torch.distributed's _resolve_process_group")
    return resolve(name)


@checked_on("2.11", "2.14")
def fake_store() -> Any:
    """A store for torch's ``fake`` process-group backend, whose collectives do nothing
    (``torch.testing._internal.distributed.fake_pg.FakeStore``).

    Raises:
        TorchFeatureUnavailable: This torch has none.
    """
    store = attr("torch.testing._internal.distributed.fake_pg", "FakeStore")
    if store is None:
        raise unavailable("torch's fake process group (FakeStore)")
    return store()


@checked_on("2.11", "2.14")
def fake_tensor_mode(values: Any | None = None) -> Any:
    """A ``FakeTensorMode`` that also takes real tensors (``torch._subclasses.fake_tensor``):
    tensors made inside hold no memory, and fake tensors that alias one another share one
    storage, as real ones do.

    With ``values``, every op the mode runs goes through ``values.dispatch(func, args,
    kwargs, fake)``, where ``fake(func, args, kwargs)`` runs it as the mode would: a
    subclass overriding ``__torch_dispatch__``, so that the mode stays torch's infra mode
    (Dynamo still compiles under it) and sees the ops of compiled code too.

    The mode is made without its dispatch cache (``fake_tensor_cache_enabled``, read
    when the mode is made): outputs rebuilt from a cache entry get a storage each, so
    three views of one fused projection's output that a compiled region returns would
    count three times in ``aotdist plan``'s saved bytes (measured: 291 KB against the
    real 208 KB on a 3-block GPT at 2 ranks).

    Raises:
        TorchFeatureUnavailable: This torch has none.
    """
    mode = attr("torch._subclasses.fake_tensor", "FakeTensorMode")
    if mode is None:
        raise unavailable("torch's FakeTensorMode")
    made = mode
    if values is not None:
        hop = attr("torch._ops", "HigherOrderOperator") or ()

        class Valued(mode):
            # a higher-order op (invoke_subgraph, checkpointing's run_and_save_rng_state) runs
            # by FakeTensorMode's rule, registered for its exact type; its body's ops come here
            supports_higher_order_operators = True
            running: set = set()  # the higher-order ops inside their rule: redirected back

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                def fake(f, a, k):
                    return mode.__torch_dispatch__(self, f, types, a, k)

                if not isinstance(func, hop):
                    return values.dispatch(func, args, kwargs or {}, fake)
                rule = getattr(func, "python_key_table", {}).get(mode)
                if rule is None or func in self.running:
                    return fake(func, args, kwargs or {})
                self.running.add(func)
                try:
                    return rule(self, *args, **(kwargs or {}))
                finally:
                    self.running.discard(func)

        made = Valued
    with attr("torch._dynamo.config", "patch")(fake_tensor_cache_enabled=False):
        return made(allow_non_fake_inputs=True)


@checked_on("2.11", "2.14")
def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """What a fake tensor raises for an op whose output needs the tensor's values: a
    host read (``DataDependentOutputException``) or an output shape that depends on them
    (``DynamicOutputShapeException``), from ``torch._subclasses.fake_tensor``."""
    names = ("DataDependentOutputException", "DynamicOutputShapeException")
    found = tuple(attr("torch._subclasses.fake_tensor", n) for n in names)
    return tuple(e for e in found if e is not None)


@checked_on("2.11", "2.14")
def run_real(func: Callable, args: Any, kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` on real tensors, past every dispatch mode on the stack
    (inside a mode's ``__torch_dispatch__``; ``torch.utils._mode_utils.no_dispatch``)."""
    no_dispatch = attr("torch.utils._mode_utils", "no_dispatch")
    if no_dispatch is None:
        raise unavailable("torch.utils._mode_utils.no_dispatch")
    with no_dispatch():
        return func(*args, **kwargs)


@checked_on("2.11", "2.14")
def is_fake(t: Any) -> bool:
    """Whether ``t`` is a fake tensor, or a tensor subclass over fake ones
    (``torch._subclasses.fake_tensor.is_fake``)."""
    check = attr("torch._subclasses.fake_tensor", "is_fake")
    return bool(check is not None and check(t))


@checked_on("2.11", "2.14")
def storage_id(storage: Any) -> int:
    """An identity of ``storage`` (its ``StorageImpl``: ``UntypedStorage._cdata``) that
    also tells fake tensors' storages apart, whose ``data_ptr()`` is 0."""
    return storage._cdata


@checked_on("2.11", "2.14", note="2.14 has both names; 2.11 only all_gather_tensor")
def all_gather_single() -> Callable:
    """The functional collective that all-gathers one tensor along a dim, ``(x, dim,
    group)``: ``all_gather_single`` where torch has it, else its older name
    ``all_gather_tensor``.

    Raises:
        TorchFeatureUnavailable: A torch built without distributed support.
    """
    funcol = functional_collectives()
    return getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@checked_on("2.11", "2.14", note="2.14 has both names; 2.11 only reduce_scatter_tensor")
def reduce_scatter_single() -> Callable:
    """The functional collective that reduce-scatters one tensor along a dim, ``(x, op,
    dim, group)``: ``reduce_scatter_single`` where torch has it, else its older name
    ``reduce_scatter_tensor``.

    Raises:
        TorchFeatureUnavailable: A torch built without distributed support.
    """
    funcol = functional_collectives()
    return getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
