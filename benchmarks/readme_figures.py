"""README.md's "Current figures" table, generated from BENCHMARKS.md's methods and peers sections.

    .venv/bin/python benchmarks/readme_figures.py --benchmarks BENCHMARKS.md --write README.md

``make bench`` runs it after ``bench_all.py`` (``bench_all.py --readme README.md``): the README's
table sits between ``<!-- figures:start -->`` and ``<!-- figures:end -->`` and is replaced whole,
so the front door shows the figures of the last benchmark run, with the commit they came from.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

START, END = "<!-- figures:start -->", "<!-- figures:end -->"
MODES = (("float32", ()), ("bfloat16", ("--dtype bfloat16",)), ("int4 weights", ("--weights int4",)))
BEST = "heads+ngram"


def section(text: str, key: str) -> str:
    """The body of BENCHMARKS.md's section ``key`` ('' when it has none)."""
    match = re.search(rf"<!-- section:{key} -->\n(.*?)(?=<!-- section:|\Z)", text, re.S)
    return match.group(1) if match else ""


def tables(body: str) -> List[tuple]:
    """Each ``(command, rows)`` of a section: the backquoted command line and its table's rows by
    method name (each row its cells)."""
    out = []
    for match in re.finditer(r"^`([^`]+)`\n\n((?:\|.*\n?)+)", body, re.M):
        rows = {}
        for line in match.group(2).strip().splitlines()[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells
        out.append((match.group(1), rows))
    return out


def _mode_of(command: str) -> Optional[str]:
    """The numeric mode a bench command ran in, by its flags."""
    found = None
    for name, flags in MODES:
        if all(f in command for f in flags):
            found = name  # the last mode whose flags all appear: int4 implies bfloat16
    return found


def figures(text: str) -> str:
    """The README table from BENCHMARKS.md's text: per mode plain and heads+ngram tokens/s, the median
    speedup and tau from the methods section; HF transformers and llama.cpp from the peers section."""
    methods = {(_mode_of(cmd)): rows for cmd, rows in tables(section(text, "methods"))}
    peers: Dict[str, str] = {}
    for cmd, rows in tables(section(text, "peers")):
        mode, plain = _mode_of(cmd), rows.get("plain", ["", "?"])[1]
        for name, label in (("hf", "HF transformers"), ("llama.cpp", "llama.cpp, same GGUF")):
            if name in rows:
                peers[mode] = f"{label}: {rows[name][1]} (mtpctl plain {plain} in that run)"
    commit = re.search(r"at commit (\w+)", section(text, "methods"))
    lines = ["| mode | plain tokens/s | heads+ngram tokens/s | speedup | tau | peer, same prompts |",
             "|---|---:|---:|---:|---:|---|"]
    for name, _ in MODES:
        rows = methods.get(name, {})
        plain, best = rows.get("plain"), rows.get(BEST)
        if plain is None or best is None:
            continue
        speedup = best[2].split(" ")[0]
        lines.append(f"| {name} | {plain[1]} | {best[1]} | {speedup}x | {best[5]} | {peers.get(name, '')} |")
    where = f" (BENCHMARKS.md, measured at commit {commit.group(1)})" if commit else ""
    return "\n".join(lines) + f"\n\nSpeedup: the median over prompts of each prompt's speedup over plain in the same run{where}."


def replace_block(readme: str, table: str) -> str:
    """``readme`` with the text between the figures markers replaced by ``table``.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README has no {START} ... {END} block to fill")
    return readme[:start + len(START)] + "\n" + table + "\n" + readme[end:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--benchmarks", type=Path, default=Path("BENCHMARKS.md"))
    p.add_argument("--write", type=Path, default=None, help="the README to update (else the table goes to stdout)")
    args = p.parse_args(argv)
    table = figures(args.benchmarks.read_text(encoding="utf-8"))
    if args.write is None:
        print(table)
        return 0
    try:
        text = replace_block(args.write.read_text(encoding="utf-8"), table)
    except (OSError, ValueError) as err:
        print(f"readme_figures.py: error: {err}", file=sys.stderr)
        return 2
    tmp = args.write.with_name(f".{args.write.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
