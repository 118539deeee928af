"""The aotdist version (one place: the package, the cache key and the bench read it)."""

__version__ = "0.1.0"
