"""Speculative decoding with a draft model: a smaller model of the same family (or any model, through
text) proposes a chain of draft tokens that the target verifies in one pass (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling").

The drafter owns its own :class:`~mtpctl.backends.torch.TorchEngine` and KV cache. The KV cache is
position-indexed, so the drafter keeps the ids its cache holds and, at each call, reuses the longest
common prefix of those and the new context: rejected draft tokens are rolled back by shortening the
committed length, and only the tokens after the common prefix are fed again. A hybrid draft (Qwen3.5,
Qwen3-Next: Gated DeltaNet layers, whose states cannot forget tokens) keeps those layers' states after
each commit of its last chain (:meth:`~mtpctl.backends.torch.TorchEngine.keep_history`, at most one per
draft token) and rolls back to the longest common prefix it kept a state for: the state is then bit for
bit the one it had there, and :attr:`DraftModelDrafter.draft_state_bytes` says what the kept states hold.

Three ways to talk to the target, chosen by ``mtpctl pair`` (:mod:`mtpctl.drafters.pairing`):

- ids (``identical`` vocabularies): the draft sees the target's ids; ``id_map`` only masks the
  padding rows past the real vocabulary, which are never proposed.
- mapped ids (``mapped``): ``id_map[d]`` is the target id of draft id d (-1: none, never proposed);
  the context goes through the inverse map (a target id the draft lacks stops drafting for that call).
- text (``incompatible``, cross-tokenizer): the context is decoded with the target's tokenizer and
  re-encoded with the draft's; the draft's tokens are decoded to text and re-encoded with the target's
  tokenizer (no special tokens added), then proposed as a deterministic chain (probs None).

Draft distributions: with ids, the draft samples with the target's sampling settings and reports q
``[k, target_vocab]`` (the target's real logits width), so rejection sampling uses the right
probabilities; greedy proposes the argmax chain with probs None. Text mode always drafts greedily and
reports probs None (a deterministic candidate: accept with p(x), else sample the residual, which keeps
the target's distribution whatever produced x).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Set, Union

import torch

from mtpctl.backends.torch import TorchEngine, verify_packed
from mtpctl.decode.drafter import Call, Drafter, TargetStep, check_finite
from mtpctl.decode.sampling import SamplingParams, greedy_token, probs_from_logits, sample
from mtpctl.decode.tree import DraftTree
from mtpctl.errors import NonFinite
from mtpctl.model.decoder import Decoder

#: ``--draft-len auto``: start, shortest and longest draft length.
AUTO_START, AUTO_MIN, AUTO_MAX = 3, 1, 8
#: Draft tokens kept before the new ones when decoding them to text (detokenization context).
TEXT_WINDOW = 8


@dataclass
class TextBridge:
    """Cross-tokenizer mode: target ids -> draft ids (prompt and output), draft ids -> text, text ->
    target ids, and the draft ids that end a draft (its EOS).

    ``prompt_to_draft`` gives the draft the prompt as its own tokenizer would have encoded it (its BOS
    rule applied); ``output_to_draft`` and ``target_encode`` add no special tokens.
    """

    prompt_to_draft: Callable[[List[int]], List[int]]
    output_to_draft: Callable[[List[int]], List[int]]
    draft_decode: Callable[[List[int]], str]
    target_encode: Callable[[str], List[int]]
    draft_stop_ids: Set[int] = field(default_factory=set)

    @classmethod
    def from_tokenizers(cls, target_tokenizer, draft_tokenizer, draft_stop_ids: Sequence[int] = ()) -> "TextBridge":
        """A bridge between two HF tokenizers.

        Target ids become text with the target's special tokens kept only where the draft's
        tokenizer has the same token (shared chat markers), others dropped; the target's own BOS (the
        ids its tokenizer puts before a text) is stripped from the prompt, and the draft's tokenizer
        adds its own when encoding the prompt. So the draft sees the prompt with BOS and special tokens
        handled the way its own tokenizer handles them.
        """
        draft_added = {str(t) for t in draft_tokenizer.get_added_vocab()}
        target_added = {int(i): str(t) for t, i in target_tokenizer.get_added_vocab().items()}
        dropped = {i for i, t in target_added.items() if t not in draft_added}
        prefix = _added_prefix(target_tokenizer)

        def target_text(ids: List[int]) -> str:
            return target_tokenizer.decode([i for i in ids if i not in dropped], skip_special_tokens=False)

        def prompt_to_draft(ids: List[int]) -> List[int]:
            if prefix and list(ids[:len(prefix)]) == prefix:
                ids = ids[len(prefix):]
            return [int(i) for i in draft_tokenizer(target_text(ids))["input_ids"]]

        def output_to_draft(ids: List[int]) -> List[int]:
            return [int(i) for i in draft_tokenizer.encode(target_text(ids), add_special_tokens=False)]

        return cls(prompt_to_draft, output_to_draft,
                   lambda ids: draft_tokenizer.decode(ids, skip_special_tokens=True),
                   lambda text: [int(i) for i in target_tokenizer.encode(text, add_special_tokens=False)],
                   {int(i) for i in draft_stop_ids})


def _added_prefix(tokenizer) -> List[int]:
    """The ids ``tokenizer`` puts before a text when it adds special tokens (its BOS), [] if none."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a")
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return [int(i) for i in full[:start]]
    return []


class DraftModelDrafter(Drafter):
    """A draft model proposing chains of draft tokens (implements
    :class:`~mtpctl.decode.drafter.Drafter`; its ``budget`` is the fixed draft length, or the
    longest auto one).

    Args:
        model: the draft decoder; its ``max_position_embeddings`` bounds what it can draft after
            (a longer context makes :meth:`propose` propose nothing: plain steps, no failure).
        target_vocab: the target's real logits width (lm_head rows); ``probs`` rows have this width.
        sampling: the target's sampling settings (the draft samples with the same ones); None: greedy.
        draft_len: draft tokens per call (upper-bounded by ``max_tokens``), or None for auto: start
            at :data:`AUTO_START`, +2 after a fully accepted proposal and -1 after a rejection, within
            ``[AUTO_MIN, max_draft_len]`` (the schedule of HF transformers' assisted generation).
        max_draft_len: the longest auto draft length.
        id_map: ``[draft_vocab]`` target id of each draft id, -1 where none (padding rows past the
            real vocabulary, draft-only added tokens): those are never proposed. None: the draft's ids
            are the target's (same width, no padding).
        text: cross-tokenizer mode (:class:`TextBridge`); excludes ``id_map``.
        allowed: ``[draft_vocab]`` bool, the draft ids that may be proposed in text mode (None: all).
        seed: seed of the drafter's own generator (sampled drafts); None draws one from the OS.
        pairing: the vocabulary verdict the drafter was built from (:class:`mtpctl.drafters.pairing.Pairing`),
            kept for reports.
        source: what :meth:`describe` reports where there is no pairing (a self-draft: folder,
            verdict, mode, layers).
        shared_weights: the draft's weights are the target's own (a self-draft): they add no memory.

    Raises:
        ValueError: ``id_map`` and ``text`` both given, an ``id_map`` of the wrong length or with
            ids outside the target vocabulary, or a draft length below 1.
    """

    def __init__(self, model: Decoder, target_vocab: int, sampling: Optional[SamplingParams] = None,
                 draft_len: Optional[int] = None, max_draft_len: int = AUTO_MAX,
                 id_map: Optional[Sequence[int]] = None, text: Optional[TextBridge] = None,
                 allowed: Optional[torch.Tensor] = None, seed: Optional[int] = None, pairing=None,
                 source: Optional[dict] = None, shared_weights: bool = False):
        if id_map is not None and text is not None:
            raise ValueError("an id map and cross-tokenizer text mode exclude each other")
        if (draft_len is not None and draft_len < 1) or max_draft_len < 1:
            raise ValueError(f"draft length must be at least 1, got {draft_len} (max {max_draft_len})")
        self.model = model
        self.pairing, self.source, self.shared_weights = pairing, source, shared_weights
        self.vocab = model.cfg.vocab_size  # the draft's logits width
        self.target_vocab = int(target_vocab)
        self.max_positions = model.cfg.max_position_embeddings
        self.sampling = sampling or SamplingParams()
        self.text = text
        self.fixed = draft_len
        self.max_draft_len = max(max_draft_len, draft_len or 1)
        self.k = draft_len or min(AUTO_START, self.max_draft_len)
        self.budget = draft_len or self.max_draft_len
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._blocked: Optional[torch.Tensor] = None  # [draft_vocab] True = never proposed
        self._src = self._dst = None  # draft ids and their target ids, for q in target space
        self._to_draft: Optional[torch.Tensor] = None  # [target_vocab] draft id of each target id, -1 none
        if id_map is not None:
            self._set_map(torch.as_tensor(list(id_map), dtype=torch.long))
        elif text is None and self.vocab != self.target_vocab:
            raise ValueError(f"the draft's logits width {self.vocab} differs from the target's "
                             f"{self.target_vocab}: give an id map (mtpctl pair)")
        if text is not None and allowed is not None:
            self._blocked = ~torch.as_tensor(allowed, dtype=torch.bool)
        self.engine: Optional[TorchEngine] = None
        self.cached: List[int] = []  # draft ids whose KV is committed in the draft's cache, in order
        self._last_len = 0  # context length at the last proposal
        self._last: List[int] = []  # the last proposal (target ids)
        self._prompt_key: tuple = ()  # text mode: the target prompt whose draft ids are cached
        self._prompt_draft: List[int] = []
        self.forward_passes = 0  # draft forward passes (prefills included), for statistics

    def _set_map(self, id_map: torch.Tensor) -> None:
        if id_map.shape != (self.vocab,):
            raise ValueError(f"the id map has {tuple(id_map.shape)} entries; the draft's logits width is {self.vocab}")
        if len(id_map) and (int(id_map.max()) >= self.target_vocab or int(id_map.min()) < -1):
            raise ValueError(f"the id map has target ids outside [-1, {self.target_vocab})")
        valid = id_map >= 0
        identity = bool(valid.all()) and self.vocab == self.target_vocab and torch.equal(id_map, torch.arange(self.vocab))
        if identity:
            return
        self._blocked = ~valid
        self._src = valid.nonzero().flatten()
        self._dst = id_map[self._src]
        self._to_draft = torch.full((self.target_vocab,), -1, dtype=torch.long)
        self._to_draft[self._dst] = self._src
        self._from_draft = id_map

    def _maps_on(self, device: torch.device) -> None:
        """The id map's tensors that index the draft's logits and distributions (blocked ids, draft ids and
        their target ids) where those are: moved once, for a draft model on a GPU."""
        if self._blocked.device != device:
            self._blocked, self._src, self._dst = (t.to(device) for t in (self._blocked, self._src, self._dst))

    def set_prompt(self, target_prompt: Sequence[int], draft_prompt: Sequence[int]) -> None:
        """Text mode: the draft's own ids for the target prompt ``target_prompt`` (e.g. the prompt
        through the draft's chat template), used while the context starts with that prompt. Without
        it the prompt is decoded and re-encoded like the output."""
        self._prompt_key, self._prompt_draft = tuple(target_prompt), list(draft_prompt)

    def describe(self) -> dict:
        """The draft as reports show it: ``folder``, ``verdict`` and ``mode`` (ids, mapped ids, text, or
        a self-draft's layers)."""
        if self.source is not None:
            return dict(self.source)
        if self.pairing is None:
            return {"folder": None, "verdict": None, "mode": "text" if self.text is not None else "ids"}
        return {"folder": str(self.pairing.draft.folder), "verdict": self.pairing.verdict, "mode": self.pairing.mode}

    @property
    def draft_state_bytes(self) -> int:
        """Memory of the Gated DeltaNet states a hybrid draft keeps to roll its last chain back (at most
        ``budget - 1`` commits' states of each such layer), bytes; 0 for other drafts."""
        return self.engine.history_bytes if self.engine is not None else 0

    @property
    def weight_bytes(self) -> int:
        """Memory of the draft's own weights, bytes (0 for a self-draft: they are the target's)."""
        return 0 if self.shared_weights else self.model.weight_bytes

    # -- the Drafter protocol ------------------------------------------------------------------
    @property
    def samples_drafts(self) -> bool:
        """True when it samples its chain from its own distribution (the target samples, in ids mode)."""
        return not self.sampling.greedy and self.text is None

    def fork(self) -> "DraftModelDrafter":
        """The same draft model, maps and settings with a KV cache, draft length and generator of its
        own (the generator seeded from this drafter's, so forks draw reproducibly); see
        :meth:`mtpctl.decode.drafter.Drafter.fork`."""
        twin = copy.copy(self)
        twin.engine, twin.cached, twin._last_len, twin._last = None, [], 0, []
        twin._prompt_key, twin._prompt_draft = (), []
        twin.k = self.fixed or min(AUTO_START, self.max_draft_len)
        twin.forward_passes = 0
        twin.generator = torch.Generator()
        twin.generator.manual_seed(int(torch.randint(2 ** 62, (), generator=self.generator)))
        return twin

    @property
    def family(self):
        """What forks share (see :func:`mtpctl.decode.drafter.family`): the draft model, whose passes
        :meth:`propose_forks` packs across requests."""
        return self.model

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree:
        """A chain of up to ``min(max_tokens, draft length)`` draft tokens (target ids) following
        ``context`` (prompt + committed output, the pending token last); its ``q`` ``[k,
        target_vocab]`` when sampling with ids, else None. The root alone when the context does not
        fit the draft's context window or holds a token the draft cannot represent.

        Raises:
            NonFinite: the draft's logits hold NaN or inf.
        """
        tree = self.propose_forks([self], [(context, max_tokens, last)])[0]
        if isinstance(tree, NonFinite):
            raise tree
        return tree

    @staticmethod
    def propose_forks(drafters: Sequence["DraftModelDrafter"], calls: Sequence[Call]) -> List[Union[DraftTree, NonFinite]]:
        """:meth:`propose` of each request's fork (``drafters[i]`` for ``calls[i]``) of one draft model,
        the forks' passes packed: each row's catch-up (the tokens its cache lacks) in one pass, then
        each draft step of every row still drafting in one pass (:func:`~mtpctl.backends.torch.verify_packed`)
        and one lm_head call. A row's tokens are those it drafts alone where the draft's kernels compute
        a row the same alone or in a pass (a session's models: blocked or int4 weights), and so are its
        generator's draws: a row whose logits hold NaN or inf gets that error in its place and stops
        drafting, the others go on. The same drafter twice (not forks) proposes once per call, one after
        another (its one cache cannot hold two rows)."""
        if len({id(d) for d in drafters}) < len(drafters):
            return [d.propose_forks([d], [call])[0] for d, call in zip(drafters, calls)]
        trees: List[Union[None, DraftTree, NonFinite]] = [None] * len(calls)
        rows = []  # (index, drafter, ctx, tail, k)
        for i, (d, (context, max_tokens, _)) in enumerate(zip(drafters, calls)):
            context = list(context)
            start = d._start(context, max_tokens)
            if start is None:
                trees[i] = DraftTree(context[-1])
            else:
                rows.append((i, d) + start)
        if rows:
            logits = _catch_up([(d, ctx, k) for _, d, ctx, _, k in rows])
            drafted = _draft_steps([(d, k) for _, d, _, _, k in rows], logits)
            for (i, d, _, tail, _), outcome in zip(rows, drafted):
                if isinstance(outcome, NonFinite):
                    trees[i] = outcome
                    continue
                tokens, q_rows = outcome
                proposal, probs = d._to_target(tokens, q_rows, tail, calls[i][1])
                d._last = proposal
                trees[i] = DraftTree.chain([calls[i][0][-1]] + proposal, probs)
        return trees

    def _start(self, context: List[int], max_tokens: int):
        """The draft's ids ``ctx`` for ``context``, the output part ``tail`` (text mode) and the tokens
        ``k`` to draft; None when it drafts nothing (no room, a context it cannot represent or that
        does not fit its window)."""
        self._observe(context)
        self._last_len, self._last = len(context), []
        k = min(max_tokens, self.k)
        if k <= 0:
            return None
        ctx, tail = self._draft_context(context)
        if ctx is None or not ctx:
            return None
        k = min(k, self.max_positions - len(ctx))  # positions left in the draft's context
        return (ctx, tail, k) if k > 0 else None

    def _choose(self, logits: torch.Tensor, q_rows: List[torch.Tensor]) -> Optional[int]:
        """The next draft id from ``logits`` ``[draft_vocab]`` (argmax, or a sample whose distribution
        is appended to ``q_rows``); None when it ends the draft (text mode: the draft's EOS)."""
        if self._blocked is not None:
            self._maps_on(logits.device)
            logits = logits.masked_fill(self._blocked, float("-inf"))
        if self.sampling.greedy or self.text is not None:
            token = greedy_token(logits)
        else:
            q = probs_from_logits(logits, self.sampling)  # [draft_vocab]
            token = sample(q, self.generator)
            q_rows.append(q)
        return None if self.text is not None and token in self.text.draft_stop_ids else token

    # -- draft length ----------------------------------------------------------------------------
    def _observe(self, context: List[int]) -> None:
        """Auto draft length: how much of the last proposal the new context starts with."""
        if self.fixed is not None or not self._last or len(context) <= self._last_len:
            return
        new = context[self._last_len:]
        accepted = next((i for i, (a, b) in enumerate(zip(new, self._last)) if a != b), min(len(new), len(self._last)))
        if accepted >= len(self._last):
            self.k = min(self.k + 2, self.max_draft_len)
        else:
            self.k = max(self.k - 1, AUTO_MIN)

    # -- context in the draft's ids --------------------------------------------------------------
    def _draft_context(self, context: List[int]):
        """The draft's ids for ``context`` (None when not representable) and, in text mode, the draft
        ids of the output part (detokenization context of the new draft tokens)."""
        if self.text is None:
            if self._to_draft is None:
                return context, None
            ids = self._to_draft[torch.tensor(context, dtype=torch.long)]
            return (None, None) if bool((ids < 0).any()) else (ids.tolist(), None)
        n = len(self._prompt_key)
        if not (n and len(context) > n and tuple(context[:n]) == self._prompt_key):
            n = len(context) - 1  # a new prompt: all but the pending token, re-encoded once
            self._prompt_key = tuple(context[:n])
            self._prompt_draft = self.text.prompt_to_draft(list(self._prompt_key))
        output = self.text.output_to_draft(context[n:])
        return self._prompt_draft + output, output

    # -- the draft's KV cache ----------------------------------------------------------------------
    def _resume(self, ctx: List[int], k: int) -> Optional[DraftTree]:
        """Make the cache ready to take ``ctx`` (a new engine when it is too small) and return the chain
        of the tokens it lacks, after the longest common prefix of the cache and ``ctx`` that the cache
        can roll back to (the last token is always fed again, for its logits; a hybrid draft returns only
        to a commit of its last chain, :meth:`TorchEngine.reachable`); None when the whole of ``ctx``
        needs a prefill."""
        need = len(ctx) + k
        if self.engine is None or need > self.engine.capacity:
            capacity = min(self.max_positions, max(2 * need, 256))
            self.engine, self.cached = TorchEngine(self.model, capacity), []
            self.engine.keep_history(self.budget - 1)  # a hybrid draft: the states of one chain's commits
        common = 0
        for a, b in zip(self.cached, ctx):
            if a != b:
                break
            common += 1
        common = self.engine.reachable(min(common, len(ctx) - 1))
        self.forward_passes += 1
        if common == 0:
            return None
        self.engine.rollback(common)  # the cache is position-indexed: slots past it are overwritten
        return DraftTree.chain(ctx[common:])

    # -- back to the target's ids ----------------------------------------------------------------
    def _to_target(self, tokens: List[int], rows: List[torch.Tensor], tail, max_tokens: int):
        if self.text is not None:
            return self._text_to_target(tokens, tail, max_tokens), None
        probs = None
        if rows:
            q = torch.stack(rows[:len(tokens)])  # [k, draft_vocab]
            if self._src is None:
                probs = q
            else:
                self._maps_on(q.device)
                probs = torch.zeros(len(tokens), self.target_vocab, dtype=q.dtype, device=q.device)
                probs[:, self._dst] = q[:, self._src]
        if self._src is not None:
            tokens = [int(self._from_draft[t]) for t in tokens]
        return tokens, probs

    def _text_to_target(self, tokens: List[int], tail: List[int], max_tokens: int) -> List[int]:
        """Draft ids -> text (decoded after a few earlier draft ids, so word boundaries and multi-byte
        characters come out right) -> target ids, no special tokens added."""
        if not tokens:
            return []
        window = tail[-TEXT_WINDOW:]
        before = self.text.draft_decode(window)
        full = self.text.draft_decode(window + tokens)
        if not full.startswith(before):
            return []
        new = full[len(before):].rstrip("\ufffd")  # an incomplete UTF-8 character at the end
        return self.text.target_encode(new)[:max_tokens] if new else []


def _catch_up(rows: Sequence[tuple]) -> List[torch.Tensor]:
    """Bring each ``(drafter, ctx, k)`` row's cache to its ``ctx``: prefills alone, the other rows'
    missing tokens in one packed pass; each row's logits ``[draft_vocab]`` after its last token."""
    hidden: List[Optional[torch.Tensor]] = [None] * len(rows)
    chains = []
    for j, (d, ctx, k) in enumerate(rows):
        chain = d._resume(ctx, k)
        if chain is None:
            hidden[j] = d.engine.prefill(ctx).hidden_states[-1]
            d.cached = list(ctx)
        else:
            chains.append((j, d, chain))
    if chains:
        outs = verify_packed([d.engine for _, d, _ in chains], [chain for _, _, chain in chains])
        for (j, d, chain), out in zip(chains, outs):
            d.engine.commit(range(len(chain)))
            d.cached = list(rows[j][1])
            hidden[j] = out.hidden_states[-1]
    return _logits(rows[0][0].model, hidden)


def _draft_steps(rows: Sequence[tuple], logits: List[Union[torch.Tensor, NonFinite]]) -> List[Union[tuple, NonFinite]]:
    """Draft up to ``k`` tokens for each ``(drafter, k)`` row from its ``logits`` after its context:
    each step's new tokens fed to every row that drafts on, in one packed pass (the last token's KV
    is not needed unless it is accepted). Returns each row's ``(draft ids, q rows)``, or the error of
    a row whose logits were not finite (it stops there)."""
    drafted: List[Union[tuple, NonFinite]] = [([], []) for _ in rows]
    live = list(range(len(rows)))
    while live:
        going = []
        for j in live:
            if isinstance(logits[j], NonFinite):
                drafted[j] = logits[j]
                continue
            d, k = rows[j]
            tokens, q_rows = drafted[j]
            token = d._choose(logits[j], q_rows)
            if token is not None:
                tokens.append(token)
                if len(tokens) < k:
                    going.append(j)
        live = going
        if not live:
            break
        engines = [rows[j][0].engine for j in live]
        outs = verify_packed(engines, [DraftTree(drafted[j][0][-1]) for j in live])
        for j, out in zip(live, outs):
            d = rows[j][0]
            d.engine.commit([0])
            d.cached.append(drafted[j][0][-1])
            d.forward_passes += 1
        step = _logits(rows[0][0].model, [out.hidden_states[-1] for out in outs])
        for j, row_logits in zip(live, step):
            logits[j] = row_logits
    return drafted


def _logits(model: Decoder, hidden: Sequence[torch.Tensor]) -> List[Union[torch.Tensor, NonFinite]]:
    """The draft's logits ``[draft_vocab]`` of each hidden state ``[hidden]``, in one lm_head call; a
    row that holds NaN or +inf gets that error instead (:func:`check_finite`)."""
    with torch.inference_mode():
        rows = list(model.logits(torch.stack(list(hidden))))
    out: List[Union[torch.Tensor, NonFinite]] = []
    for row in rows:
        try:
            out.append(check_finite(row, "the draft model"))
        except NonFinite as err:
            out.append(err)
    return out
