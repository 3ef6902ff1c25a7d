"""Writing one benchmark's section of BENCHMARKS.md: the text between its begin and end markers is
replaced (or appended when the file has none), through a temporary file renamed into place."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, text: str, begin: str, end: str) -> None:
    """Put ``text`` (which starts with ``begin`` and ends with ``end``) into ``path`` in place of the
    old section between those markers."""
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    if begin in old and end in old:
        new = old[:old.index(begin)] + text + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(new, encoding="utf-8")
    tmp.replace(path)
