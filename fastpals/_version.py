"""The package version, readable by any layer without importing the package's top (which imports them all)."""

__version__ = "0.1.0"
