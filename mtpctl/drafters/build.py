"""Drafters named by a spec, for the CLI, the library and the benchmarks alike.

A spec is ``none``, or one or more of ``heads``, ``mtp`` (the target checkpoint's own MTP layers,
:mod:`mtpctl.drafters.mtp`), ``draft`` (a draft model, or the target's own
layers: ``self``), ``suffix`` (suffix decoding), ``ngram``, ``retrieval`` and ``lookahead`` joined by
``+``: several are merged into one draft tree in that order (the heads' tree, the draft chain with the
heads' candidates grafted under it, the suffix tree, the prompt-lookup chain, the retrieval tree, the lookahead candidates and window). :class:`DraftOptions` holds the
settings; :func:`check` refuses missing settings and settings no drafter of a spec uses, before any
model loads;
:func:`load_parts` loads what the spec needs once (heads, datastore), so that several drafters of
one run share them; :func:`build` assembles the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from mtpctl.decode.attention import MAX_DRAFT_DEPTH
from mtpctl.decode.drafter import Drafter
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import Session
from mtpctl.drafters.heads.config import CONFIG_FILE, KINDS, WEIGHTS_FILE, HeadsConfig, check_heads_match
from mtpctl.drafters.heads.eagle import EagleDrafter
from mtpctl.drafters.heads.eagle3 import Eagle3Drafter, check_aux_layers
from mtpctl.drafters.heads.folder import load_heads
from mtpctl.drafters.heads.medusa import HydraDrafter, MedusaDrafter
from mtpctl.drafters.heads.tree import DEFAULT_TREE_NODES, StaticTree, tree_from_accuracy
from mtpctl.drafters.draft_model import DraftModelDrafter
from mtpctl.drafters.hybrid import HybridDrafter, grafts_heads
from mtpctl.drafters.lookahead import LookaheadDrafter, LookaheadSettings
from mtpctl.drafters.merged import MergedDrafter
from mtpctl.drafters.mtp import MtpSettings, mtp_drafter
from mtpctl.drafters.ngram import NgramDrafter
from mtpctl.drafters.retrieval import DATASTORE_FILE, Datastore, RetrievalDrafter
from mtpctl.drafters.self_draft import is_self, self_drafter
from mtpctl.drafters.suffix import SuffixSettings, suffix_drafter
from mtpctl.errors import BadInput, UnsupportedModel
from mtpctl.files import sha256_file

MERGEABLE = ("heads", "mtp", "draft", "suffix", "ngram", "retrieval", "lookahead")  # in merge order
SPECS = ("none",) + MERGEABLE
RETRIEVAL_NODES = 4  # default size of the retrieval tree


def parse(spec: str) -> Tuple[str, ...]:
    """``heads+ngram`` -> ``("heads", "ngram")`` in merge order; ``none`` -> ``()``.

    Raises:
        BadInput: an unknown name, a name twice, or ``none`` joined with others.
    """
    parts = tuple(p.strip() for p in spec.split("+"))
    if parts == ("none",):
        return ()
    unknown = [p for p in parts if p not in MERGEABLE]
    if unknown or len(set(parts)) != len(parts):
        raise BadInput(f"unknown drafter {spec!r}: use none, or one or more of {', '.join(MERGEABLE)} joined by '+' "
                       "(e.g. heads+ngram+retrieval, heads+draft, ngram+lookahead)", option="speculate")
    return tuple(p for p in MERGEABLE if p in parts)


@dataclass
class DraftOptions:
    """Settings of the drafters (each used by the drafters named in brackets)."""

    heads_dir: Optional[str] = None  # an MTP head folder made by add-heads [heads; retrieval: its datastore]
    tree_file: Optional[str] = None  # the heads' draft tree: YAML/JSON paths of top-k ranks [heads]
    tree_nodes: Optional[int] = None  # size of a tree grown from the heads' accuracy [heads]
    dynamic_tree: bool = False  # EAGLE-2's dynamic tree of that size instead of the static one [heads: eagle kinds]
    draft_len: Optional[int] = 3  # tokens of the prompt-lookup chain [ngram]; draft-model tokens, None = auto [draft]
    ngram_max: int = 3  # longest n-gram matched [ngram]
    ngram_min: int = 2  # shortest n-gram matched [ngram]
    datastore: Optional[str] = None  # retrieval datastore file (default: the head folder's) [retrieval]
    retrieval_nodes: Optional[int] = None  # nodes of the retrieval tree (None: RETRIEVAL_NODES) [retrieval]
    draft_model: Optional[str] = None  # the draft model: alias, folder, .gguf file, or self[:LAYERS] [draft]
    draft_map: Optional[str] = None  # an id map from mtpctl pair --out [draft]
    lookahead: Optional[LookaheadSettings] = None  # window, n-gram size, candidates (None: defaults) [lookahead]
    suffix: Optional[SuffixSettings] = None  # suffix decoding's settings and cache file (None: defaults) [suffix]
    mtp: Optional[MtpSettings] = None  # how the MTP layers run (None: the defaults, docs/heads.md) [mtp]


def check(parts: Sequence[str], opts: DraftOptions) -> None:
    """Refuse settings that none of the named drafters uses, and missing ones, before a model loads
    (``parts`` may be the union of several specs: a benchmark's methods).

    Raises:
        BadInput: see :func:`check_required`; heads settings without ``heads``, a head folder
            without ``heads`` or ``retrieval``, retrieval settings without ``retrieval``,
            draft-model settings or an automatic draft length without ``draft``.
    """
    parts = set(parts)
    check_required(parts, opts)
    values = vars(opts)
    if "draft" not in parts:
        for name in ("draft_model", "draft_map"):
            if values[name]:
                raise BadInput("this setting goes with the draft drafter only", option=name)
        if opts.draft_len is None:
            raise BadInput("an automatic draft length goes with the draft drafter only", option="draft_len")
    if opts.draft_map and is_self(opts.draft_model):
        raise BadInput("a self-draft shares the target's vocabulary: it takes no id map", option="draft_map")
    if opts.lookahead is not None and "lookahead" not in parts:
        raise BadInput("this setting goes with the lookahead drafter", option="lookahead")
    if opts.heads_dir and not parts & {"heads", "retrieval"}:
        raise BadInput("a head folder goes with the heads or retrieval drafters", option="heads_dir")
    for name in ("tree_file", "tree_nodes", "dynamic_tree"):
        if values[name] and "heads" not in parts:
            raise BadInput("this setting goes with the heads drafter", option=name)
    for name in ("datastore", "retrieval_nodes"):
        if values[name] and "retrieval" not in parts:
            raise BadInput("this setting goes with the retrieval drafter", option=name)
    if opts.mtp is not None and "mtp" not in parts:
        raise BadInput("this setting goes with the mtp drafter", option="mtp")
    if opts.suffix is not None and "suffix" not in parts:
        raise BadInput("this setting goes with the suffix drafter", option=(opts.suffix.options_set() or ["suffix"])[0])


def check_required(parts: Sequence[str], opts: DraftOptions) -> None:
    """Refuse a spec whose drafters lack a setting they need.

    Raises:
        BadInput: ``heads`` without a head folder, ``retrieval`` without a datastore or head folder,
            ``draft`` without a draft model, an automatic draft length for ``ngram``, or n-gram
            lengths out of order.
    """
    parts = set(parts)
    if opts.ngram_min > opts.ngram_max:
        raise BadInput(f"the shortest n-gram ({opts.ngram_min}) is longer than the longest ({opts.ngram_max})",
                       option="ngram_min")
    if "draft" in parts and not opts.draft_model:
        raise BadInput("the draft drafter needs a draft model (one checked with mtpctl pair TARGET MODEL, or self: "
                       "the target's own layers)",
                       option="draft_model")
    if "mtp" in parts and opts.draft_len is None:
        raise BadInput("MTP layers draft a fixed number of tokens a step, not an automatic one", option="draft_len")
    if "ngram" in parts and opts.draft_len is None:
        raise BadInput("the prompt-lookup chain needs a fixed draft length, not an automatic one", option="draft_len")
    if "heads" in parts and not opts.heads_dir:
        raise BadInput("the heads drafter needs a head folder (made by mtpctl add-heads)", option="heads_dir")
    if "retrieval" in parts and not (opts.datastore or opts.heads_dir):
        raise BadInput("the retrieval drafter needs a datastore file, or a head folder that carries one",
                       option="datastore")
    if "suffix" in parts and opts.suffix is not None:
        opts.suffix.check()


@dataclass
class LoadedHeads:
    """MTP heads ready to draft: their config and module, or ``module`` None for heads fused into
    an exported graph (their logits come with the graph's passes)."""

    cfg: HeadsConfig
    module: Optional[torch.nn.Module] = None


@dataclass
class Parts:
    """What a run's drafters share: the heads and the datastore (None where not needed)."""

    heads: Optional[LoadedHeads] = None
    store: Optional[Datastore] = None


def load_parts(session: Session, parts: Sequence[str], opts: DraftOptions) -> Parts:
    """Load the heads and the datastore that ``parts`` need, checked against the session's model.

    Raises:
        BadInput: see :func:`heads_for` and :meth:`Datastore.load`; a datastore of heads made for a
            model with another vocabulary size.
    """
    heads = heads_for(session, opts.heads_dir) if "heads" in parts else None
    store = None
    if "retrieval" in parts:
        if not opts.datastore and heads is None:  # the heads' datastore, the heads themselves unchecked
            cfg = HeadsConfig.load(opts.heads_dir)
            if cfg.vocab_size != session.vocab_size:
                raise BadInput(f"the heads in {opts.heads_dir} and their datastore were made for a model with "
                               f"vocabulary {cfg.vocab_size} ({cfg.target}); the target has {session.vocab_size}",
                               option="heads_dir")
        store = Datastore.load(datastore_path(opts), session.vocab_size)
    return Parts(heads, store)


def heads_for(session: Session, folder: Union[str, Path]) -> LoadedHeads:
    """The MTP heads in ``folder`` for ``session``'s target: loaded in its dtype and checked against
    its weights (torch), or checked to be the heads fused into the exported graph (``folder`` a head
    folder whose weights' sha256 the export recorded, or the export folder itself).

    Raises:
        BadInput: not a head folder, heads made for another model, an export without heads, or heads
            other than the ones fused into it.
        CorruptModel, UnsupportedModel: see :func:`mtpctl.drafters.heads.folder.load_heads`; heads no
            exported graph runs (hydra, eagle).
    """
    folder = Path(folder)
    if session.model is None:  # an exported graph: heads run inside it, if at all
        return _fused_heads(session, folder)
    model = session.model
    cfg = HeadsConfig.load(folder)
    check_heads_match(cfg, model.cfg.hidden_size, model.cfg.vocab_size, session.target_hash())
    if cfg.kind == "eagle3":
        try:
            check_aux_layers(cfg.layer.aux_layers, model.cfg.num_hidden_layers)
        except ValueError as err:
            raise BadInput(f"{folder}: {err}", option="heads_dir") from err
    native = model.device.type == "cpu" and session.kernels == "native"  # the heads' kernels follow the target's
    module = load_heads(folder, model.dtype, model.dense_lm_head(), blocked=native, target_kernel=model.lm_head)
    return LoadedHeads(cfg, module.to(model.device))


def _fused_heads(session: Session, folder: Path) -> LoadedHeads:
    own = folder.resolve() == session.folder.resolve()
    if not own and (folder / CONFIG_FILE).is_file():
        kind = HeadsConfig.load(folder).kind
        if kind != "medusa":
            raise UnsupportedModel(f"{folder} holds {kind} heads, which only the torch backend runs", option="backend")
    fused = session.fused_heads
    if fused is None:
        raise BadInput(f"{session.folder} was exported without MTP heads: re-export it with its heads "
                       "(mtpctl export MODEL --heads DIR --onnx OUT/)", option="heads_dir")
    if not own:
        if not (folder / CONFIG_FILE).is_file():
            raise BadInput(f"{folder} is not an MTP head folder (no {CONFIG_FILE})", option="heads_dir")
        try:
            same = sha256_file(folder / WEIGHTS_FILE) == fused.get("weights_sha256")
        except OSError:
            same = False
        if not same:
            raise BadInput(f"the heads in {folder} are not the ones fused into {session.folder}: re-export with "
                           "them, or name the export folder itself as the head folder", option="heads_dir")
    return LoadedHeads(HeadsConfig.load(session.folder))


def heads_drafter(session: Session, heads: LoadedHeads, tree: Optional[StaticTree] = None,
                  tree_nodes: Optional[int] = None, dynamic: bool = False) -> Drafter:
    """A drafter for ``heads`` over ``tree``; else a tree of ``tree_nodes`` grown from the heads'
    held-out accuracy; else the default size for the session's mode (:data:`DEFAULT_TREE_NODES`).
    ``dynamic``: EAGLE heads draft EAGLE-2's dynamic tree of that tree's size instead.

    Raises:
        BadInput: a tree deeper than the heads or than verification supports, a rank past the
            heads' candidates, a size < 1, or ``dynamic`` with heads other than EAGLE's.
    """
    cfg = heads.cfg
    if dynamic and (cfg.kind not in ("eagle", "eagle3") or heads.module is None):
        raise BadInput(f"a dynamic draft tree is drafted by EAGLE and EAGLE-3 heads run by torch, not by {cfg.kind} "
                       "heads" + (" fused into an exported graph" if heads.module is None else ""),
                       option="dynamic_tree")
    if tree is None:
        nodes = tree_nodes or DEFAULT_TREE_NODES[session.mode]
        tree = tree_from_accuracy(cfg.topk_accuracy, nodes) if cfg.topk_accuracy else \
            StaticTree.from_paths(cfg.tree or [[0]], cfg.num_heads)
    elif tree.depth > cfg.num_heads:
        raise BadInput(f"the draft tree is {tree.depth} deep; the heads predict {cfg.num_heads} tokens", option="tree_file")
    candidates = cfg.draft_vocab_size or cfg.vocab_size
    if tree.max_rank > candidates:
        raise BadInput(f"the draft tree asks for rank {tree.max_rank - 1}; the heads rank {candidates} candidates",
                       option="tree_file")
    if heads.module is None:  # fused into an exported graph, whose attention takes a tree of any depth
        return MedusaDrafter(tree)
    if tree.depth > MAX_DRAFT_DEPTH:
        raise BadInput(f"the draft tree is {tree.depth} deep; verification supports trees up to {MAX_DRAFT_DEPTH}",
                       option="tree_file")
    return _torch_heads_drafter(session.model, cfg.kind, heads.module, tree, dynamic)


def _torch_heads_drafter(model, kind: str, module: torch.nn.Module, tree: StaticTree, dynamic: bool = False) -> Drafter:
    """The drafter of heads of ``kind`` run beside the target ``model`` (a Decoder); ``dynamic``: the
    EAGLE kinds draft a dynamic tree.

    Raises:
        UnsupportedModel: a kind no drafter runs (:data:`~mtpctl.drafters.heads.config.KINDS`).
    """
    dtype = model.dtype
    if kind == "eagle":
        return EagleDrafter(module, tree, lambda ids: model.embed[ids].to(dtype), model.logits, dynamic)
    if kind == "eagle3":  # its aux_layers: the target's layers each pass must return to it
        return Eagle3Drafter(module, tree, lambda ids: model.embed[ids].to(dtype), dynamic)
    if kind == "hydra":
        return HydraDrafter(tree, module, model)
    if kind == "medusa":
        return MedusaDrafter(tree, module, model)
    raise UnsupportedModel(f"no drafter runs {kind!r} heads (known kinds: {', '.join(KINDS)})", option="heads_dir")


def datastore_path(opts: DraftOptions) -> Path:
    """The datastore file: the given one, else the head folder's :data:`DATASTORE_FILE`.

    Raises:
        BadInput: no such file.
    """
    path = Path(opts.datastore) if opts.datastore else Path(opts.heads_dir) / DATASTORE_FILE
    if not path.is_file():
        hint = "" if opts.datastore else (" (add-heads writes one into the head folder; exports and heads made by "
                                          "an older mtpctl carry none: name a datastore file)")
        raise BadInput(f"no retrieval datastore at {path}{hint}", option="datastore")
    return path


def read_tree(path: str, num_heads: int) -> StaticTree:
    """A draft tree file: YAML or JSON, a list of paths (``[[0], [1], [0, 0]]``) or ``{"tree": [...]}``.

    Raises:
        BadInput: unreadable, or not a list of paths (see :meth:`StaticTree.from_paths`).
    """
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise BadInput(f"cannot read tree file {path}: {err}", option="tree_file") from err
    paths = raw.get("tree") if isinstance(raw, dict) else raw
    if not isinstance(paths, list):
        raise BadInput(f"tree file {path}: expected a list of paths such as [[0], [1], [0, 0]]", option="tree_file")
    return StaticTree.from_paths(paths, num_heads)


def build(session: Session, spec: Union[str, Sequence[str]], opts: Optional[DraftOptions] = None,
          sampling: SamplingParams = SamplingParams(), parts: Optional[Parts] = None,
          progress: Optional[Callable[[str], None]] = None) -> Optional[Drafter]:
    """The drafter a spec names (None for ``none``): one drafter alone, or their merged tree (a draft
    model and Medusa heads as one :class:`~mtpctl.drafters.hybrid.HybridDrafter` member).

    Args:
        session: the target's session.
        spec: ``heads+ngram`` or its parsed parts (:func:`parse`).
        opts: the drafters' settings (defaults: :class:`DraftOptions`).
        sampling: the target's sampling settings (a draft model alone samples with them; inside a
            merge it drafts greedily).
        parts: heads and datastore loaded before (:func:`load_parts`), shared by several drafters;
            loaded here when None.
        progress: receives a line before a long preparation (the self-draft's layer search).

    Raises:
        BadInput, CorruptModel, UnsupportedModel: see :func:`check_required`, :func:`load_parts`,
            :func:`heads_drafter`, :func:`draft_drafter` and :func:`lookahead_drafter`.
    """
    names = parse(spec) if isinstance(spec, str) else parse("+".join(spec) or "none")
    opts = opts or DraftOptions()
    check_required(names, opts)
    if not names:
        return None
    parts = parts if parts is not None else load_parts(session, names, opts)
    alone = SamplingParams() if len(names) > 1 else sampling  # inside a merge a draft model drafts greedily
    members = [member_drafter(session, name, opts, alone, parts, progress) for name in names]
    if "heads" in names and "draft" in names and grafts_heads(members[0]):
        at = names.index("draft")
        members[0] = HybridDrafter(members[0], members.pop(at))
    return members[0] if len(members) == 1 else MergedDrafter(members)


def member_drafter(session: Session, name: str, opts: DraftOptions, sampling: SamplingParams, parts: Parts,
                   progress: Optional[Callable[[str], None]] = None) -> Drafter:
    """The drafter of one part of a spec (``name``, one of :data:`MERGEABLE`), see :func:`build`.

    Raises:
        BadInput: a name that is no drafter's; see :func:`build`.
    """
    if name == "heads":
        tree = read_tree(opts.tree_file, parts.heads.cfg.num_heads) if opts.tree_file else None
        return heads_drafter(session, parts.heads, tree, opts.tree_nodes, opts.dynamic_tree)
    if name == "mtp":
        return mtp_drafter(session, opts.draft_len, opts.mtp)
    if name == "draft":
        return draft_drafter(session, opts, sampling, progress)
    if name == "ngram":
        return NgramDrafter(opts.ngram_max, opts.ngram_min, opts.draft_len)
    if name == "lookahead":
        return lookahead_drafter(session, opts.lookahead)
    if name == "retrieval":
        return RetrievalDrafter(parts.store, budget=opts.retrieval_nodes or RETRIEVAL_NODES)
    if name == "suffix":
        return suffix_drafter(opts.suffix, session.codec.tokenizer.get_vocab(), session.vocab_size)
    raise BadInput(f"unknown drafter {name!r}: use one or more of {', '.join(MERGEABLE)}", option="speculate")


def draft_drafter(session: Session, opts: DraftOptions, sampling: SamplingParams,
                  progress: Optional[Callable[[str], None]] = None) -> DraftModelDrafter:
    """The draft model ``opts.draft_model`` names for the session's target: ``self[:LAYERS]``, the
    target's own layers (:func:`mtpctl.drafters.self_draft.self_drafter`), else a model paired with
    the target (:func:`mtpctl.drafters.pairing.session_drafter`).

    Raises:
        BadInput, ModelNotFound, CorruptModel, UnsupportedModel: see those two.
    """
    if is_self(opts.draft_model):
        return self_drafter(session, opts.draft_model, sampling, opts.draft_len, progress)
    from mtpctl.drafters.pairing import session_drafter

    return session_drafter(session, opts.draft_model, sampling, opts.draft_len,
                           Path(opts.draft_map) if opts.draft_map else None)


def lookahead_drafter(session: Session, settings=None) -> LookaheadDrafter:
    """Lookahead decoding with ``settings`` (:class:`LookaheadSettings`, ``(W, N, G)`` or ``"W,N,G"``;
    None: the defaults) for the session's target.

    Raises:
        BadInput: an exported backend (their graphs verify draft tree nodes only), or settings whose
            pass does not fit (:meth:`LookaheadSettings.check`).
    """
    if not session.extra_rows:
        raise BadInput(f"lookahead decoding runs on the torch backend, not {session.backend}", option="backend")
    model = getattr(session, "model", None)
    if getattr(getattr(model, "cfg", None), "deltanet", None) is not None:
        raise UnsupportedModel(f"lookahead decoding does not run on {model.cfg.model_type}: its Jacobi window's rows "
                               "are not a draft tree, which Gated DeltaNet layers verify", option="speculate")
    if isinstance(settings, str):
        settings = LookaheadSettings.parse(settings)
    elif isinstance(settings, (tuple, list)):
        settings = LookaheadSettings(*settings)
    settings = settings or LookaheadSettings()
    settings.check(session.context_length)
    return LookaheadDrafter(settings)


def draft_member(drafter: Optional[Drafter]) -> Optional[DraftModelDrafter]:
    """The draft model's drafter inside ``drafter`` (alone, merged or in a hybrid), or None."""
    if isinstance(drafter, DraftModelDrafter):
        return drafter
    if isinstance(drafter, HybridDrafter):
        return drafter.draft
    members = drafter.drafters if isinstance(drafter, MergedDrafter) else ()
    return next((found for found in map(draft_member, members) if found is not None), None)
