"""The package version (one place; the root package and the CLI read it)."""

__version__ = "0.1.0"
