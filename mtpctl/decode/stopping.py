"""Stop checks on every committed token, and incremental detokenization for streaming."""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence

EOS, STOP, LENGTH, CONTEXT = "eos", "stop", "length", "context"  # finish reasons


class StopChecker:
    """Receives committed tokens one by one and says when generation ends.

    Args:
        eos_ids: token ids that end generation (kept in ``tokens``, not in ``text``).
        stop_strings: strings that end generation; the text is cut before the first one.
        max_new_tokens: the most tokens to accept (>= 1).
        decode: token ids -> text (special tokens skipped).
    """

    def __init__(self, eos_ids: Iterable[int], stop_strings: Sequence[str], max_new_tokens: int,
                 decode: Callable[[List[int]], str]):
        self.eos_ids = set(eos_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.max_new_tokens = max_new_tokens
        self.decode = decode
        self.tokens: List[int] = []
        self.text = ""
        self.finish_reason: Optional[str] = None
        self._streamed = 0
        self._prefix = 0  # tokens[_prefix:_read]: the left context the next decode starts from
        self._read = 0  # tokens before _read are in text

    def push(self, token: int) -> bool:
        """Add one committed token; return True when generation must end (``finish_reason`` set)."""
        if self.finish_reason is not None:
            raise RuntimeError("push() after generation ended")
        self.tokens.append(token)
        # a stop string completed by this token ends inside the text it adds
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop_strings), default=1) + 1)
        self._extend_text()
        if token in self.eos_ids:
            self.finish_reason = EOS
        else:
            found = (self.text.find(s, search_from) for s in self.stop_strings)
            cut = min((i for i in found if i >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                self.finish_reason = STOP
            elif len(self.tokens) >= self.max_new_tokens:
                self.finish_reason = LENGTH
        return self.finish_reason is not None

    def _extend_text(self) -> None:
        """Incremental detokenization: decode only the last few tokens, with the tokens before them
        as left context (so word-boundary spaces come out as in a full decode), and append the new
        characters once they are complete: a trailing U+FFFD (a partial UTF-8 sequence) waits for up
        to 4 tokens, the longest a UTF-8 character can span; after that it is taken as it is."""
        before = self.decode(self.tokens[self._prefix:self._read])
        after = self.decode(self.tokens[self._prefix:])
        complete = not after.endswith("\ufffd") or len(self.tokens) - self._read >= 4
        if len(after) > len(before) and complete:
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)

    def end(self, reason: str) -> None:
        """End generation for a reason found outside (e.g. the context is full)."""
        if self.finish_reason is None:
            self.finish_reason = reason

    def stream(self) -> str:
        """Text not yet streamed that can no longer change: holds back a tail that may begin a
        stop string until generation ends."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= max((h for s in self.stop_strings for h in range(1, len(s))
                        if self.text.endswith(s[:h])), default=0)
        if end <= self._streamed:
            return ""
        delta, self._streamed = self.text[self._streamed:end], end
        return delta
