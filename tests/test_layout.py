"""The package's floor plan: every module imports only modules on its own floor or below, and no
import circle exists (imports read from the source with ``ast``, module level and inside functions
alike)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mtpctl"

#: floor of each part of the package, top first; a module may import its own part or a lower floor
FLOORS = {
    "__init__": 8, "__main__": 8,  # the package's face (mtpctl.load, imported on first use) and python -m
    "cli": 7, "api": 7,
    "train": 6, "export": 6, "bench": 6,
    "drafters": 5,
    "backends": 4,
    "decode": 3,
    "model": 2,
    "files": 1,
    "errors": 0, "version": 0,
}


def modules():
    """Module name -> the mtpctl modules it imports."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mtpctl"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("mtpctl"))
        out[name] = found
    known = set(out)
    return {name: {m for m in deps if m in known and m != name} for name, deps in out.items()}


def part(module: str) -> str:
    """``mtpctl.drafters.heads.eagle`` -> ``drafters``; ``mtpctl`` -> ``__init__``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def test_every_module_has_a_floor():
    assert {part(m) for m in modules()} <= set(FLOORS)


def test_no_import_points_up_or_sideways():
    wrong = []
    for module, deps in modules().items():
        for dep in deps:
            a, b = part(module), part(dep)
            if a != b and FLOORS[b] >= FLOORS[a]:
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def test_no_import_circle():
    graph = modules()
    state, stack, circles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                circles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert circles == []


def test_the_library_names_no_flag_of_the_cli():
    """Library errors name the setting (``option=``); the CLI turns it into its flag. A remedy that
    is another command to run (``mtpctl pair --out``, ``pip install --no-deps``) may carry its own."""
    flagged = []
    for path in PACKAGE.rglob("*.py"):
        if path.parts[-2] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                text = " ".join(c.value for c in ast.walk(node.exc) if isinstance(c, ast.Constant)
                                and isinstance(c.value, str))
                if "mtpctl " in text or "pip install" in text:
                    continue
                flagged += [f"{path.relative_to(PACKAGE)}: {w}" for w in text.split() if w.startswith("--")]
    assert flagged == []
