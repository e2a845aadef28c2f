"""The package version, alone in its module so that any module can read it without importing
the package (whose __init__ imports them back: a cycle)."""
__version__ = "0.1.0"   # keep equal to pyproject.toml's version
