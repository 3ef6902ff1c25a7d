"""Drafters named on the command line: ``mtpctl generate --speculate`` and ``mtpctl bench --methods``.

A spec is ``none``, ``draft`` (a draft model, built by :mod:`mtpctl.cli.pair`), or one or more of
``heads``, ``ngram`` and ``retrieval`` joined by ``+``: several are merged into one draft tree in that
order (the heads' tree, then the prompt-lookup chain, then the retrieval tree).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from mtpctl.errors import BadInput
from mtpctl.runtime.drafters import MergedDrafter, NgramDrafter
from mtpctl.runtime.heads import HeadsConfig, StaticTree
from mtpctl.runtime.retrieval import DATASTORE_FILE, Datastore, RetrievalDrafter

MERGEABLE = ("heads", "ngram", "retrieval")
RETRIEVAL_NODES = 4  # default size of the retrieval tree


def parse_drafters(spec: str) -> Tuple[str, ...]:
    """``heads+ngram`` -> ``("heads", "ngram")`` in merge order; ``none`` -> ``()``; ``draft`` -> ``("draft",)``.

    Raises:
        BadInput: an unknown name, a name twice, or ``draft``/``none`` joined with others.
    """
    parts = tuple(p.strip() for p in spec.split("+"))
    if parts in (("none",), ("draft",)):
        return () if parts == ("none",) else parts
    unknown = [p for p in parts if p not in MERGEABLE]
    if unknown or len(set(parts)) != len(parts):
        raise BadInput(f"unknown drafter {spec!r}: use none, draft, or one or more of "
                       f"{', '.join(MERGEABLE)} joined by '+' (e.g. heads+ngram+retrieval)")
    return tuple(p for p in MERGEABLE if p in parts)


@dataclass
class DraftOptions:
    """Command-line settings of the mergeable drafters."""

    heads_dir: Optional[str] = None  # --heads: MTP head folder (mtpctl add-heads)
    tree_file: Optional[str] = None  # --tree: the heads' draft tree (paths of top-k ranks)
    tree_nodes: Optional[int] = None  # --tree-nodes: size of a tree grown from the heads' accuracy
    draft_len: int = 3  # --draft-len: tokens of the prompt-lookup chain
    ngram_max: int = 3
    ngram_min: int = 2
    datastore: Optional[str] = None  # --datastore: retrieval datastore file (default: the heads folder's)
    retrieval_nodes: Optional[int] = None  # --retrieval-nodes: nodes of the retrieval tree (None: RETRIEVAL_NODES)


def check_options(parts: Tuple[str, ...], opts: DraftOptions, what: str = "--speculate") -> None:
    """Reject options that the named drafters do not use, and missing ones, before a model loads.

    Raises:
        BadInput: heads options without ``heads``, ``heads`` without ``--heads``, ``--heads`` without
            ``heads`` or ``retrieval`` (the heads' datastore), or ``--datastore`` without ``retrieval``.
    """
    def example(name: str) -> str:
        return f"--speculate {name}" if what == "--speculate" else f"--methods plain,{name}"

    if "heads" in parts and not opts.heads_dir:
        raise BadInput(f"{what} heads needs --heads DIR (a folder made by mtpctl add-heads)")
    if opts.heads_dir and "heads" not in parts and "retrieval" not in parts:
        raise BadInput(f"--heads goes with the heads or retrieval drafters (e.g. {example('heads')})")
    if "heads" not in parts and (opts.tree_file or opts.tree_nodes):
        raise BadInput(f"--tree and --tree-nodes go with the heads drafter (e.g. {example('heads')})")
    if "retrieval" not in parts and (opts.datastore or opts.retrieval_nodes):
        raise BadInput(f"--datastore and --retrieval-nodes go with the retrieval drafter (e.g. {example('retrieval')})")
    if "retrieval" in parts and not (opts.datastore or opts.heads_dir):
        raise BadInput("the retrieval drafter needs --datastore FILE, or --heads DIR of heads that carry one")


def datastore_path(opts: DraftOptions) -> Path:
    """The datastore file: ``--datastore``, else the head folder's :data:`DATASTORE_FILE`.

    Raises:
        BadInput: no such file (heads made before datastores were written carry none).
    """
    path = Path(opts.datastore) if opts.datastore else Path(opts.heads_dir) / DATASTORE_FILE
    if not path.is_file():
        hint = "" if opts.datastore else (" (add-heads writes one into the head folder; exports and heads made by "
                                          "an older mtpctl carry none: name one with --datastore FILE)")
        raise BadInput(f"no retrieval datastore at {path}{hint}")
    return path


def build_drafter(session, parts: Tuple[str, ...], opts: DraftOptions, heads=None, store=None):
    """``(drafter, draft_len)`` for mergeable ``parts``: one drafter alone, or their merged tree.

    ``heads`` (from ``session.load_heads``) and ``store`` (a :class:`Datastore`) may be passed in
    so that several drafters built for one run share them; ``draft_len`` is the most draft tokens
    a step verifies.
    """
    members = []
    for part in parts:
        if part == "heads":
            tree = read_tree(opts.tree_file, heads.cfg.num_heads) if opts.tree_file else None
            drafter = session.heads_drafter(heads, tree, opts.tree_nodes)
            members.append((drafter, len(drafter.tree.paths)))
        elif part == "ngram":
            members.append((NgramDrafter(opts.ngram_max, opts.ngram_min), opts.draft_len))
        else:
            members.append((RetrievalDrafter(store), opts.retrieval_nodes or RETRIEVAL_NODES))
    if len(members) == 1:
        return members[0]
    return MergedDrafter(members), sum(budget for _, budget in members)


def load_parts(session, parts: Tuple[str, ...], opts: DraftOptions):
    """``(heads, store)`` that ``parts`` need (None where not needed), checked against the model.

    Raises:
        BadInput: see :meth:`mtpctl.runtime.session.Session.load_heads` and :meth:`Datastore.load`;
            the datastore of heads made for a model with another vocabulary size.
    """
    heads = session.load_heads(opts.heads_dir) if "heads" in parts else None
    store = None
    if "retrieval" in parts:
        if not opts.datastore and heads is None:  # the heads' datastore, the heads themselves unchecked
            cfg = HeadsConfig.load(opts.heads_dir)
            if cfg.vocab_size != session.vocab_size:
                raise BadInput(f"the heads in {opts.heads_dir} and their datastore were made for a model with "
                               f"vocabulary {cfg.vocab_size} ({cfg.target}); the target has {session.vocab_size}")
        store = Datastore.load(datastore_path(opts), session.vocab_size)
    return heads, store


def read_tree(path: str, num_heads: int) -> StaticTree:
    """A draft tree file: YAML or JSON, a list of paths (``[[0], [1], [0, 0]]``) or ``{"tree": [...]}``."""
    import yaml

    try:
        raw = yaml.safe_load(open(path, encoding="utf-8").read())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise BadInput(f"cannot read tree file {path}: {err}") from err
    paths = raw.get("tree") if isinstance(raw, dict) else raw
    if not isinstance(paths, list):
        raise BadInput(f"tree file {path}: expected a list of paths such as [[0], [1], [0, 0]]")
    return StaticTree.from_paths(paths, num_heads)
