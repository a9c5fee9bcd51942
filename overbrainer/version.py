"""overbrainer's version: one place, read by the package, the resolve step and job folders."""

__version__ = "0.1.0"
