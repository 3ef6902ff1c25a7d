"""mtpctl: multi-token prediction heads and speculative decoding for LLMs.

``mtpctl.load(...)`` (:func:`mtpctl.api.load`) is the library's front door. The package is laid out
by role, dependencies pointing down: ``cli`` and ``api`` -> ``train``, ``export``, ``bench`` ->
``drafters`` -> ``backends`` -> ``decode`` -> ``model`` -> ``errors``, ``files``, ``version``
(docs/architecture.md; tests/test_layout.py holds the code to it).
"""

from mtpctl.version import __version__  # noqa: F401 (the package's face)


def __getattr__(name: str):
    """``mtpctl.load`` and ``mtpctl.LLM``, imported on first use (so ``mtpctl --help`` stays fast)."""
    if name in ("load", "LLM"):
        from mtpctl import api

        return getattr(api, name)
    raise AttributeError(f"module 'mtpctl' has no attribute {name!r}")
