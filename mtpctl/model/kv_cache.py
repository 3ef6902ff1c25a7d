"""A preallocated KV cache indexed by position (the gpt-fast layout).

Slots ``[0, length)`` hold committed tokens; a forward pass writes its N candidate tokens' keys and
values to slots ``[length, length + N)`` without committing them. :meth:`KVCache.advance` then keeps a
prefix of those (a chain draft: nothing to copy, rejected entries are simply overwritten later),
:meth:`KVCache.keep` keeps an arbitrary subset (an accepted path of a draft tree: copied into place)
and :meth:`KVCache.rollback` forgets committed slots (nothing to copy either). The length changes only
through these methods. :class:`LatentCache` is the same for multi-head latent attention (DeepSeek-V3): one
compressed row a token and layer instead of every head's key and value.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch


class KVCache:
    """Keys and values of every layer.

    Attributes:
        k, v: ``[layers, batch, kv_heads, capacity + spare, head_dim]``; the ``spare`` slots past the
            capacity are never written (zeros), so a fixed-size window read in place may run past
            the last usable slot (the decode attention's tail, :func:`mtpctl.model.decoder._attention`).
        length: number of committed slots (tokens whose KV is final), the same for every batch row.
        capacity: slots that may hold tokens.
        linear: a hybrid model's Gated DeltaNet states of this sequence
            (:class:`~mtpctl.model.linear_cache.LinearCache`, set by ``Decoder.new_cache``), committed
            and rolled back with the slots (back only as far as it kept states); None for a model
            without such layers.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device="cpu", spare: int = 0):
        shape = (layers, batch, kv_heads, capacity + spare, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.capacity = capacity
        self.linear = None

    def _tensors(self) -> Tuple[torch.Tensor, ...]:
        """The tensors that hold the slots (each ``[layers, batch, heads, slots, ...]``)."""
        return self.k, self.v

    @property
    def nbytes(self) -> int:
        """Memory held by keys and values (and a hybrid model's committed Gated DeltaNet states), in bytes."""
        held = sum(t.numel() * t.element_size() for t in self._tensors())
        return held + (self.linear.nbytes if self.linear is not None else 0)

    def _end(self, n: int) -> int:
        """The slot after ``n`` new ones from ``length``; ValueError where they do not fit in ``capacity``."""
        end = self.length + n
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} slots needed, {self.capacity} allocated")
        return end

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Store ``k_new``/``v_new`` ``[batch, kv_heads, N, head_dim]`` at slots ``[length, length+N)``
        of ``layer`` and return views of all slots, ``[batch, kv_heads, capacity, head_dim]`` (slots
        past ``length + N`` hold stale values; the attention mask excludes them).

        Raises:
            ValueError: the N new slots do not fit in ``capacity``.
        """
        end = self._end(k_new.shape[2])
        self.k[layer, :, :, self.length:end] = k_new
        self.v[layer, :, :, self.length:end] = v_new
        return self.k[layer], self.v[layer]

    def write_at(self, layer: int, slots: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store ``k_new``/``v_new`` ``[batch, kv_heads, N, head_dim]`` at ``slots`` ``[N]`` (long, where the
        cache is) of ``layer``: :meth:`write` with the slots read on the device, not from :attr:`length`, so
        that a captured decode step (:mod:`mtpctl.backends.step_graphs`) writes where its replay says."""
        self.k[layer].index_copy_(2, slots, k_new.to(self.k.dtype))
        self.v[layer].index_copy_(2, slots, v_new.to(self.v.dtype))

    def layer_for_write(self, layer: int, n: int):
        """Views ``[batch, kv_heads, capacity + spare, head_dim]`` of ``layer``'s keys and values for a
        pass of ``n`` new tokens that a kernel writes itself to slots ``[length, length+n)``
        (:func:`mtpctl.model.native.rope_write`): :meth:`write` without the copy.

        Raises:
            ValueError: the n new slots do not fit in ``capacity``.
        """
        end = self.length + n
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} slots needed, {self.capacity} allocated")
        return self.k[layer], self.v[layer]

    def advance(self, n: int) -> None:
        """Commit the first ``n`` uncommitted slots (``length += n``)."""
        self._check_advance(n)
        if self.linear is not None:
            self.linear.keep(range(n), self.length)
        self.length += n

    def _check_advance(self, n: int) -> None:
        if n < 0 or self.length + n > self.capacity:
            raise ValueError(f"cannot advance the KV cache by {n} from {self.length} of {self.capacity}")

    def keep(self, offsets: Sequence[int]) -> None:
        """Commit the uncommitted slots ``length + offsets[i]`` (increasing) as slots ``length + i``.

        Used for the accepted path of a draft tree; a prefix ``0..n-1`` costs no copy.
        """
        offsets = list(offsets)
        self._check_advance(len(offsets))
        if self.linear is not None:  # the state after the path's last token
            self.linear.keep(offsets, self.length)
        if offsets != list(range(len(offsets))):
            src = torch.tensor(offsets, dtype=torch.long, device=self.k.device) + self.length
            dst = slice(self.length, self.length + len(offsets))
            for t in self._tensors():
                t[:, :, :, dst] = t.index_select(3, src)
        self.length += len(offsets)

    def copy_committed(self, other: "KVCache") -> None:
        """Hold ``other``'s committed slots (a cache of the same kind and layers, capacity at most this
        one's: a drafter's cache grown), replacing this one's."""
        if other.length > self.capacity:
            raise ValueError(f"cannot copy {other.length} committed slots into a cache of {self.capacity}")
        for mine, theirs in zip(self._tensors(), other._tensors()):
            mine[:, :, :, :other.length] = theirs[:, :, :, :other.length]
        self.length = other.length

    def rollback(self, length: int) -> None:
        """Forget the committed slots from ``length`` on (the slots are overwritten by later passes).

        Raises:
            ValueError: ``length`` is negative or beyond the committed slots.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll the KV cache back to {length}: it holds {self.length} committed slots")
        if self.linear is not None:
            self.linear.rollback(length, self.length)
        self.length = length

    def reachable(self, length: int) -> int:
        """The most committed tokens, at most ``length``, that :meth:`rollback` can return to: ``length``
        (capped at the committed slots), or for a hybrid model the last commit up to it whose Gated
        DeltaNet states were kept (:meth:`LinearCache.reachable <mtpctl.model.linear_cache.LinearCache.reachable>`)."""
        length = min(length, self.length)
        return length if self.linear is None else self.linear.reachable(length, self.length)

    def reset(self) -> None:
        """Forget every committed slot (``length = 0``) and a hybrid model's states; memory is kept for reuse."""
        if self.linear is not None:
            self.linear.reset()
        self.length = 0


class LatentCache(KVCache):
    """Multi-head latent attention's compressed KV cache (DeepSeek-V2/V3): per token and layer only the
    latent ``c_kv`` after ``kv_a_layernorm`` (``kv_lora_rank`` values) and the rotary key ``k_pe`` after
    its rotation (``qk_rope_head_dim``), which every head shares, side by side in one row. Attention runs
    in the latent space (:func:`mtpctl.model.decoder.latent_attention`): the row is a single KV head's
    key, and its latent part the value. Committing, rolling back and the slot layout are
    :class:`KVCache`'s.

    Attributes:
        k: ``[layers, batch, 1, capacity + spare, kv_lora_rank + qk_rope_head_dim]``: each slot's latent
            then its rotary key (attention's key).
        v: a view of ``k``'s first ``kv_lora_rank`` values (attention's value: the latent), no memory
            of its own.
        rank: ``kv_lora_rank``.
    """

    def __init__(self, layers: int, batch: int, rank: int, rope_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device="cpu", spare: int = 0):
        self.k = torch.zeros((layers, batch, 1, capacity + spare, rank + rope_dim), dtype=dtype, device=device)
        self.rank = rank
        self.length = 0
        self.capacity = capacity
        self.linear = None

    @property
    def v(self) -> torch.Tensor:
        return self.k[..., :self.rank]

    def _tensors(self) -> Tuple[torch.Tensor, ...]:
        return (self.k,)

    def write(self, layer: int, k_new: torch.Tensor, v_new: Optional[torch.Tensor] = None):
        """Store the rows ``k_new [batch, 1, N, kv_lora_rank + qk_rope_head_dim]`` at slots ``[length,
        length+N)`` of ``layer`` (``v_new``, the rows' latents, is ignored: ``k_new`` holds them) and
        return views of all slots' keys and values (:meth:`KVCache.write`).

        Raises:
            ValueError: the N new slots do not fit in ``capacity``.
        """
        end = self._end(k_new.shape[2])
        self.k[layer, :, :, self.length:end] = k_new
        return self.k[layer], self.k[layer, ..., :self.rank]

    def layer_for_write(self, layer: int, n: int):
        raise ValueError("the native kernels do not write a latent (MLA) cache")


class PassSlots:
    """Where the tokens of one decode or verify pass keep their keys and values: the tokens of one or
    more sequences packed one sequence after another, each sequence with its own :class:`KVCache`.
    Token j of sequence s goes to slot ``caches[s].length + j`` of its cache; nothing is committed.

    Attributes:
        caches: the sequences' caches, in pass order.
        counts: ``[S]`` tokens of each sequence in the pass.
        starts: ``[S]`` the first row of each sequence in the pass.
        rows: the pass's tokens, ``sum(counts)``; a pass padded on the device path
            (:meth:`mtpctl.model.decoder.Decoder.pass_rows`) carries more rows, whose results nobody reads.
        kv: ``[N, 4]`` long, per token the addresses of its cache's keys and values (layer 0), the
            elements between two layers and the slots per KV head: the native kernels' table
            (:func:`mtpctl.model.native.rotate_write`, :func:`mtpctl.model.native.attend`).
        dest: ``[N]`` long, the slot of its own cache each token's key and value go to.
        kv_bf16: the caches hold bfloat16 keys and values (else float32).
        parents: per sequence, its draft tree's parents (node i's parent, -1 for the root), for a
            verify pass: a hybrid model's Gated DeltaNet layers compute each node from its parent's
            state and stage every node's; None for a prefill pass (each sequence's tokens a chain, only
            the last token's state staged).
        at: ``[N]`` long on the caches' device, the slots the tokens' keys and values go to, read on the
            device (:meth:`KVCache.write_at`: a captured decode step, one sequence); None: from each
            cache's length.

    Raises:
        ValueError: caches and counts of different lengths, caches of different dtypes, or a sequence
            whose tokens do not fit its cache's capacity.
    """

    def __init__(self, caches: Sequence[KVCache], counts: Sequence[int],
                 parents: Optional[Sequence[Sequence[int]]] = None, at: Optional[torch.Tensor] = None):
        if len(caches) != len(counts) or not caches:
            raise ValueError(f"{len(caches)} caches for {len(counts)} sequences")
        if at is not None and len(caches) != 1:
            raise ValueError(f"slots read on the device are for one sequence, not {len(caches)}")
        for cache, n in zip(caches, counts):
            if cache.length + n > cache.capacity:
                raise ValueError(f"KV cache overflow: {cache.length + n} slots needed, {cache.capacity} allocated")
        if len({c.k.dtype for c in caches}) != 1:
            raise ValueError("the caches of one pass must share a dtype")
        self.caches = list(caches)
        self.at = at
        self.parents = None if parents is None else [list(p) for p in parents]
        self.kv_bf16 = caches[0].k.dtype == torch.bfloat16
        self.counts = [int(n) for n in counts]
        self.starts = [sum(self.counts[:s]) for s in range(len(self.counts))]
        self.rows = sum(self.counts)
        rows = torch.tensor([[c.k.data_ptr(), c.v.data_ptr(), c.k[0].numel() if len(c.k) else 0, c.k.shape[3]]
                             for c in self.caches],  # no layers: a hybrid draft of Gated DeltaNet layers only
                            dtype=torch.long)
        counts_t = torch.tensor(self.counts)
        self.kv = rows.repeat_interleave(counts_t, dim=0)
        lengths = torch.tensor([c.length for c in self.caches])
        within = torch.arange(int(counts_t.sum())) - torch.tensor(self.starts).repeat_interleave(counts_t)
        self.dest = lengths.repeat_interleave(counts_t) + within

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store ``k_new``/``v_new`` ``[1, kv_heads, N, head_dim]``, each sequence's rows in its own cache."""
        if self.at is not None:
            self.caches[0].write_at(layer, self.at, k_new, v_new)
            return
        for cache, start, n in zip(self.caches, self.starts, self.counts):
            cache.write(layer, k_new[:, :, start:start + n], v_new[:, :, start:start + n])
