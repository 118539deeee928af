"""torch.distributed's private pieces aotdist's test helpers use."""

from __future__ import annotations

from typing import Any

from aotdist._compat._base import attr, unavailable

__all__ = ["fake_store"]


def fake_store() -> Any:
    """A store for torch's ``fake`` process-group backend, whose collectives do nothing
    (``torch.testing._internal.distributed.fake_pg.FakeStore``; torch 2.11, 2.15).

    Raises:
        TorchFeatureUnavailable: This torch has none.
    """
    store = attr("torch.testing._internal.distributed.fake_pg", "FakeStore")
    if store is None:
        raise unavailable("torch's fake process group (FakeStore)")
    return store()
