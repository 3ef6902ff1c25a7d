"""Prompts the target writes itself (Magpie: Xu et al. 2024, "Magpie: Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing").

An instruction-tuned model given only its chat template's opening of a user turn (the *pre-query
template*: everything the template renders before a user message's text, a default system turn
included) writes a plausible user request, ending it with the template's end-of-turn token. Each of
``count`` requests is sampled with its own seed derived from the settings' seed, so the same settings
and target give the same prompts; they run together through the session's continuous batching.

The requests are then screened (:func:`screen`): empty, unfinished (the token limit reached before
the turn ended), too short, degenerate (one word 3-gram repeated over and over, or few distinct
words), exact duplicates after normalisation and near-duplicates (exact Jaccard similarity of word
3-gram shingles against every prompt kept before, through an inverted index of shingles; no MinHash)
are dropped, each counted under its reason (:class:`MagpieStats`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import GenerationRequest, Session
from mtpctl.errors import BadInput, MtpctlError
from mtpctl.files import write_file

#: stands for the user's text while the pre-query template is rendered (private-use characters no
#: template writes)
MARKER = "\ue000magpie-user-text\ue001"

#: the file of generated prompts (``{"prompt": ...}`` lines, readable as training data) in a head folder
PROMPTS_FILE = "magpie_prompts.jsonl"

#: the file that keeps the generated prompts with their settings and counts in a features cache folder
CACHE_FILE = "magpie.json"
#: the requests drawn so far by an unfinished run, in the same folder (:class:`DrawLog`)
DRAW_LOG_FILE = "magpie-draws.jsonl"
CACHE_VERSION = 1


@dataclass
class MagpieSettings:
    """How the target writes its own training prompts (a recipe's ``magpie:`` mapping).

    Attributes:
        count: requests drawn (0: none); the screened-out ones are not replaced.
        seed: the seed every request's own seed derives from (same settings, same prompts).
        temperature: sampling temperature of the requests.
        top_p: nucleus sampling mass (1 = off).
        max_prompt_tokens: a request not ended within this many tokens is dropped as unfinished.
        openings: topic seeds: each request i starts with ``openings[i % len(openings)]`` (its opening
            words, e.g. ``"Write a Python function that"``) and the target writes the rest; empty: the
            target writes the whole request from the bare pre-query template.
        batch: requests decoded together (continuous batching).
    """

    count: int = 0
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 0.98
    max_prompt_tokens: int = 96
    openings: List[str] = field(default_factory=list)
    batch: int = 32

    @classmethod
    def from_value(cls, value) -> Optional["MagpieSettings"]:
        """A recipe's ``magpie`` value (a mapping, settings, or None) as settings (None stays None).

        Raises:
            BadInput: not a mapping, or a key that is not a setting.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise BadInput(f"magpie settings are a mapping of {', '.join(f.name for f in fields(cls))}, "
                           f"got {type(value).__name__}", option="magpie")
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise BadInput(f"unknown magpie setting(s) {sorted(unknown)} (known: "
                           f"{', '.join(f.name for f in fields(cls))})", option="magpie")
        return cls(**value)

    def check(self) -> None:
        """Raise BadInput on a setting that cannot work."""
        whole = {n: getattr(self, n) for n in ("count", "seed", "max_prompt_tokens", "batch")}
        if any(isinstance(v, bool) or not isinstance(v, int) for v in whole.values()):
            raise BadInput(f"magpie count, seed, max_prompt_tokens and batch are whole numbers, got {whole}",
                           option="magpie")
        if self.count < 0 or self.max_prompt_tokens < 1 or self.batch < 1:
            raise BadInput(f"magpie count must be >= 0, max_prompt_tokens and batch at least 1, got {whole}",
                           option="magpie")
        numbers = (self.temperature, self.top_p)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers) \
                or not 0 <= self.temperature < float("inf") or not 0 < self.top_p <= 1:
            raise BadInput(f"magpie temperature must be >= 0 and top_p in (0, 1], got {self.temperature!r} and "
                           f"{self.top_p!r}", option="magpie")
        if not isinstance(self.openings, list) or not all(isinstance(o, str) and o.strip() for o in self.openings):
            raise BadInput("magpie openings must be a list of non-empty strings", option="magpie")

    def sampling(self, index: int) -> SamplingParams:
        """Request ``index``'s sampling settings, with its own seed (:func:`request_seed`)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, seed=request_seed(self.seed, index))

    def opening(self, index: int) -> str:
        """The opening words request ``index`` starts with ("" without openings)."""
        return self.openings[index % len(self.openings)] if self.openings else ""


def request_seed(seed: int, index: int) -> int:
    """A 63-bit seed of request ``index`` drawn with ``seed``: a hash of both, so neighbouring seeds
    or indices share no stream."""
    digest = hashlib.sha256(f"mtpctl-magpie:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class PreQuery:
    """The chat template's opening of a user turn: its text, ids, and the end-of-turn token that
    closes a user message (None when the template has no control token after the message)."""

    text: str
    ids: List[int]
    end_of_turn: Optional[int]


def pre_query_template(codec) -> PreQuery:
    """The pre-query template of ``codec``'s chat template (a
    :class:`~mtpctl.model.tokenizer.TextCodec`): a conversation of one user message is rendered with
    :data:`MARKER` as its text and cut where the marker stands; the first control token after the
    marker is the end of the user's turn.

    Raises:
        BadInput: the model has no chat template, or its template does not show the message's text once.
    """
    if not codec.has_chat_template:
        raise BadInput("the model has no chat template, so it has no user turn to open: Magpie prompts need an "
                       "instruction-tuned model with one", option="magpie")
    from jinja2 import TemplateError

    try:
        rendered = codec.tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False,
                                                       add_generation_prompt=False)
    except (TemplateError, ValueError, TypeError) as err:
        raise BadInput(f"the chat template cannot render a lone user message ({err})", option="magpie") from err
    if rendered.count(MARKER) != 1:
        raise BadInput("the chat template does not render a user message's text once, so its opening of a user "
                       "turn cannot be found", option="magpie")
    before, after = rendered.split(MARKER)
    ids = [int(i) for i in codec.tokenizer(before, add_special_tokens=False)["input_ids"]]
    if not ids:
        raise BadInput("the chat template renders nothing before a user message's text", option="magpie")
    return PreQuery(before, ids, _first_control_token(codec.tokenizer, after))


def _first_control_token(tokenizer, text: str) -> Optional[int]:
    """The id of the first added (control) token in ``text``, or None."""
    added = tokenizer.get_added_vocab()
    if not added:
        return None
    pattern = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
    found = pattern.search(text)
    return int(added[found.group()]) if found else None


@dataclass
class Draw:
    """One request the target wrote: its text and whether its turn ended within the token limit."""

    text: str
    ended: bool


def draw_requests(session: Session, settings: MagpieSettings,
                  on_done: Optional[Callable[[int], None]] = None, done: Optional[Dict[int, Draw]] = None,
                  on_draw: Optional[Callable[[int, Draw], None]] = None) -> List[Draw]:
    """Sample ``settings.count`` user requests from the target in ``session`` (see the module
    docstring), in order; ``on_done(index)`` is called as each finishes and ``on_draw(index, draw)``
    with what it wrote. Requests in ``done`` (index -> draw, from an interrupted run with the same
    settings: each request has its own seed, so a draw does not depend on which others ran with it)
    are not drawn again.

    Raises:
        BadInput: bad settings, no chat template (:func:`pre_query_template`).
        MtpctlError: a request that failed (a NaN in the target's logits, ...).
    """
    settings.check()
    pre = pre_query_template(session.codec)
    draws: Dict[int, Draw] = {i: d for i, d in (done or {}).items() if 0 <= i < settings.count}
    todo = [i for i in range(settings.count) if i not in draws]
    openings = {i: _opening_ids(session.codec, settings.opening(i)) for i in todo}
    requests = [GenerationRequest(pre.ids + openings[i], settings.max_prompt_tokens, settings.sampling(i))
                for i in todo]

    def finished(j: int, outcome) -> None:
        i = todo[j]
        if not isinstance(outcome, MtpctlError):
            draws[i] = _draw(session.codec, openings[i], outcome.token_ids, outcome.finish_reason, pre.end_of_turn)
            if on_draw:
                on_draw(i, draws[i])
        if on_done:
            on_done(i)

    outcomes = session.generate_batch(requests, max_batch=settings.batch, on_done=finished) if todo else []
    for outcome in outcomes:
        if isinstance(outcome, MtpctlError):
            raise outcome
    return [draws[i] for i in range(settings.count)]


def _opening_ids(codec, opening: str) -> List[int]:
    """Ids of a request's opening words (as text: no control token)."""
    if not opening:
        return []
    return [int(i) for i in codec.tokenizer(opening, add_special_tokens=False, split_special_tokens=True)["input_ids"]]


def _draw(codec, opening: List[int], tokens: Sequence[int], finish_reason: str, end_of_turn: Optional[int]) -> Draw:
    """A request's text (opening and generated words, cut at the end of the turn) and whether it ended."""
    tokens = list(tokens)
    ended = finish_reason == "eos"
    stops = set(codec.eos_ids) | ({end_of_turn} if end_of_turn is not None else set())
    cut = next((j for j, t in enumerate(tokens) if t in stops), None)
    if cut is not None:
        tokens, ended = tokens[:cut], True
    return Draw(codec.decode(opening + tokens).strip(), ended)


@dataclass(frozen=True)
class PromptFilter:
    """The thresholds of :func:`screen`.

    Attributes:
        min_words: fewer words is too short.
        max_ngram_repeats: a word 3-gram seen more often than this makes a prompt degenerate.
        min_distinct: a prompt whose distinct words are a smaller share of its words is degenerate.
        near_duplicate: a Jaccard similarity of word 3-gram shingles at or above this, against a
            prompt kept before, is a near-duplicate.
    """

    min_words: int = 3
    max_ngram_repeats: int = 4
    min_distinct: float = 0.4
    near_duplicate: float = 0.7


#: the reasons a request is dropped, in the order they are tried
REASONS = ("empty", "unfinished", "too_short", "degenerate", "duplicate", "near_duplicate")


@dataclass
class MagpieStats:
    """How many requests were drawn, kept, and dropped for each reason (:data:`REASONS`)."""

    drawn: int = 0
    kept: int = 0
    empty: int = 0
    unfinished: int = 0
    too_short: int = 0
    degenerate: int = 0
    duplicate: int = 0
    near_duplicate: int = 0

    @classmethod
    def of(cls, verdicts: Sequence[Optional[str]]) -> "MagpieStats":
        """The counts of :func:`screen`'s verdicts."""
        counts = Counter(v for v in verdicts if v is not None)
        return cls(len(verdicts), sum(v is None for v in verdicts), **{r: counts[r] for r in REASONS})

    def line(self) -> str:
        """``drawn 32, kept 27; dropped: unfinished 3, near_duplicate 2`` (reasons with none left out)."""
        dropped = ", ".join(f"{r} {getattr(self, r)}" for r in REASONS if getattr(self, r))
        return f"drawn {self.drawn}, kept {self.kept}" + (f"; dropped: {dropped}" if dropped else "")


def words_of(text: str) -> List[str]:
    """The normalised words of ``text``: lowercased, punctuation removed, split on whitespace."""
    return re.sub(r"[^\w\s]", " ", text.lower()).split()


def shingles(words: Sequence[str], n: int = 3) -> Set[Tuple[str, ...]]:
    """The word ``n``-grams of ``words`` (the words themselves, as one, when fewer)."""
    if len(words) < n:
        return {tuple(words)}
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def is_degenerate(words: Sequence[str], rules: PromptFilter = PromptFilter()) -> bool:
    """Whether a word 3-gram repeats more than ``max_ngram_repeats`` times or the distinct words are
    fewer than ``min_distinct`` of all."""
    grams = Counter(tuple(words[i:i + 3]) for i in range(len(words) - 2))
    if grams and max(grams.values()) > rules.max_ngram_repeats:
        return True
    return len(set(words)) < rules.min_distinct * len(words)


def screen(draws: Sequence[Draw], rules: PromptFilter = PromptFilter()) -> List[Optional[str]]:
    """One verdict per draw, in order: None (kept) or the reason it is dropped (:data:`REASONS`,
    tried in that order). Duplicates are judged against the prompts kept before, so the first of
    several alike is kept."""
    verdicts: List[Optional[str]] = []
    seen: Set[str] = set()
    kept: List[Set[Tuple[str, ...]]] = []
    index: Dict[Tuple[str, ...], List[int]] = {}  # shingle -> kept prompts holding it
    for draw in draws:
        words = words_of(draw.text)
        verdict = _single_verdict(draw, words, rules)
        if verdict is None:
            verdict = _duplicate_verdict(words, seen, kept, index, rules)
        verdicts.append(verdict)
        if verdict is None:
            seen.add(" ".join(words))
            kept.append(shingles(words))
            for s in kept[-1]:
                index.setdefault(s, []).append(len(kept) - 1)
    return verdicts


def _single_verdict(draw: Draw, words: List[str], rules: PromptFilter) -> Optional[str]:
    """The reason a draw is dropped on its own (empty, unfinished, too short, degenerate), or None."""
    if not draw.text.strip():
        return "empty"
    if not draw.ended:
        return "unfinished"
    if len(words) < rules.min_words:
        return "too_short"
    if is_degenerate(words, rules):
        return "degenerate"
    return None


def _duplicate_verdict(words: List[str], seen: Set[str], kept: List[Set[Tuple[str, ...]]],
                       index: Dict[Tuple[str, ...], List[int]], rules: PromptFilter) -> Optional[str]:
    """``duplicate`` or ``near_duplicate`` against the prompts kept so far, or None."""
    if " ".join(words) in seen:
        return "duplicate"
    mine = shingles(words)
    for k in {k for s in mine for k in index.get(s, ())}:
        if len(mine & kept[k]) / len(mine | kept[k]) >= rules.near_duplicate:
            return "near_duplicate"
    return None


class DrawLog:
    """The requests drawn so far, one JSON line each (``{"index", "text", "ended"}``), appended and
    flushed as each finishes, so an interrupted run resumes without drawing them again; a last line cut
    short by the interruption is ignored when read."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def read(self) -> Dict[int, Draw]:
        """index -> draw of every complete line (none where there is no file)."""
        done: Dict[int, Draw] = {}
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return done
        if text and not text.endswith("\n"):  # the next line starts on its own
            with self.path.open("a", encoding="utf-8") as f:
                f.write("\n")
        lines = text.splitlines()
        for line in lines:
            try:
                raw = json.loads(line)
                done[int(raw["index"])] = Draw(str(raw["text"]), bool(raw["ended"]))
            except (ValueError, KeyError, TypeError):
                continue  # the line an interruption cut short
        return done

    def append(self, index: int, draw: Draw) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"index": index, "text": draw.text, "ended": draw.ended}, ensure_ascii=False) + "\n")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass
class MagpiePrompts:
    """The prompts kept, in draw order, the counts of the screening, and the pre-query template."""

    prompts: List[str]
    stats: MagpieStats
    pre_query: str

    def record(self) -> dict:
        """What a training record keeps of them beside their settings: the counts, the template and
        the head folder's file that holds them."""
        return {"stats": asdict(self.stats), "pre_query": self.pre_query, "file": PROMPTS_FILE}

    def save(self, path: Path, settings: MagpieSettings) -> None:
        """Write the prompts, their settings and counts to ``path`` (JSON, versioned, atomically)."""
        write_file(path, json.dumps({"version": CACHE_VERSION, "settings": asdict(settings), **self.record(),
                                     "prompts": self.prompts}, ensure_ascii=False))

    @classmethod
    def load(cls, path: Path) -> Optional["MagpiePrompts"]:
        """What :meth:`save` wrote to ``path``, or None where there is no such file of this version."""
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(raw, dict) or raw.get("version") != CACHE_VERSION:
            return None
        return cls(list(raw["prompts"]), MagpieStats(**raw["stats"]), raw["pre_query"])

    def write_jsonl(self, path: Path) -> None:
        """Write the prompts to ``path``, one ``{"prompt": ...}`` record a line (``add-heads`` data)."""
        write_file(path, "".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in self.prompts))


def magpie_prompts(session: Session, settings: MagpieSettings, rules: PromptFilter = PromptFilter(),
                   on_done: Optional[Callable[[int], None]] = None, done: Optional[Dict[int, Draw]] = None,
                   on_draw: Optional[Callable[[int, Draw], None]] = None) -> MagpiePrompts:
    """Draw ``settings.count`` requests from the target in ``session`` (:func:`draw_requests`, which
    takes ``done``, ``on_done`` and ``on_draw``) and keep the ones :func:`screen` passes.

    Raises:
        BadInput: bad settings, or a model without a chat template.
        MtpctlError: a request that failed.
    """
    draws = draw_requests(session, settings, on_done, done, on_draw)
    verdicts = screen(draws, rules)
    kept = [d.text for d, v in zip(draws, verdicts) if v is None]
    return MagpiePrompts(kept, MagpieStats.of(verdicts), pre_query_template(session.codec).text)
