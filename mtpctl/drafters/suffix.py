"""Suffix decoding: drafts from the frequencies of what followed the context's suffix, in this
request and in every response this process has served.

SuffixDecoding (Oliaro, Jia, Campos and Qiao, 2024, arXiv 2411.04975; vLLM's ``method: "suffix"``,
Snowflake's ArcticInference) needs no draft model and no training. It keeps two suffix indexes
(:mod:`mtpctl.drafters.suffix_index`): a *local* one per request over its prompt and output, updated
as tokens are committed, and a *global* one over the responses of earlier requests, shared by every
request of the process (a batch, a benchmark's rounds, a library ``LLM`` across calls), bounded in
nodes (oldest responses evicted first) and optionally kept in a file between runs.

Each step, in each index, the longest suffix of the context that occurred before with a continuation
(up to ``max_depth - budget`` tokens, so that the index's depth leaves the draft room for a whole
budget below the match; found by binary search over its length: a pattern that occurs with a
continuation has every suffix occurring with one too) is the match. Its continuations are expanded
best-first by estimated probability (the product of count(child) / count(parent) along the path,
occurrences cut off by the end of the context not counted), down to ``min_prob``, to at most
``factor`` x the match length nodes and the drafter's budget. Of the two drafts, the one with the
higher expected number of accepted tokens (the sum of its nodes' probabilities) is proposed: the
index whose match predicts the continuation better wins, and the tree keeps that index's own
probabilities. The nodes come in best-first order, parents before children, so the first k nodes
of a draft are the draft of k nodes (what the auto policy's cuts assume). The draft is deterministic
(``q`` None), so greedy output is plain greedy's and sampling stays lossless.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
from dataclasses import asdict, dataclass
from itertools import count as counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from mtpctl.decode.attention import MAX_DRAFT_DEPTH
from mtpctl.decode.drafter import Drafter, TargetStep
from mtpctl.decode.tree import DraftTree
from mtpctl.drafters.merged import MergedDrafter
from mtpctl.drafters.suffix_index import GrowingIndex, SuffixIndex
from mtpctl.errors import BadInput
from mtpctl.files import write_file

CACHE_FORMAT = "mtpctl-suffix-cache"
CACHE_VERSION = 1


#: each setting's name where errors name it (the CLI's flag for it: --suffix-depth, ...)
OPTION_OF = {"max_depth": "suffix_depth", "min_prob": "suffix_min_prob", "factor": "suffix_factor",
             "nodes": "suffix_nodes", "max_nodes": "suffix_max_nodes", "min_match": "suffix_min_match",
             "prompt_tail": "suffix", "cache": "suffix_cache"}


@dataclass(frozen=True)
class SuffixSettings:
    """Settings of the suffix drafter.

    Attributes:
        max_depth: the longest pattern an index holds: match length + draft depth (64: the paper's and
            ArcticInference's maximum tree depth; vLLM defaults to 24).
        min_prob: the least estimated probability of a drafted token (0.1: the paper's and vLLM's
            ``suffix_decoding_min_token_prob``).
        factor: a draft holds at most ``factor`` x the match length tokens (1.0: vLLM's
            ``suffix_decoding_max_spec_factor``; the paper uses 1 to 4).
        nodes: the most draft tokens a step (the drafter's budget; mtpctl's default: on a CPU every
            verified row costs, and the auto policy cuts drafts that do not pay).
        max_nodes: the most nodes of the global index; the oldest responses are evicted beyond it
            (mtpctl's default: about 140 bytes a node and 1.3 nodes per token of text that does not
            repeat, so about 70 MB and 380,000 tokens; vLLM bounds requests instead, 10,000).
        min_match: the shortest match drafted from (1: the paper's, which drafts from any match; on
            SmolLM2's chat answers single-token matches of the local index were accepted 16% of the time,
            matches of 3 tokens about half the time).
        prompt_tail: the last prompt tokens stored before each response in the global index, so a
            response's opening is found from the end of its prompt (mtpctl's choice: the paper's
            global tree holds the responses alone).
        cache: a file the global index is loaded from at the start and written to at the end.
    """

    max_depth: int = 64
    min_prob: float = 0.1
    factor: float = 1.0
    nodes: int = 8
    max_nodes: int = 500_000
    min_match: int = 1
    prompt_tail: int = 16
    cache: Optional[str] = None

    def check(self) -> None:
        """Raises BadInput (naming the setting) for a value out of range."""
        if self.max_depth < 2:
            raise BadInput(f"the suffix index depth must be at least 2, got {self.max_depth}", option="suffix_depth")
        if not 0.0 <= self.min_prob <= 1.0:
            raise BadInput(f"the least token probability must be from 0 to 1, got {self.min_prob}",
                           option="suffix_min_prob")
        if not self.factor > 0:
            raise BadInput(f"the draft length factor must be above 0, got {self.factor}", option="suffix_factor")
        if not 1 <= self.nodes <= 64:
            raise BadInput(f"the suffix draft must hold 1 to 64 tokens, got {self.nodes}", option="suffix_nodes")
        if self.max_nodes < 1:
            raise BadInput(f"the global suffix index needs room for at least 1 node, got {self.max_nodes}",
                           option="suffix_max_nodes")
        if not 1 <= self.min_match < self.max_depth:
            raise BadInput(f"the shortest match must be from 1 to the index depth - 1 ({self.max_depth - 1}), got "
                           f"{self.min_match}", option="suffix_min_match")
        if self.prompt_tail < 0:
            raise BadInput(f"the prompt tail must be 0 or more tokens, got {self.prompt_tail}",
                           option=OPTION_OF["prompt_tail"])
        folder = Path(self.cache).resolve().parent if self.cache is not None else None
        if folder is not None and (Path(self.cache).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK)):
            raise BadInput(f"cannot keep the suffix cache in {self.cache}: it is a folder, or its folder does not "
                           "exist or cannot be written", option="suffix_cache")

    def options_set(self) -> List[str]:
        """The names of the settings (as errors name them) that differ from the defaults."""
        default = SuffixSettings()
        return [OPTION_OF[name] for name in OPTION_OF if getattr(self, name) != getattr(default, name)]

    def recorded(self) -> dict:
        """The settings a cache file records (the file itself aside)."""
        return {k: v for k, v in asdict(self).items() if k != "cache"}


def vocab_fingerprint(vocab: Dict[str, int]) -> str:
    """sha256 (hex) of a tokenizer's vocabulary (every token string and its id): token ids mean the
    same under two tokenizers with the same fingerprint."""
    digest = hashlib.sha256()
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


class SuffixCache:
    """The global suffix index: responses of completed requests, oldest evicted first beyond
    ``settings.max_nodes``; shared by a :class:`SuffixDrafter` and all its forks. ``fingerprint`` (the
    tokenizer's, :func:`vocab_fingerprint`) and ``vocab_size`` are what its file records and checks."""

    def __init__(self, settings: SuffixSettings, fingerprint: str = "", vocab_size: int = 0):
        self.settings, self.fingerprint, self.vocab_size = settings, fingerprint, vocab_size
        self.index = SuffixIndex(settings.max_depth)
        self.evicted = 0  # sequences evicted to keep within max_nodes

    def add(self, tokens: Sequence[int]) -> None:
        """Index one sequence, then evict the oldest ones while over the node bound (the new one too,
        when it alone exceeds it)."""
        if len(tokens):
            self.index.add(tokens)
        while self.index.nodes > self.settings.max_nodes and self.index.sequences:
            self.index.evict_oldest()
            self.evicted += 1

    def sequences(self) -> List[List[int]]:
        """The sequences held, oldest first."""
        return [self.index.sequence(seq).tolist() for seq in self.index.held()]

    def restore(self, sequences: Sequence[Sequence[int]]) -> None:
        """Replace the content by ``sequences`` (oldest first; evicted beyond the bound as they come)."""
        self.index = SuffixIndex(self.settings.max_depth)
        for tokens in sequences:
            self.add(tokens)

    def stats(self) -> dict:
        """What the global index holds and its memory (bytes, estimated), with its bound."""
        return {"sequences": self.index.sequences, "tokens": self.index.tokens, "nodes": self.index.nodes,
                "bytes": self.index.nbytes(), "max_nodes": self.settings.max_nodes, "evicted": self.evicted}

    def save(self, path: Path) -> None:
        """Write the sequences, the format version, the tokenizer's fingerprint and the settings to
        ``path`` atomically (safetensors: ``tokens`` int32, ``lengths`` int64).

        Raises:
            BadInput: the file cannot be written.
        """
        seqs = self.sequences()
        tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        metadata = {"format": CACHE_FORMAT, "version": str(CACHE_VERSION), "tokenizer": self.fingerprint,
                    "vocab_size": str(self.vocab_size), "settings": json.dumps(self.settings.recorded())}
        write_file(Path(path), safetensors_bytes({"tokens": tokens, "lengths": lengths}, metadata=metadata))

    def load(self, path: Path) -> None:
        """Replace the content by a cache file's sequences (made under any settings: indexed again
        under these).

        Raises:
            BadInput: an unreadable or corrupt file, another format or version, another tokenizer, or
                token ids outside the vocabulary; the file is left as it is.
        """
        self.restore(read_cache(Path(path), self.fingerprint, self.vocab_size))


def read_cache(path: Path, fingerprint: str, vocab_size: int) -> List[List[int]]:
    """The sequences of a suffix cache file, checked strictly (see :meth:`SuffixCache.load`)."""
    def bad(why: str) -> BadInput:
        return BadInput(f"suffix cache {path}: {why}; it is left as it is (remove it, or name another file)",
                        option="suffix_cache")

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (OSError, SafetensorError, ValueError) as err:
        raise bad(f"not a readable cache file ({err})") from err
    if metadata.get("format") != CACHE_FORMAT:
        raise bad("not a suffix cache file")
    if metadata.get("version") != str(CACHE_VERSION):
        raise bad(f"format version {metadata.get('version')}; this mtpctl reads version {CACHE_VERSION}")
    if metadata.get("tokenizer") != fingerprint:
        raise bad("made with another tokenizer (its vocabulary's fingerprint differs): its token ids mean other "
                  "text for this model")
    tokens, lengths = tensors.get("tokens"), tensors.get("lengths")
    if set(tensors) != {"tokens", "lengths"} or tokens.dim() != 1 or lengths.dim() != 1 \
            or tokens.dtype != torch.int32 or lengths.dtype != torch.int64:
        raise bad("its tensors are not 'tokens' (int32) and 'lengths' (int64)")
    if len(lengths) and (int(lengths.min()) < 1 or int(lengths.sum()) != len(tokens)):
        raise bad("its sequence lengths do not add up to its tokens")
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise bad(f"token ids outside this model's vocabulary (0..{vocab_size - 1})")
    return [part.tolist() for part in torch.split(tokens, lengths.tolist())] if len(lengths) else []


@dataclass
class _Draft:
    """One index's draft: its nodes (parent's index in the list or -1, token), best first, and its
    expected number of accepted tokens (the sum of their probabilities)."""

    nodes: List[Tuple[int, int]]
    score: float


class SuffixDrafter(Drafter):
    """Suffix decoding (see the module docstring): a draft tree from the request's own suffix index
    and the global one (``cache``), whichever expects more accepted tokens.

    ``fork()`` gives a request its own local index and shares ``cache``; ``finished(prompt, output)``
    (at the end of a request) adds its response to ``cache`` and drops the local index. A drafter used
    for one request after another without forks starts a new local index when a context does not
    extend the one it saw. ``budget``: ``settings.nodes``.
    """

    def __init__(self, settings: SuffixSettings, cache: Optional[SuffixCache] = None):
        settings.check()
        self.settings, self.budget = settings, settings.nodes
        self.cache = cache if cache is not None else SuffixCache(settings)
        self._local: Optional[GrowingIndex] = None
        self._seen: List[int] = []  # the context the local index holds

    def fork(self) -> "SuffixDrafter":
        """A drafter for another request: its own local index, the same global one."""
        return SuffixDrafter(self.settings, self.cache)

    def finished(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """A request ended: its response (after the last ``prompt_tail`` prompt tokens) joins the global
        index; the local index is dropped."""
        if len(output_ids):
            tail = list(prompt_ids)[-self.settings.prompt_tail:] if self.settings.prompt_tail else []
            self.cache.add(tail + list(output_ids))
        self._local, self._seen = None, []

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree:
        self._observe(context)
        tree = DraftTree(context[-1])
        if max_tokens <= 0:
            return tree
        drafts = [d for d in (self._draft(self._local, context), self._draft(self.cache.index, context)) if d]
        if drafts:
            best = max(drafts, key=lambda d: d.score)  # the first (local) on a tie
            made: List[int] = []
            for parent, token in best.nodes[:max_tokens]:
                made.append(tree.add(made[parent] if parent >= 0 else 0, token))
        return tree

    def _observe(self, context: Sequence[int]) -> None:
        """Bring the local index up to ``context``: the new tokens appended, or a new index when the
        context does not extend what it holds (another request)."""
        seen = len(self._seen)
        if self._local is None or len(context) < seen or list(context[:seen]) != self._seen:
            self._local, self._seen, seen = GrowingIndex(self.settings.max_depth), [], 0
        new = list(context[seen:])
        self._local.extend(new)
        self._seen.extend(new)

    def _draft(self, index, context: Sequence[int]) -> Optional[_Draft]:
        """The best-first draft from ``index`` (a :class:`GrowingIndex` or :class:`SuffixIndex`) after
        the longest match of ``context``'s suffix; None when nothing matches or nothing is likely."""
        # a match of L tokens leaves max_depth - L below it: the longest match the draft still fits under
        length, place = longest_match(index, context, max(1, self.settings.max_depth - self.budget))
        cap = min(self.budget, int(self.settings.factor * length))
        if place is None or cap < 1 or length < self.settings.min_match:
            return None
        nodes = best_first(index, place, cap, self.settings.min_prob)
        return _Draft([(parent, token) for parent, token, _ in nodes], sum(p for _, _, p in nodes)) if nodes else None


def longest_match(index, context: Sequence[int], most: int) -> Tuple[int, Optional[object]]:
    """``(length, place)`` of the longest suffix of ``context`` (at most ``most`` tokens) that ``index``
    holds with a continuation (``index.find``); ``(0, None)`` when none does. Binary search: a pattern
    found with a continuation has every suffix found with one."""
    lo, hi, found = 0, min(most, len(context)), None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        place = index.find(context[len(context) - mid:])
        if place is not None:
            lo, found = mid, place
        else:
            hi = mid - 1
    return lo, found


def best_first(index, place, cap: int, min_prob: float,
               max_depth: int = MAX_DRAFT_DEPTH) -> List[Tuple[int, int, float]]:
    """Up to ``cap`` nodes ``(parent, token, probability)`` below ``place`` in order of estimated path
    probability (ties: first found first), each node's parent before it (``parent`` its index in the
    list, -1: the root); a node below ``min_prob`` or deeper than ``max_depth`` is not drafted."""
    heap: list = []
    order = counter()

    def push(at, prob: float, parent: int, depth: int) -> None:
        mass = index.mass(at)
        if mass <= 0 or depth >= max_depth:
            return
        for token, count, below in index.continuations(at):
            p = prob * count / mass
            if p < min_prob:
                break  # continuations come most frequent first
            heapq.heappush(heap, (-p, next(order), token, below, parent, depth + 1))

    push(place, 1.0, -1, 0)
    nodes: List[Tuple[int, int, float]] = []
    while heap and len(nodes) < cap:
        neg, _, token, below, parent, depth = heapq.heappop(heap)
        nodes.append((parent, token, -neg))
        push(below, -neg, len(nodes) - 1, depth)
    return nodes


def suffix_drafter(settings: Optional[SuffixSettings], vocab: Dict[str, int], vocab_size: int) -> SuffixDrafter:
    """A suffix drafter with ``settings`` (None: the defaults) for a model whose tokenizer's vocabulary
    is ``vocab`` (token string -> id) and whose logits are ``vocab_size`` wide; its global index loaded
    from the settings' cache file where that file exists (a new one is written at the end).

    Raises:
        BadInput: settings out of range; a cache file that cannot be used (see :meth:`SuffixCache.load`).
    """
    settings = settings or SuffixSettings()
    settings.check()
    cache = SuffixCache(settings, vocab_fingerprint(vocab), vocab_size)
    if settings.cache is not None and Path(settings.cache).exists():
        cache.load(Path(settings.cache))
    return SuffixDrafter(settings, cache)


def index_stats(drafter) -> Optional[dict]:
    """The figures of the global index of the suffix drafter inside ``drafter`` (:meth:`SuffixCache.stats`),
    or None without one."""
    member = suffix_member(drafter)
    return None if member is None else member.cache.stats()


def stats_line(stats: dict) -> str:
    """One line of :func:`index_stats`' figures."""
    return (f"suffix index: {stats['sequences']} responses, {stats['tokens']} tokens, {stats['nodes']} nodes of at "
            f"most {stats['max_nodes']}, {stats['bytes'] / 2 ** 20:.1f} MiB, {stats['evicted']} responses evicted")


def suffix_member(drafter) -> Optional[SuffixDrafter]:
    """The suffix drafter inside ``drafter`` (alone or merged), or None."""
    if isinstance(drafter, SuffixDrafter):
        return drafter
    members = drafter.drafters if isinstance(drafter, MergedDrafter) else ()
    return next((m for m in map(suffix_member, members) if m is not None), None)


def save_cache(drafter) -> Optional[Path]:
    """Write the global index of the suffix drafter inside ``drafter`` to its settings' cache file,
    when it has one; the file written, or None.

    Raises:
        BadInput: the file cannot be written.
    """
    member = suffix_member(drafter)
    if member is None or member.settings.cache is None:
        return None
    member.cache.save(Path(member.settings.cache))
    return Path(member.settings.cache)
