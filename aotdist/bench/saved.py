"""Bytes a training step's forward saves for backward: the figure that predicts
activation memory on a GPU, measured on any device.

:class:`SavedBytes` installs ``torch.autograd.graph.saved_tensors_hooks`` around the
forward. Every tensor autograd saves passes through the pack hook: eager ops' saved
inputs and outputs, and a compiled graph's saved activations (AOTAutograd's
``CompiledFunction`` saves them with ``ctx.save_for_backward``; Dynamo guards only on
hooks it can inline, so these plain Python hooks leave the compiled code in use). The
hook keeps each tensor's storage; on exit the figure is the sum of the unique storages'
``nbytes()`` (a storage saved by several ops, or viewed by several saved tensors, counts
once), read after the forward, so a storage freed or resized to 0 in the forward (FSDP2
resharding its unsharded parameters) counts what it still holds. Storages of the
model's parameters and buffers are reported apart: they are memory the model holds
anyway. Tensor subclasses (DTensor, Float8 tensors) count their inner tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from aotdist import _compat
from aotdist._compat.distributed import storage_id


def _storages(t: torch.Tensor) -> Iterable[torch.UntypedStorage]:
    if _compat.is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:  # DTensor also lists its device mesh: tensors only
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
        return
    yield t.untyped_storage()


def _key(storage: torch.UntypedStorage) -> tuple:
    # the StorageImpl, not data_ptr(): fake tensors' storages (aotdist plan) all read 0
    return (storage.device.type, storage.device.index, storage_id(storage))


class SavedBytes:
    """Context manager measuring what autograd saves for backward inside it.

    Args:
        exclude: Tensors (the model's parameters and buffers) whose storages are counted
            under ``excluded_bytes`` instead of ``activation_bytes``.

    Attributes (after exit):
        activation_bytes: Unique saved storages' bytes, the excluded ones left out.
        excluded_bytes: Unique saved storages' bytes that belong to ``exclude``.
        total_bytes: The sum of both.
        saved_tensors: How many tensors the pack hook saw (repeats included).
    """

    def __init__(self, *, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {_key(s) for t in exclude for s in _storages(t)}
        self.activation_bytes = self.excluded_bytes = self.total_bytes = 0
        self.saved_tensors = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved_tensors += 1
        for s in _storages(t):
            self._seen.setdefault(_key(s), s)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedBytes:
        self._seen: dict[tuple, torch.UntypedStorage] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self.activation_bytes = sum(
            s.nbytes() for k, s in self._seen.items() if k not in self._exclude
        )
        self.excluded_bytes = sum(s.nbytes() for k, s in self._seen.items() if k in self._exclude)
        self.total_bytes = self.activation_bytes + self.excluded_bytes
        self._seen = {}  # drop the references: the saved tensors own their storages
