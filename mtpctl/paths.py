"""Where mtpctl keeps its caches (imported models, cached features, built kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def mtpctl_home() -> Path:
    """Cache root: ``$MTPCTL_HOME``, else ``$XDG_CACHE_HOME/mtpctl``, else ``~/.cache/mtpctl``."""
    if os.environ.get("MTPCTL_HOME"):
        return Path(os.environ["MTPCTL_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtpctl"
