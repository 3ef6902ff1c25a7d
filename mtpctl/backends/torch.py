"""The torch backend: mtpctl's own runtime on a checkpoint folder (:class:`TorchEngine` over the
:class:`~mtpctl.model.decoder.Decoder` and its position-indexed KV cache; :class:`TorchSession`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from mtpctl.decode.attention import (TAIL, attention_masks, pass_plans, plans_on, prefill_plan, to_device,
                                     tree_shape)
from mtpctl.backends.step_graphs import StepGraphs
from mtpctl.decode.engine import StepOutput
from mtpctl.decode.session import Session
from mtpctl.decode.tree import DraftTree
from mtpctl.errors import UnsupportedModel
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import DTYPES, Decoder
from mtpctl.model.device import Placement, clock, device_numerics, pin_device_numerics, resolve_placement
from mtpctl.model.linears import PackedLinear, TiledLinear, any_rows
from mtpctl.model.kv_cache import PassSlots
from mtpctl.model.native import check_plan, kernel_runs, matmul_isa
from mtpctl.model.row_invariance import dtype_name, int4_path, int4_paths, path_of, verdicts
from mtpctl.model.tokenizer import TextCodec
from mtpctl.model.weights import weights_hash

WEIGHTS = ("dense", "int4")
#: prompt tokens a native prefill pass carries at most: bounds the pass's buffers (the int4 kernel's
#: rows stop getting cheaper long before this)
PREFILL_CHUNK = 256


class PassLogits:
    """The logits of a pass's rows, computed on demand and shared by the sequences whose rows the
    pass carries, in as few lm_head calls as the reads allow: rows asked for ahead (:meth:`want`:
    greedy acceptance asks for every node of every tree) are computed together with the next row
    read, in one call that reads the lm_head's weights once. A row read without being asked for
    (sampled acceptance reads row by row) is computed with every other row of the pass where the
    lm_head is dense (its weights are read once a call, a row costs little beside that), alone where
    it is int4 (whose cost grows with the rows of a call). Where the lm_head's kernel takes each row's
    argmax as it writes the row (:meth:`~mtpctl.model.decoder.Decoder.logits_best`), :meth:`best`
    gives it, so greedy acceptance need not read the row again. Off the CPU the argmax is taken where
    the logits are and only the ids come to the host; a row comes to the host when it is read.
    """

    def __init__(self, model: Decoder, hidden_states: torch.Tensor):
        self.model = model
        self.hidden_states = hidden_states  # [N, hidden], after the final norm
        self._rows: Dict[int, torch.Tensor] = {}
        self._best: Dict[int, int] = {}  # row -> its argmax, where the kernel took it (-1: NaN or inf in the row)
        self._wanted: set = set()
        self._all: Optional[torch.Tensor] = None
        self._host: Dict[object, torch.Tensor] = {}  # off the CPU: rows (or "all") copied to the host
        self.ms = 0.0  # time spent in the lm_head so far

    def _logits(self, rows: List[int]) -> torch.Tensor:
        """Rows' logits where the model is (off the CPU their argmax too, only the ids to the host)."""
        start = clock()
        with torch.inference_mode():
            out, best = self.model.logits_best(self.hidden_states[rows])
            if out.device.type != "cpu":  # the argmax where the logits are: only the ids to the host
                best = _device_best(out)
        if best is not None:
            self._best.update(zip(rows, best.tolist()))
        self.ms += (clock() - start) * 1e3
        return out

    def _on_host(self, key, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` on the host, copied once (itself on the CPU)."""
        if logits.device.type == "cpu":
            return logits
        if key not in self._host:
            self._host[key] = logits.cpu()
        return self._host[key]

    def want(self, rows: Sequence[int]) -> None:
        """Rows to compute with the next one read (not computed yet)."""
        self._wanted.update(int(r) for r in rows if int(r) not in self._rows)

    def row(self, i: int) -> torch.Tensor:
        """Row i's logits ``[vocab]`` float32, on the host."""
        if self._computed(i) is not None:  # every row of the pass is computed
            return self.all()[i]
        return self._on_host(i, self._rows[i])

    def _computed(self, i: int) -> Optional[torch.Tensor]:
        """Computes row i where it is not yet (where the model is); the pass's ``_all`` when it holds it."""
        if self._all is None and i not in self._rows and i not in self._wanted and not self.model.logits_by_row:
            self._all = self._logits(list(range(len(self.hidden_states))))
        if self._all is not None:
            return self._all
        if i not in self._rows:
            todo = sorted(self._wanted | {i})
            self._rows.update(zip(todo, self._logits(todo)))
            self._wanted.clear()
        return None

    def best(self, i: int) -> Optional[int]:
        """Row i's argmax (the first index of its largest logit, as ``int(self.row(i).argmax())``), computing
        the row where it is not yet (not copying it to the host); None where the kernel did not take it
        or the row holds NaN or inf (read the row)."""
        self._computed(i)
        best = self._best.get(i)
        return best if best is not None and best >= 0 else None

    def all(self) -> torch.Tensor:
        """Every row's logits ``[N, vocab]`` float32, on the host."""
        if self._all is None:
            self._all = self._logits(list(range(len(self.hidden_states))))
        return self._on_host("all", self._all)


def _device_best(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of ``logits [M, vocab]`` (the first index of its largest value), -1 where the
    row holds NaN or inf: what the native lm_head kernel gives, taken on the logits' device."""
    best = logits.argmax(-1)
    return torch.where(torch.isfinite(logits).all(-1), best, -1).cpu()


class TorchStepOutput(StepOutput):
    """One forward pass of one sequence: the hidden states of its N tokens and their logits, computed
    on demand (:class:`PassLogits`, shared with the other sequences of a batched pass).

    ``out[i]`` is row i's logits ``[vocab]`` (float32); ``out.logits`` all rows ``[N, vocab]``.
    """

    def __init__(self, logits: PassLogits, start: int, count: int, prompt_hidden_states: Optional[torch.Tensor] = None,
                 aux_hidden_states: Optional[Dict[int, torch.Tensor]] = None):
        self._pass, self._start, self._count = logits, start, count
        self.hidden_states = logits.hidden_states[start:start + count]  # [N, hidden], after the final norm
        self.prompt_hidden_states = prompt_hidden_states  # prefill: [T, hidden] every prompt row; else None
        # the engine's aux_layers: layer id -> [rows, hidden] residual stream of every row of the pass
        # (prefill: every prompt row), see Decoder.forward; None without aux_layers
        self.aux_hidden_states = aux_hidden_states

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._pass.row(self._start + i % self._count)

    def greedy(self, i: int) -> Optional[int]:
        """Row i's argmax where the lm_head's kernel took it with the row (:meth:`PassLogits.best`), else
        None: read the row."""
        return self._pass.best(self._start + i % self._count)

    @property
    def logits_timer(self) -> PassLogits:
        """The pass's logits, whose ``ms`` is the time spent in the lm_head (shared by the pass's sequences)."""
        return self._pass

    def prefetch(self, rows: Sequence[int]) -> None:
        """Rows this sequence will read next: computed together with the pass's next row read."""
        self._pass.want([self._start + i % self._count for i in rows])

    @property
    def logits(self) -> torch.Tensor:
        """All rows' logits ``[N, vocab]`` float32."""
        return self._pass.all()[self._start:self._start + self._count]


def native_attention_runs(cfg) -> bool:
    """Whether decode and verify passes of a model of ``cfg`` attend on the native kernel here: its family
    runs on the native kernels (``Family.kernels``: gpt-oss's attention sinks do not) and the kernel takes
    the shape and loads (:func:`~mtpctl.model.native.kernel_runs`). Multi-head latent attention attends
    over its compressed cache on torch's ops (:func:`~mtpctl.model.decoder.latent_attention`)."""
    return "native" in cfg.family.kernels and cfg.mla is None and kernel_runs(cfg.num_attention_heads, cfg.num_key_value_heads,
                                                          cfg.head_dim)


class TorchEngine:
    """Runs a :class:`Decoder` on one sequence with its own KV cache
    (:class:`mtpctl.decode.engine.Engine`); :func:`verify_packed` verifies several engines'
    drafts in one pass.

    Args:
        model: the target decoder.
        capacity: KV cache slots (tokens) to allocate: prompt + new tokens + the largest draft.
        native: decode and verify passes attend with the native kernel (:mod:`mtpctl.model.native`)
            where it can be built and takes the model's attention shape (None, the default), always
            (True: ValueError where it cannot), or never (False: torch's ops,
            :func:`mtpctl.decode.attention.attention_plan`). Either way each token of a verify pass
            gets bit for bit what plain decoding gives it (the engine's ``native`` attribute says
            which runs).
        aux_layers: layer ids whose residual stream each pass's output also carries
            (``aux_hidden_states``, for EAGLE-3 drafters; see :meth:`Decoder.forward`).
        cuda_graphs: replay one-token decode passes (without aux layers) as CUDA graphs
            (:class:`~mtpctl.backends.step_graphs.StepGraphs`: a dense body on a GPU's pure-torch path).
    """

    def __init__(self, model: Decoder, capacity: int, native: Optional[bool] = None, aux_layers: Sequence[int] = (),
                 cuda_graphs: bool = False):
        self.model = model
        self.aux_layers = tuple(aux_layers)
        cfg = model.cfg
        on_cpu = model.device.type == "cpu"
        self.native = native is not False and on_cpu and native_attention_runs(cfg)
        if native and not self.native:
            raise ValueError("native attention was asked for, but the kernel could not be built, does not take "
                             f"{cfg.model_type}'s attention (family kernels: {', '.join(cfg.family.kernels)}) or "
                             f"head_dim {cfg.head_dim} with {cfg.num_attention_heads} heads over {cfg.num_key_value_heads} KV "
                             f"heads, or the model is on {model.device}")
        # a lone token reads its tail in place (TAIL spare slots); the native kernels take a bfloat16 cache
        self.cache = model.new_cache(capacity, spare=TAIL, compact=self.native)
        self.graphs = StepGraphs(model, self.cache) if cuda_graphs else None

    @property
    def length(self) -> int:
        """Committed tokens in the KV cache."""
        return self.cache.length

    @property
    def kv_cache_bytes(self) -> int:
        """Memory held by the KV cache, bytes."""
        return self.cache.nbytes

    @property
    def capacity(self) -> int:
        """KV cache slots allocated (tokens)."""
        return self.cache.capacity

    @property
    def draft_state_bytes(self) -> int:
        """Memory of the Gated DeltaNet states the last verify pass keeps per draft tree node until commit
        (:func:`mtpctl.model.gated_deltanet.tree_state_bytes` of its nodes, summed over those layers), bytes;
        0 for a model without such layers. The decoding loop reports the most of it
        (``GenerationStats.draft_state_bytes_max``)."""
        linear = self.cache.linear
        return linear.staged_bytes if linear is not None else 0

    def prefill(self, prompt_ids: Sequence[int]) -> TorchStepOutput:
        """Reset the cache, run and commit the prompt; returns the last position's output (one row).
        Prefill feeds plain and speculative decoding alike, so it may use kernels that decode and
        verify passes do not (torch's fused attention where the native kernels do not run)."""
        self.cache.reset()
        if len(prompt_ids) > self.capacity:
            raise ValueError(f"KV cache overflow: {len(prompt_ids)} slots needed, {self.capacity} allocated")
        aux = dict.fromkeys(self.aux_layers) if self.aux_layers else None
        with torch.inference_mode():
            hidden = self._prefill_native(prompt_ids, aux) if self.native else self._prefill_masked(prompt_ids, aux)
        return TorchStepOutput(PassLogits(self.model, hidden[-1:]), 0, 1, prompt_hidden_states=hidden,
                               aux_hidden_states=_rows_of(aux, 0, len(prompt_ids)))

    def _prefill_masked(self, prompt_ids: Sequence[int], aux: Optional[Dict[int, Optional[torch.Tensor]]]) -> torch.Tensor:
        """The prompt in one pass through torch's fused attention (masks); its hidden states ``[T, hidden]``."""
        device, free = self.model.device, self.model.free_prefill
        depth = torch.arange(len(prompt_ids))
        windows = self.model.cfg.layer_windows
        # free: the full-attention layers attend causally without a mask (Decoder.free_prefill), none is built
        masks = plans_on(attention_masks([w for w in windows if w is not None or not free], 0, depth, None,
                                         self.capacity), device)
        if free:
            masks[None] = None
        with any_rows() if free else contextlib.nullcontext():
            hidden = self.model(torch.tensor([list(prompt_ids)], dtype=torch.long, device=device),
                                depth[None].to(device), self.cache, masks, aux=aux)[0]
        self.cache.advance(len(prompt_ids))
        return hidden

    def _prefill_native(self, prompt_ids: Sequence[int], aux: Optional[Dict[int, Optional[torch.Tensor]]]) -> torch.Tensor:
        """The prompt in passes of up to :data:`PREFILL_CHUNK` tokens on the native kernels (an int4
        model's whole layer stack in one call where it covers the model), each token attending to the
        slots before it and to itself (:func:`prefill_plan`); its hidden states ``[T, hidden]``, and
        ``aux`` filled with every prompt row."""
        hidden, parts = [], {layer: [] for layer in aux} if aux else {}
        for start in range(0, len(prompt_ids), PREFILL_CHUNK):
            chunk = list(prompt_ids[start:start + PREFILL_CHUNK])
            length, n = self.cache.length, len(chunk)
            slots = PassSlots([self.cache], [n])
            plans = prefill_plan(self.model.cfg.layer_windows, length, n)
            for plan in plans.values():
                check_plan(plan, slots.kv)
            chunk_aux = dict.fromkeys(parts) if parts else None
            positions = torch.arange(length, length + n)[None]
            hidden.append(self.model(torch.tensor([chunk], dtype=torch.long), positions, slots, None, plans,
                                     aux=chunk_aux)[0])
            self.cache.advance(n)
            for layer in parts:
                parts[layer].append(chunk_aux[layer])
        for layer, pieces in parts.items():
            aux[layer] = torch.cat(pieces, dim=1)
        return torch.cat(hidden)

    def verify(self, tree: DraftTree) -> TorchStepOutput:
        """Score the tree's N nodes after the committed tokens; row i is the target's prediction for
        the token following node i. Nothing is committed."""
        return verify_packed([self], [tree])[0]

    def commit(self, path: Sequence[int]) -> None:
        """Keep the KV of the verified nodes ``path`` (root first)."""
        self.cache.keep(path)

    def rollback(self, length: int) -> None:
        """Forget the committed tokens from ``length`` on (a hybrid model's: only back to a length
        :meth:`reachable` gives)."""
        self.cache.rollback(length)

    def reachable(self, length: int) -> int:
        """The most committed tokens, at most ``length``, that :meth:`rollback` can return to (see
        :meth:`mtpctl.model.kv_cache.KVCache.reachable`)."""
        return self.cache.reachable(length)

    def keep_history(self, commits: int) -> None:
        """A hybrid model's cache keeps the Gated DeltaNet states of its last ``commits`` commits, so
        that :meth:`rollback` can return to any of them (a draft model's cache); other models' caches
        roll back anywhere and keep nothing."""
        if self.cache.linear is not None:
            self.cache.linear.keep_history(commits)

    @property
    def history_bytes(self) -> int:
        """Memory of the Gated DeltaNet states kept for rollback (:meth:`keep_history`), bytes; 0 for
        other models."""
        linear = self.cache.linear
        return linear.past_bytes if linear is not None else 0


def verify_packed(engines: Sequence[TorchEngine], trees: Sequence[DraftTree]) -> List[TorchStepOutput]:
    """Score each engine's draft tree in one forward pass of the shared model: the trees' rows (nodes,
    then any extra rows) packed one sequence after another (not padded), each reading and writing its
    own engine's KV cache.
    Every kernel on the path computes a row the same alone or among others, so each engine's output
    is bit for bit what :meth:`TorchEngine.verify` of its tree alone gives. Nothing is committed.

    Raises:
        ValueError: engines of different models, attention paths or aux layers, or a tree that does
            not fit its engine's cache (or deeper than verification supports).
    """
    model, native, aux_layers = engines[0].model, engines[0].native, engines[0].aux_layers
    if any(e.model is not model or e.native != native or e.aux_layers != aux_layers for e in engines):
        raise ValueError("engines verified together must share one model, one attention path and their aux layers")
    shapes = [(e.length,) + tree_shape(t) for e, t in zip(engines, trees)]
    plans = pass_plans(model.cfg.layer_windows, native, shapes)
    if len(engines) == 1 and engines[0].graphs is not None and trees[0].rows == 1 and not aux_layers:
        with torch.inference_mode():
            hidden = engines[0].graphs.run(trees[0].pass_tokens[0], plans)
        if hidden is not None:  # a plain decode step, replayed (mtpctl.backends.step_graphs)
            return [TorchStepOutput(PassLogits(model, hidden), 0, 1)]
    slots = PassSlots([e.cache for e in engines], [t.rows for t in trees], [t.parents for t in trees])
    if native:
        for plan in plans.values():
            check_plan(plan, slots.kv)
    else:
        plans = plans_on(plans, model.device)
    tokens = [token for t in trees for token in t.pass_tokens]
    positions = torch.cat([length + depth for length, depth, _ in shapes])
    padding = model.pass_rows(len(tokens)) - len(tokens)  # the device path's fixed row blocks, padded here
    if padding:
        tokens += [0] * padding
        positions = torch.cat((positions, positions[-1:].expand(padding)))
    ids = to_device(torch.tensor([tokens], dtype=torch.long), model.device)
    positions = to_device(positions[None], model.device)
    aux = dict.fromkeys(aux_layers) if aux_layers else None
    with torch.inference_mode():
        hidden = model(ids, positions, slots, None, plans, aux=aux)[0, :slots.rows]
    logits = PassLogits(model, hidden)
    return [TorchStepOutput(logits, start, count, aux_hidden_states=_rows_of(aux, start, count))
            for start, count in zip(slots.starts, slots.counts)]


def _rows_of(aux: Optional[Dict[int, torch.Tensor]], start: int, count: int) -> Optional[Dict[int, torch.Tensor]]:
    """One sequence's ``[count, hidden]`` rows of each ``[1, N, hidden]`` aux layer output of a pass."""
    return None if aux is None else {layer: h[0, start:start + count] for layer, h in aux.items()}


class TorchSession(Session):
    """Target model + tokenizer of a checkpoint folder, on the torch backend.

    Args:
        folder: Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files).
        dtype: ``"float32"`` (default) or ``"bfloat16"``: weights, activations and KV cache.
        weights: ``"dense"`` (default), or ``"int4"`` to keep 4-/8-bit group-quantized weights (GGUF
            Q4_1/Q8_0 imports) packed for the int4 CPU kernel (needs bfloat16 and the CPU; see
            :mod:`mtpctl.model.linears`).
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (:func:`mtpctl.model.device.resolve_device`).
        kernels: ``"auto"`` (native on the CPU, torch elsewhere), ``"native"`` (the C kernels: CPU only)
            or ``"torch"`` (the pure-torch path, on any device: torch's attention ops and its matmuls in
            fixed-shape row blocks, :mod:`mtpctl.model.device`).
        cuda_graphs: replay plain decode steps as CUDA graphs (:mod:`mtpctl.backends.step_graphs`): a
            dense body on a CUDA device's pure-torch path. Off by default until a GPU run has checked it
            (``benchmarks/gpu_check.sh`` compares its tokens and speed with the eager steps').

    Raises:
        BadInput: see :func:`mtpctl.model.device.resolve_placement`.
        CorruptModel, UnsupportedModel: see :meth:`Decoder.from_folder` and :class:`TextCodec`; int4
            weights off the CPU.
    """

    backend = "torch"
    extra_rows = True  # a pass carries a tree's extra rows (lookahead's window) after its nodes

    def __init__(self, folder: Path, dtype: str = "float32", weights: str = "dense", device: str = "cpu",
                 kernels: str = "auto", cuda_graphs: bool = False):
        if dtype not in DTYPES:
            raise UnsupportedModel(f"dtype {dtype!r} is not supported (choose from {', '.join(DTYPES)})", option="dtype")
        if weights not in WEIGHTS:
            raise UnsupportedModel(f"weights {weights!r} is not supported (choose from {', '.join(WEIGHTS)})",
                                   option="weights")
        self.placement: Placement = resolve_placement(device, kernels)
        pin_device_numerics(self.placement.device)
        if weights == "int4" and self.placement.device.type != "cpu":
            raise UnsupportedModel(f"int4 weights run on the CPU's kernels only; on {self.placement.device} load "
                                   "dense weights (--dtype bfloat16)", option="weights")
        DecoderConfig.from_folder(folder)  # config.json's one-line errors before the tokenizer's model config reads it
        super().__init__(folder, TextCodec(Path(folder)))
        self._target_hash: Optional[str] = None
        native = self.placement.native
        self.model = Decoder.from_folder(self.folder, DTYPES[dtype], packed=weights == "int4", blocked=native,
                                         native_int4=None if native else False, device=self.placement.device)
        if not native:
            self.model.hold_fixed_rows(self.placement.rows, device_path=self.placement.device.type != "cpu")
        if cuda_graphs and self.placement.device.type != "cuda":
            raise UnsupportedModel(f"CUDA graphs replay decode steps on a CUDA device, not {self.placement.describe()}: "
                                   "run on a CUDA device, or without CUDA graphs", option="cuda_graphs")
        if cuda_graphs and self.model.pass_block is None:
            raise UnsupportedModel(f"CUDA graphs replay the decode steps of a dense body; {self.model.cfg.model_type}'s "
                                   "(mixture-of-experts, hybrid or latent attention) decodes eagerly: run it without "
                                   "CUDA graphs", option="cuda_graphs")
        self.cuda_graphs = cuda_graphs
        if weights == "int4" and not self.model.packed_weights:
            candidates = int4_paths(self.model.dtype, None if native else False)
            if int4_path(self.model.dtype, None if native else False) is None:
                checked = [f"{v.path} ({v.detail or 'row-invariant'})" for v in verdicts(candidates).values()]
                raise UnsupportedModel("no int4 kernel computes a row alike alone and in a verify pass on this CPU "
                                       f"(checked: {', '.join(checked)}), so int4 weights would not "
                                       "decode losslessly here: load the dense weights", option="weights")
            raise UnsupportedModel(f"no weight of {self.folder} is 4-/8-bit group-quantized (GGUF Q4_1/Q8_0), "
                                   "so it has no int4 weights to keep: load its dense weights", option="weights")

    @property
    def context_length(self) -> int:
        return self.model.cfg.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    def new_engine(self, capacity: int, aux_layers: Sequence[int] = ()) -> TorchEngine:
        return TorchEngine(self.model, capacity, native=None if self.placement.native else False, aux_layers=aux_layers,
                           cuda_graphs=self.cuda_graphs)

    def verify_together(self, engines: Sequence[TorchEngine], trees: Sequence[DraftTree]) -> List[TorchStepOutput]:
        """Every engine's draft tree in one packed pass (:func:`verify_packed`)."""
        return verify_packed(engines, trees)

    @property
    def attention(self) -> str:
        """What decode and verify passes attend with: ``"native"`` (the C kernel,
        :mod:`mtpctl.model.native`) or ``"torch"`` (torch's ops: no compiler, a shape the kernel
        does not take, ``MTPCTL_NATIVE_KERNELS=0``, or the torch kernels asked for). Greedy output can
        differ between the two at near-ties; each is reproduced exactly by speculation."""
        cfg = self.model.cfg
        native = self.placement.native and native_attention_runs(cfg)
        return "native" if native else "torch"

    @property
    def int4_kernel(self) -> Optional[str]:
        """What the packed 4-/8-bit weights run on (int4 weights): ``"native"`` when all of them run
        on ``csrc/int4_matmul.c``, ``"torch"`` when any runs on torch's int4 kernel (no compiler,
        ``MTPCTL_NATIVE_KERNELS=0``, or a weight whose rows are not a multiple of 4); None for dense
        weights."""
        packed = [m for m in self.model.modules() if isinstance(m, PackedLinear)]
        if not packed:
            return None
        return "native" if all(m.native for m in packed) else "torch"

    @property
    def matmul_isa(self) -> Optional[str]:
        """Which path the native matmuls take on this CPU (:func:`mtpctl.model.native.matmul_isa`:
        ``"avx512-bf16"``, ``"avx2"`` or ``"portable"``) when any of the model's weights run on them (int4
        codes or bfloat16 tiles); None when none does (float32, or no native library)."""
        if not any(isinstance(m, TiledLinear) or (isinstance(m, PackedLinear) and m.native)
                   for m in self.model.modules()):
            return None
        return matmul_isa()

    @property
    def device(self) -> str:
        """Where the target computes (``cpu``, ``cuda:0``)."""
        return str(self.placement.device)

    @property
    def torch_device(self) -> str:
        """The placement's device (:attr:`device`): where the passes' work is queued and allocated."""
        return self.device

    @property
    def kernels(self) -> str:
        """``native`` or ``torch``: the kernel path decode and verify passes take."""
        return self.placement.kernels

    @property
    def matmul_paths(self) -> Dict[str, str]:
        """Each checked path the target's products take on this CPU (:mod:`mtpctl.model.row_invariance`:
        its linear layers' kernels, MoE experts' fixed-row blocks, and attention's products where torch's
        ops run it) and its verdict
        here: ``row-invariant`` or ``not row-invariant: WHERE``. {} off the CPU (nothing is checked there)."""
        if self.placement.device.type != "cpu":
            return {}
        paths = {path_of(m) for m in self.model.modules()} - {None}
        if any(getattr(layer, "moe", None) is not None for layer in self.model.layers):  # experts: fixed-row blocks
            paths.add(f"fixed-rows-{dtype_name(self.model.dtype)}")
        if self.attention == "torch":
            paths.add("torch-attention-float32")
        return {path: "row-invariant" if v.invariant else f"not row-invariant: {v.detail}"
                for path, v in sorted(verdicts(sorted(paths)).items())}

    @property
    def device_numerics(self) -> dict:
        """The precision switches in force on the session's device (:func:`mtpctl.model.device.device_numerics`:
        pinned when the session opened; {} on a CPU)."""
        return device_numerics(self.placement.device)

    @property
    def greedy_exactness(self) -> str:
        """What is known of greedy speculation against plain greedy on this path: ``"bit-exact"`` on the
        CPU where every product's path passed its row-invariance check here (:attr:`matmul_paths`);
        ``"not-bit-exact"`` where one failed all the same (the decoder falls back from a path that fails to
        one that holds; torch's matmul in fixed blocks is the last resort, and attention's torch products
        have none); ``"unverified"``
        off the CPU: the pure-torch path runs every product in fixed-shape blocks there too, but whether
        the GPU's kernels then compute a row alike in every pass is measured by benchmarks/gpu_check.sh
        (docs/numerics.md), not promised."""
        if self.placement.device.type != "cpu":
            return "unverified"
        return "bit-exact" if all(v == "row-invariant" for v in self.matmul_paths.values()) else "not-bit-exact"

    @property
    def policy_mode(self) -> Optional[str]:
        """The mode whose measured pass costs the auto speculation policy reads (:attr:`mode`), or None
        on the torch kernels, whose passes those tables (measured on the native kernels of a CPU) do not
        describe: there every request drafts its whole budget."""
        return self.mode if self.placement.native else None

    @property
    def mode(self) -> str:
        """``float32``, ``bfloat16`` or ``int4``: what a decode step costs depends on it."""
        return "int4" if self.model.packed_weights else ("bfloat16" if self.model.dtype == torch.bfloat16 else "float32")

    def target_hash(self) -> str:
        """sha256 of the target's safetensors files (see :func:`mtpctl.model.weights.weights_hash`)."""
        if self._target_hash is None:
            self._target_hash = weights_hash(self.folder)
        return self._target_hash


def set_threads(threads: Optional[int]) -> None:
    """Use ``threads`` CPU threads for torch ops (None keeps torch's default)."""
    if threads:
        torch.set_num_threads(threads)
