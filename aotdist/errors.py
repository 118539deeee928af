"""Exception types raised by aotdist.

Every user error is an exception whose message says what is wrong, the observed
value, and how to fix it. Distributed failures name the rank.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = [
    "AOTDistError",
    "BenchError",
    "CacheWarning",
    "ConfigError",
    "ConfigWarning",
    "DistributedTestError",
    "DistributedTimeoutError",
    "MissingDependencyError",
    "OrderingError",
    "RegionCaptureError",
    "RegionCompileWarning",
    "RegionMismatchError",
    "TorchFeatureUnavailable",
    "exception_chain",
    "first_line",
    "shorten",
]


class AOTDistError(Exception):
    """Base class of every error aotdist raises on purpose."""


class ConfigError(AOTDistError, ValueError):
    """A configuration value, selection pattern or argument is invalid.

    The message lists every problem found, each with the key and the fix.

    Attributes:
        problems: The problems one by one (a config error may list several).
    """

    def __init__(self, message: str, *, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems) if problems is not None else [message]


class ConfigWarning(UserWarning):
    """A configuration option would have no effect; the message says which and why."""


class OrderingError(AOTDistError, RuntimeError):
    """Transformations were applied in an order aotdist cannot build on.

    For example a model already wrapped by ``torch.compile`` handed to
    ``compile_regions``, or regions compiled twice.
    """


class RegionCompileWarning(UserWarning):
    """A region could not be compiled as one reusable subgraph and was handled another way.

    The message names the region and the reason, and says what aotdist did instead.
    """


class RegionCaptureError(AOTDistError, RuntimeError):
    """The compile backend failed on a region's ``invoke_subgraph``.

    Raised by aotdist's recording backend with the names of the failing regions, so that
    the compiled model can fix or demote exactly those regions. Users see it only when
    the failure cannot be handled.

    Attributes:
        regions: Names of the regions whose subgraphs the backend rejected.
        reason: The backend's own explanation, first line.
    """

    def __init__(self, regions: list[str], reason: str):
        super().__init__(f"regions {regions} failed to compile: {reason}")
        self.regions = list(regions)
        self.reason = reason


class RegionMismatchError(AOTDistError, RuntimeError):
    """The first-step check (``compile.verify``) found the compiled step off eager's.

    Attributes:
        regions: The regions the difference comes with (found by running them inline);
            empty when it remains with every region inline (whole-model compile's own).
        comparison: The compiled step's outputs and gradients against eager's
            (``aotdist.compile.verify.Comparison``).
    """

    def __init__(self, comparison, regions: list[str], *, whole_model: bool = False):
        if whole_model:
            where = (
                "it remains with every region compiled inline, so it is the "
                "compiler's own (whole-model torch.compile computes the same). Fix: "
                "try another compile.backend (aot_eager) or torch version, and report "
                "it to PyTorch"
            )
        else:
            where = (
                f"it comes with region(s) {regions}: compiled inline they match eager. "
                f"Fix: exclude them (regions.exclude: {regions}, or find_regions("
                "exclude=[...])) and report it to aotdist"
            )
        super().__init__(
            f"aotdist's first-step check: the compiled training step differs from eager on "
            f"the same state ({comparison.describe()}); {where}. Training was stopped "
            "before any optimizer step. If your model draws random numbers outside "
            "nn.Dropout modules (F.dropout, a stochastic-depth function), set their rate to "
            "0 for the check, or turn compile.verify off."
        )
        self.regions = list(regions)
        self.comparison = comparison


class BenchError(AOTDistError, RuntimeError):
    """A benchmark measurement failed or timed out; the message has its output's tail."""


class CacheWarning(UserWarning):
    """A compile artifact bundle was not used (stale, corrupt, mismatched); the run compiles."""


class DistributedTestError(AOTDistError, RuntimeError):
    """A rank of :func:`run_distributed` failed: it raised, or exited without a result.

    Attributes:
        rank: The rank whose failure is reported (the first one seen), or ``None`` when
            the error is about several ranks at once (a timeout).
        exit_code: That rank's process exit code when it exited without a result or
            crashed while shutting down (negative: killed by that signal, as
            ``multiprocessing`` reports it); ``None`` when it raised or was stopped.
    """

    def __init__(self, message: str, rank: int | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code


class DistributedTimeoutError(DistributedTestError):
    """:func:`run_distributed` ran past its ``timeout``; every rank was killed.

    Attributes:
        ranks: The ranks that were still running when the time was up.
    """

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message, rank=ranks[0] if len(ranks) == 1 else None)
        self.ranks = list(ranks)


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and its causes/contexts, innermost last (at most 8)."""
    seen = 0
    while exc is not None and seen < 8:
        yield exc
        exc = exc.__cause__ or exc.__context__
        seen += 1


def first_line(exc: BaseException, limit: int = 300) -> str:
    """``"Type: first line of the message"`` (the type alone when there is no message), at
    most ``limit`` characters: a longer line is cut after a whole word and ends ``" ..."``."""
    lines = str(exc).strip().splitlines()
    return shorten(f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__, limit)


def shorten(text: str, limit: int) -> str:
    """``text``, or its first whole words (a list cut after a whole name) and ``" ..."``,
    at most ``limit`` characters."""
    if len(text) <= limit:
        return text
    head = text[: max(limit - 4, 0)]
    cut = max(head.rfind(", "), head.rfind(" "))
    if cut > len(head) // 2:  # a word boundary not too far back; else a hard cut
        head = head[:cut]
    return head.rstrip(" ,;:") + " ..."


class MissingDependencyError(AOTDistError, ImportError):
    """An optional dependency is not installed; the message names the extra to install.

    Attributes:
        extra: The ``aotdist[...]`` extra that installs it (``float8``, ``lightning``...).
    """

    def __init__(self, message: str, *, extra: str):
        super().__init__(message)
        self.extra = extra


class TorchFeatureUnavailable(AOTDistError, RuntimeError):
    """The running torch lacks an internal aotdist needs; the message names the torch
    versions aotdist was checked on and what to do."""
