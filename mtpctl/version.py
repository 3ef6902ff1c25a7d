"""The version of mtpctl (one place: the package, its metadata and every file it writes read it)."""

__version__ = "0.1.0"
