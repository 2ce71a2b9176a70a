"""chunkmem's version, apart from the package's __init__ so that modules under it can report it."""

__version__ = "0.1.0"
