"""The CLI's one error path: a user mistake is one screen with the fix.

A usage mistake (an unknown model, a ``module:factory`` that does not import) exits 2; a
failed check, or the user's own code raising, exits 1 with the user's line named.
``--debug`` or ``AOTDIST_DEBUG=1`` lets errors propagate with their traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import traceback

DEBUG_ENV = "AOTDIST_DEBUG"  # set (not "0") to see tracebacks instead of one screen
_debug = False  # --debug or DEBUG_ENV: errors propagate as they are


def set_debug(flag: bool) -> None:
    """Turns the one-screen error path off (``True``) or on, for this command."""
    global _debug
    _debug = flag


def debugging() -> bool:
    """Whether errors propagate with their traceback."""
    return _debug


class UsageError(Exception):
    """A mistake in what the user asked for: exit 2, the message is the whole screen."""


class UserCodeError(Exception):
    """The user's own code (a ``module:factory``, the model it built) raised: exit 1."""

    def __init__(self, spec: str, exc: BaseException):
        super().__init__(spec)
        self.spec, self.exc = spec, exc


def import_factory(spec: str):
    """The function ``module:factory`` names, imported as ``python -m`` would: with the
    working directory on ``sys.path``.

    Raises:
        UsageError: The module does not import, or has no such attribute.
    """
    mod_name, _, attr = spec.partition(":")
    cwd = os.getcwd()
    if not any(os.path.abspath(p or ".") == cwd for p in sys.path):
        sys.path.insert(0, cwd)  # a console script does not put it there; python -m does
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if not (exc.name and (mod_name == exc.name or mod_name.startswith(exc.name + "."))):
            if _debug:
                raise
            raise UserCodeError(spec, exc) from exc  # the user's module imports a missing one
        raise UsageError(
            f"cannot import {mod_name!r} for {spec!r} (looked in {cwd} and sys.path). Fix: "
            f"run from the directory holding {mod_name.replace('.', '/')}.py, or add its "
            "directory to PYTHONPATH."
        ) from None
    except Exception as exc:  # noqa: BLE001 - the module's own top level raised
        if _debug:
            raise
        raise UserCodeError(spec, exc) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        from aotdist.config.validation import did_you_mean

        public = [n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise UsageError(
            f"{mod_name!r} ({getattr(module, '__file__', '?')}) has no function {attr!r}"
            f"{did_you_mean(attr, public)}. Fix: name a zero-argument function of it, "
            f"{mod_name}:FUNCTION."
        )
    return factory


@contextlib.contextmanager
def user_code(spec: str):
    """Within: an exception (not aotdist's own) is the user's code's, named as such."""
    from aotdist.errors import AOTDistError

    try:
        yield
    except (AOTDistError, UsageError, UserCodeError):
        raise
    except Exception as exc:  # noqa: BLE001 - reported as the user's error, one screen
        if _debug:
            raise
        raise UserCodeError(spec, exc) from exc


def _user_frame(exc: BaseException) -> str:
    """``file:line in function: code`` of the innermost frame outside aotdist, torch and
    the installed packages (the user's own line), or ``""``."""
    from aotdist.log import is_user_file

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    path = (
        os.path.relpath(f.filename)
        if os.path.abspath(f.filename).startswith(os.getcwd())
        else f.filename
    )
    return f"{path}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def screen(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one screen for an error that ended a command."""
    from aotdist.errors import AOTDistError, ConfigError, MissingDependencyError, first_line

    hint = f"(--debug or {DEBUG_ENV}=1 shows the traceback)"
    if isinstance(exc, UsageError):
        return 2, str(exc)
    if isinstance(exc, (ConfigError, MissingDependencyError)):
        return 2, str(exc)
    if isinstance(exc, UserCodeError):
        where = _user_frame(exc.exc)
        if not where:  # aotdist refused what the factory returned: the message has the fix
            return 1, f"{first_line(exc.exc, 600)} {hint}"
        return 1, "\n".join(
            [
                f"{exc.spec} raised {first_line(exc.exc, 600)}",
                f"  at {where}",
                f"Fix: make {exc.spec} build its model without error (try calling it in "
                f"Python first) {hint}",
            ]
        )
    if isinstance(exc, AOTDistError):
        return 1, str(exc)
    where = _user_frame(exc)
    return 1, "\n".join(
        [f"failed: {first_line(exc, 600)}"] + ([f"  at {where}"] if where else []) + [hint]
    )
