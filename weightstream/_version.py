"""The version of weightstream: the one place it is written (pyproject.toml reads it from here)."""

__version__ = "0.2.0"
