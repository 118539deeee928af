"""Finding the regions behind a compile failure whose error does not name them.

Each trial re-marks the regions (some nested, some inline), and calls the compiled model
with the recording backend in dry-run mode: Dynamo traces, AOTAutograd traces the joint
graph, and the backend then stops the call before anything runs, so user code has no
side effects. Bisection over the live regions finds the ones the model fails with; a
region whose trial passes with its outputs cloned is fixed rather than demoted.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from aotdist.backends.recording import DryRunDone
from aotdist.compile.marking import apply_region_class, unmark_region
from aotdist.compile.state import RegionState
from aotdist.errors import exception_chain

_CLONE = "clone_aliasing_outputs"


class Trials:
    """Dry-run compiles of ``model`` with chosen regions nested or inline.

    Args:
        model: The root module.
        state: Its region state (``state.backend`` is the recording backend).
        run: Calls the compiled model on the failing call's inputs.
        backend: The recording backend ``run`` compiles with.
    """

    def __init__(self, model: nn.Module, state: RegionState, run: Callable[[], object], backend):
        self._model, self._state, self._run, self._backend = model, state, run, backend
        self.count = 0

    def isolate(self, live: list[str]) -> list[str]:
        """The regions of ``live`` the model fails with, all else nested: ``[]`` when the
        model fails with every one of them inline too (then all are nested again). Leaves
        the regions found inline and the others nested."""
        self._set(live, nested=False)
        if not self._passes():
            self._set(live, nested=True)
            return []
        culprits: list[str] = []
        self._search(live, culprits, known_bad=True)
        return culprits

    def fixed_by_cloning(self, name: str) -> bool:
        """Whether ``name`` (inline now) compiles as a reusable subgraph with its outputs
        cloned; if so it is left that way, else inline."""
        if self._state.applied.fixes.get(name) == _CLONE:
            return False
        unmark_region(self._model, self._state, name)
        apply_region_class(self._model, self._state, name, clone_aliases=True)
        if self._passes():
            return True
        self._set([name], nested=False)
        return False

    def _search(self, group: list[str], culprits: list[str], *, known_bad: bool) -> None:
        # Invariant: the regions in `group` are inline, everything already decided is
        # as decided (culprits inline, the rest nested).
        if not known_bad:
            self._set(group, nested=True)
            if self._passes():
                return
            self._set(group, nested=False)
        if len(group) == 1:
            culprits.append(group[0])
            return
        half = len(group) // 2
        self._search(group[:half], culprits, known_bad=False)
        self._search(group[half:], culprits, known_bad=False)

    def _set(self, names: list[str], *, nested: bool) -> None:
        for name in names:
            unmark_region(self._model, self._state, name)
            if nested or self._state.applied.checkpoint:
                apply_region_class(
                    self._model,
                    self._state,
                    name,
                    nested=nested,
                    clone_aliases=self._state.applied.fixes.get(name) == _CLONE,
                )

    def _passes(self) -> bool:
        self.count += 1
        backend = self._backend
        backend.dry_run = True
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - a trial's outcome, not an error
            return any(isinstance(e, DryRunDone) for e in exception_chain(exc))
        finally:
            backend.dry_run = False
        return True  # nothing compiled (a cached graph ran): the trial cannot tell
