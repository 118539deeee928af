"""The package's source files, as the structure tests read them (not a test module)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# callbacks/ installs as aotdist.callbacks
SOURCES = {"aotdist": ROOT / "aotdist", "aotdist.callbacks": ROOT / "callbacks"}


def package_modules() -> dict[str, Path]:
    """Module name -> file, for aotdist/ and callbacks/."""
    out = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out
