"""``nn.Module``'s compiled call slot, and aotdist's wrappers in it, undone in one place.

``nn.Module.__call__`` runs ``model._compiled_call_impl`` when it is set (what
``nn.Module.compile`` sets). aotdist puts its calls there only through
:func:`wrap_compiled_call`, as :class:`CallWrapper` s that record what they wrapped
(``inner``: the slot's value before, ``None`` for the eager call): the compiled call that
fixes or demotes regions, graph-mode FSDP's local shards around it, Accelerate's
first-call metrics. :func:`unwrap_compiled_call` (``aotdist.restore``) undoes them all;
a wrapper the model needs to run at all (``stays``: graph-mode FSDP's shards) is kept,
around the eager call.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from aotdist._compat._base import checked_on, unavailable


@checked_on("2.11", "2.14")
def call_impl(model: nn.Module) -> Callable:
    """``model._call_impl``, what ``nn.Module.compile`` compiles."""
    return model._call_impl


@checked_on("2.11", "2.14")
def compiled_call(model: nn.Module) -> Callable | None:
    """``model._compiled_call_impl`` (set by ``nn.Module.compile``), or ``None``
    (an older module without the slot reads as ``None``)."""
    return getattr(model, "_compiled_call_impl", None)


@checked_on("2.11", "2.14")
def set_compiled_call(model: nn.Module, fn: Callable | None) -> None:
    """Sets ``model._compiled_call_impl``, as ``nn.Module.compile`` does.

    Raises:
        TorchFeatureUnavailable: ``nn.Module`` has no ``_compiled_call_impl`` slot.
    """
    if not hasattr(model, "_compiled_call_impl"):
        raise unavailable("nn.Module._compiled_call_impl (in-place compile)")
    model._compiled_call_impl = fn


@checked_on("2.11", "2.14")
class CallWrapper:
    """What aotdist puts in a model's compiled call slot (:func:`wrap_compiled_call`;
    ``nn.Module._compiled_call_impl``).

    Attributes:
        inner: The slot's value it was installed over (``None``: the eager call).
        stays: Kept by :func:`unwrap_compiled_call`, around the eager call: the model
            cannot run without it (graph-mode FSDP's local shards).
    """

    inner: Callable | None = None
    stays: bool = False

    def rewrap(self, inner: Callable | None) -> None:
        """Wraps ``inner`` from now on (installed over it, or what stays when undone)."""
        self.inner = inner


@checked_on("2.11", "2.14")
def wrap_compiled_call(model: nn.Module, wrapper: CallWrapper) -> CallWrapper:
    """Installs ``wrapper`` as ``model``'s compiled call over the one there, which it
    records as its ``inner``; returns it."""
    wrapper.rewrap(compiled_call(model))
    set_compiled_call(model, wrapper)
    return wrapper


@checked_on("2.11", "2.14")
def unwrap_compiled_call(model: nn.Module) -> None:
    """Undoes every :class:`CallWrapper` in ``model``'s compiled call; the ones that
    ``stay`` wrap what was there before aotdist (the eager call) again."""
    call, stays = compiled_call(model), []
    while isinstance(call, CallWrapper):
        if call.stays:
            stays.append(call)
        call = call.inner
    for wrapper in reversed(stays):
        wrapper.rewrap(call)
        call = wrapper
    if compiled_call(model) is not call:
        set_compiled_call(model, call)
