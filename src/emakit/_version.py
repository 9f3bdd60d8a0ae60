"""The installed emakit version (its own module, so that any module can read it without
importing the package, which would make an import cycle)."""

__version__ = "0.1.0"
