"""A depth-limited, path-compressed suffix trie over token sequences, with exact counts: the index
suffix decoding drafts from (:mod:`mtpctl.drafters.suffix`).

Every position ``i`` of a sequence ``s`` starts one *occurrence*, ``s[i : i + max_depth]`` (shorter at
the sequence's end). The trie holds every prefix of every occurrence as a path from the root; the
*count* of a place on a path is the number of occurrences that reach it. So the place of a pattern
counts how often the pattern occurs, and ``count(next place) / count(place)`` how often it went on
with that token: the frequencies SuffixDecoding (Oliaro et al. 2024) drafts by.

Structure (flat ``array('i')`` columns, no Python object per node):

- an edge holds a run of tokens, not one: a node is kept only where paths branch or occurrences
  end, so text that repeats costs no new nodes, and text that does not costs about one per position.
  Along one edge every place has the same count (an occurrence that ends inside an edge splits it).
- an edge's tokens are not copied: the node points into a sequence that holds them (``ref``: the
  newest occurrence through the node, updated as occurrences pass), and stores the edge's length.
- children: a doubly linked list per node; ``(node, first token) -> child`` is one dict keyed by
  ``node << 32 | token``.
- sequences leave oldest first (:meth:`SuffixIndex.evict_oldest`): each of its occurrences is walked
  from the root and taken out of every count on the way; a node left at 0 goes with everything
  under it, and a node left with one child of its own count merges with it. Since every node points
  at its newest occurrence, a node that outlives the oldest sequence never points into it. So the
  trie after adding and evicting sequences is the trie of the sequences still held, node for node,
  and evicting every sequence leaves the root alone.

A request's own prompt and output grow token by token (:class:`GrowingIndex`): an occurrence goes
into its trie once it has its ``max_depth`` tokens; the starts of the last ``max_depth - 1`` tokens are
read from the sequence directly when matching and drafting.
"""

from __future__ import annotations

import sys
from array import array
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = 0
_SHIFT = 32  # edge key: node << _SHIFT | first token

#: a place in the trie: (node, k), k tokens along the edge into ``node`` (1..its length; the root: 0)
Locus = Tuple[int, int]


def _checked(tokens: Sequence[int]) -> array:
    """``tokens`` as an int32 array.

    Raises:
        ValueError: a token id below 0 or of 2**31 or more.
    """
    try:
        held = array("i", tokens)
    except OverflowError as err:
        raise ValueError(f"token ids must be from 0 to 2**31 - 1 ({err})") from err
    if len(held) and min(held) < 0:
        raise ValueError("token ids must be from 0 to 2**31 - 1")
    return held


class SuffixIndex:
    """Counts of every pattern of up to ``max_depth`` tokens in the sequences held (see the module
    docstring): whole sequences go in with :meth:`add` and leave oldest first with :meth:`evict_oldest`.

    Raises:
        ValueError: ``max_depth`` below 2.
    """

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"a suffix index needs a depth of at least 2, got {max_depth}")
        self.max_depth = max_depth
        # per node: first token of its edge, parent, depth at its end, edge length, count, children list
        # (first child, next and previous sibling), the sequence and position its edge's tokens are read from
        self._token, self._parent, self._depth, self._length = (array("i", [-1]), array("i", [-1]), array("i", [0]),
                                                                array("i", [0]))
        self._count, self._first, self._next, self._prev = array("i", [0]), array("i", [-1]), array("i", [-1]), \
            array("i", [-1])
        self._ref_seq, self._ref_pos = array("i", [-1]), array("i", [0])
        self._edges: Dict[int, int] = {}
        self._free: List[int] = []
        self._seqs: Dict[int, array] = {}  # sequence id -> its tokens (insertion order: oldest first)
        self._next_id = 0
        self.tokens = 0  # tokens of every sequence held

    # ---- sizes

    @property
    def nodes(self) -> int:
        """Nodes in use, the root included."""
        return len(self._token) - len(self._free)

    @property
    def sequences(self) -> int:
        """Sequences held."""
        return len(self._seqs)

    def nbytes(self) -> int:
        """Memory held, bytes: the node columns (freed slots included), the edge dict with its keys
        and values, and the sequences' tokens; an estimate from CPython's object sizes."""
        columns = sum(a.buffer_info()[1] * a.itemsize for a in self._columns())
        edges = sys.getsizeof(self._edges) + len(self._edges) * (sys.getsizeof(1 << 40) + sys.getsizeof(1 << 20))
        seqs = sum(s.buffer_info()[1] * s.itemsize + sys.getsizeof(array("i")) for s in self._seqs.values())
        return columns + edges + seqs

    def _columns(self) -> Tuple[array, ...]:
        return (self._token, self._parent, self._depth, self._length, self._count, self._first, self._next,
                self._prev, self._ref_seq, self._ref_pos)

    # ---- reading

    def count(self, locus: Locus) -> int:
        """How many occurrences reach ``locus``."""
        return self._count[locus[0]]

    def depth(self, locus: Locus) -> int:
        """Tokens from the root to ``locus``."""
        node, k = locus
        return self._depth[node] - self._length[node] + k

    def children(self, node: int) -> Iterator[int]:
        """The nodes under ``node``, in no particular order."""
        child = self._first[node]
        while child != -1:
            yield child
            child = self._next[child]

    def _edge_token(self, node: int, k: int) -> int:
        """The k-th token (0-based) of the edge into ``node``."""
        return self._seqs[self._ref_seq[node]][self._ref_pos[node] + k]

    def step(self, locus: Locus, token: int) -> Optional[Locus]:
        """The place one ``token`` below ``locus``, or None when no occurrence goes on that way."""
        node, k = locus
        if k < self._length[node]:
            return (node, k + 1) if self._edge_token(node, k) == token else None
        child = self._edges.get(node << _SHIFT | token)
        return None if child is None else (child, 1)

    def locate(self, pattern: Sequence[int]) -> Optional[Locus]:
        """The place of ``pattern`` (None when it does not occur)."""
        locus: Optional[Locus] = (ROOT, 0)
        for token in pattern:
            locus = self.step(locus, token)
            if locus is None:
                return None
        return locus

    def find(self, pattern: Sequence[int]) -> Optional[Locus]:
        """The place of ``pattern`` when some occurrence goes on after it, else None."""
        locus = self.locate(pattern)
        if locus is None or (locus[1] == self._length[locus[0]] and self._first[locus[0]] == -1):
            return None
        return locus

    def mass(self, locus: Locus) -> int:
        """The denominator of the probabilities of ``locus``'s continuations: the occurrences reaching
        it (those whose sequence ends there included: a response that stopped)."""
        return self._count[locus[0]]

    def continuations(self, locus: Locus) -> List[Tuple[int, int, Locus]]:
        """``(token, count, place)`` of every way the occurrences through ``locus`` go on, most frequent
        first (then by token id)."""
        node, k = locus
        if k < self._length[node]:
            return [(self._edge_token(node, k), self._count[node], (node, k + 1))]
        found = [(self._token[c], self._count[c], (c, 1)) for c in self.children(node)]
        found.sort(key=lambda f: (-f[1], f[0]))
        return found

    def paths(self) -> Dict[Tuple[int, ...], int]:
        """Every pattern held -> its count: the index's content, whatever its shape (for tests)."""
        out: Dict[Tuple[int, ...], int] = {}
        stack: List[Tuple[Locus, Tuple[int, ...]]] = [((ROOT, 0), ())]
        while stack:
            locus, path = stack.pop()
            for token, count, below in self.continuations(locus):
                out[path + (token,)] = count
                stack.append((below, path + (token,)))
        return out

    # ---- writing

    def add(self, tokens: Sequence[int]) -> int:
        """Index a whole sequence (every occurrence); its id.

        Raises:
            ValueError: a token id below 0 or of 2**31 or more.
        """
        seq = self.open(tokens)
        for start in range(len(tokens)):
            self.insert(seq, start, min(self.max_depth, len(tokens) - start))
        return seq

    def open(self, tokens: Sequence[int] = ()) -> int:
        """Hold a sequence whose occurrences the caller inserts (:meth:`insert`); its id. It may grow
        (:meth:`append`) while the newest."""
        held = _checked(tokens)
        seq = self._next_id
        self._next_id += 1
        self._seqs[seq] = held
        self.tokens += len(held)
        return seq

    def append(self, seq: int, tokens: Sequence[int]) -> None:
        """More tokens of sequence ``seq`` (their occurrences are the caller's to insert)."""
        more = _checked(tokens)
        self._seqs[seq].extend(more)
        self.tokens += len(more)

    def held(self) -> List[int]:
        """The ids of the sequences held, oldest first."""
        return list(self._seqs)

    def sequence(self, seq: int) -> array:
        """The tokens of sequence ``seq``."""
        return self._seqs[seq]

    def insert(self, seq: int, start: int, length: int) -> None:
        """Count the occurrence of ``length`` tokens at ``start`` of sequence ``seq`` on its path,
        making the nodes it needs (a split where it leaves or ends inside an edge, a leaf for the rest)."""
        tokens = self._seqs[seq]
        node, pos, end = ROOT, start, start + length
        while pos < end:
            child = self._edges.get(node << _SHIFT | tokens[pos])
            if child is None:
                self._new_node(node, tokens[pos], end - pos, seq, pos)
                return
            shared = self._shared(child, tokens, pos, min(self._length[child], end - pos))
            if shared < self._length[child]:
                child = self._split(child, shared)
            self._count[child] += 1
            self._ref_seq[child], self._ref_pos[child] = seq, pos  # the newest occurrence through it
            pos += shared
            node = child

    def _shared(self, node: int, tokens: array, pos: int, most: int) -> int:
        """How many of the first ``most`` tokens of ``node``'s edge equal ``tokens[pos:]`` (the first
        always does)."""
        ref, at = self._seqs[self._ref_seq[node]], self._ref_pos[node]
        if tokens[pos:pos + most] == ref[at:at + most]:
            return most
        k = 1
        while tokens[pos + k] == ref[at + k]:
            k += 1
        return k

    def _split(self, node: int, k: int) -> int:
        """Cut the edge into ``node`` after its first ``k`` tokens: a new node holds them (same count,
        same reference), ``node`` keeps the rest below it; the new node."""
        parent, seq, pos = self._parent[node], self._ref_seq[node], self._ref_pos[node]
        upper = self._new_node(parent, self._token[node], k, seq, pos, count=self._count[node], link=False)
        self._replace_in_list(node, upper)
        self._edges[parent << _SHIFT | self._token[node]] = upper
        self._token[node] = self._seqs[seq][pos + k]
        self._length[node] -= k
        self._ref_pos[node] = pos + k
        self._parent[node] = upper
        self._link(upper, node)
        self._edges[upper << _SHIFT | self._token[node]] = node
        return upper

    def _new_node(self, parent: int, token: int, length: int, seq: int, pos: int, count: int = 1,
                  link: bool = True) -> int:
        """A node under ``parent`` whose edge holds ``length`` tokens of ``seq`` from ``pos`` (its first
        ``token``), reached by ``count`` occurrences; linked into ``parent``'s children unless ``link`` is
        False (the caller places it)."""
        values = (token, parent, self._depth[parent] + length, length, count, -1, -1, -1, seq, pos)
        if self._free:
            node = self._free.pop()
            for column, value in zip(self._columns(), values):
                column[node] = value
        else:
            node = len(self._token)
            for column, value in zip(self._columns(), values):
                column.append(value)
        if link:
            self._link(parent, node)
            self._edges[parent << _SHIFT | token] = node
        return node

    def _link(self, parent: int, node: int) -> None:
        """Put ``node`` first among ``parent``'s children."""
        first = self._first[parent]
        self._next[node], self._prev[node] = first, -1
        if first != -1:
            self._prev[first] = node
        self._first[parent] = node

    def _unlink(self, node: int) -> None:
        """Take ``node`` out of its parent's children."""
        prev, after = self._prev[node], self._next[node]
        if prev == -1:
            self._first[self._parent[node]] = after
        else:
            self._next[prev] = after
        if after != -1:
            self._prev[after] = prev

    def _replace_in_list(self, old: int, new: int) -> None:
        """``new`` takes ``old``'s place among its siblings."""
        prev, after = self._prev[old], self._next[old]
        self._prev[new], self._next[new] = prev, after
        if prev == -1:
            self._first[self._parent[old]] = new
        else:
            self._next[prev] = new
        if after != -1:
            self._prev[after] = new

    # ---- eviction

    @property
    def oldest(self) -> Optional[int]:
        """The id of the oldest sequence held, or None."""
        return next(iter(self._seqs), None)

    def evict_oldest(self) -> int:
        """Take the oldest sequence out: every count it added, exactly; its tokens.

        Raises:
            ValueError: nothing to evict.
        """
        seq = self.oldest
        if seq is None:
            raise ValueError("the suffix index holds no sequence")
        tokens = self._seqs[seq]
        for start in range(len(tokens)):
            self._uncount(tokens, start, min(self.max_depth, len(tokens) - start))
        del self._seqs[seq]
        self.tokens -= len(tokens)
        return len(tokens)

    def _uncount(self, tokens: array, start: int, length: int) -> None:
        """Take the occurrence of ``length`` tokens at ``start`` out of every count on its path, then
        merge the nodes on it left with one child of their own count."""
        node, pos, end, path = ROOT, start, start + length, []
        while pos < end:
            child = self._edges[node << _SHIFT | tokens[pos]]
            self._count[child] -= 1
            if self._count[child] == 0:  # only this occurrence reached it (and what is below it)
                self._free_subtree(child)
                break
            path.append(child)
            pos += self._length[child]
            node = child
        for node in reversed(path):
            self._merge_if_unary(node)

    def _merge_if_unary(self, node: int) -> None:
        """Merge ``node`` with its only child when every occurrence reaching it goes on into that child
        (its reference, the newest occurrence, reads the child's tokens too)."""
        child = self._first[node]
        if child == -1 or self._next[child] != -1 or self._count[child] != self._count[node]:
            return
        self._length[node] += self._length[child]
        self._depth[node] = self._depth[child]
        del self._edges[node << _SHIFT | self._token[child]]
        self._first[node] = self._first[child]
        for grandchild in self.children(child):
            del self._edges[child << _SHIFT | self._token[grandchild]]
            self._edges[node << _SHIFT | self._token[grandchild]] = grandchild
            self._parent[grandchild] = node
        self._release(child)

    def _free_subtree(self, top: int) -> None:
        """Free ``top`` and every node under it, ``top`` unlinked from its parent."""
        self._unlink(top)
        del self._edges[self._parent[top] << _SHIFT | self._token[top]]
        stack = list(self.children(top))
        self._release(top)
        while stack:
            node = stack.pop()
            stack.extend(self.children(node))
            del self._edges[self._parent[node] << _SHIFT | self._token[node]]
            self._release(node)

    def _release(self, node: int) -> None:
        """Return ``node``'s slot (its edges already gone)."""
        self._count[node], self._first[node], self._ref_seq[node] = 0, -1, -1
        self._free.append(node)


class GrowingIndex:
    """The suffix index of one growing sequence (a request's prompt and output): its occurrences go
    into a :class:`SuffixIndex` once they have ``max_depth`` tokens; the starts of the last
    ``max_depth - 1`` tokens (the *window*) are read from the sequence when matching.

    A place in it (what :meth:`continuations` walks) is ``(locus, ends)``: the trie's place of the path
    (None when only window starts have it) and the positions, in the sequence, of the token after each
    window start that has it.
    """

    def __init__(self, max_depth: int):
        self.trie = SuffixIndex(max_depth)
        self.max_depth = max_depth
        self.seq = self.trie.open()
        self.tokens: array = self.trie.sequence(self.seq)
        self._inserted = 0  # occurrences inserted: the starts 0 .. _inserted - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens``; occurrences that now have ``max_depth`` tokens go into the trie."""
        self.trie.append(self.seq, tokens)
        self.tokens = self.trie.sequence(self.seq)
        complete = len(self.tokens) - self.max_depth + 1
        for start in range(self._inserted, max(self._inserted, complete)):
            self.trie.insert(self.seq, start, self.max_depth)
        self._inserted = max(self._inserted, complete)

    def find(self, pattern: Sequence[int]):
        """The place of ``pattern`` among the occurrences that go on after it (the end of the
        sequence is no continuation), or None."""
        locus = self.trie.locate(pattern)
        if locus is not None and self.trie.depth(locus) >= self.max_depth:
            locus = None  # complete occurrences end at max_depth: none goes on
        n, size, wanted = len(self.tokens), len(pattern), array("i", pattern)
        first = pattern[0] if size else None
        ends = tuple(w + size for w in range(self._inserted, n - size)
                     if self.tokens[w] == first and self.tokens[w:w + size] == wanted)
        return None if locus is None and not ends else (locus, ends)

    def mass(self, place) -> int:
        """Occurrences through ``place`` that have a next token: the denominator of its children's
        probabilities (a window start cut off by the sequence's end tells nothing about the next)."""
        locus, ends = place
        return (self.trie.count(locus) if locus is not None else 0) + sum(1 for e in ends if e < len(self.tokens))

    def continuations(self, place) -> List[Tuple[int, int, tuple]]:
        """``(token, count, place)`` of every way the occurrences through ``place`` go on (trie and
        window together), most frequent first (then by token id)."""
        locus, ends = place
        found: Dict[int, list] = {}
        if locus is not None:
            for token, count, below in self.trie.continuations(locus):
                found[token] = [count, below, []]
        n = len(self.tokens)
        for e in ends:
            if e < n:
                entry = found.setdefault(self.tokens[e], [0, None, []])
                entry[0] += 1
                entry[2].append(e + 1)
        out = [(token, count, (below, tuple(nxt))) for token, (count, below, nxt) in found.items()]
        out.sort(key=lambda f: (-f[1], f[0]))
        return out
