"""The package version, here so that any layer can read it without importing the package's top (which imports
every layer)."""

__version__ = "0.1.0"
