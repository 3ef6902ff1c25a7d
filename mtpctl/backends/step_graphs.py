"""Plain decode steps of the pure-torch path replayed as CUDA graphs (``TorchSession(cuda_graphs=True)``).

A one-token decode pass of a dense body on a GPU launches a few hundred small kernels (about 28 a
layer); at 8B shapes the host's launch time is of the order of the step itself. A CUDA graph records
the pass's kernels once and replays them in one launch. A graph replays fixed kernels on fixed
memory, so everything that changes from step to step must be read on the device, from buffers the
graph owns (:class:`_Step`):

- the token's id and position (padded to the pass's row block, :meth:`Decoder.pass_rows`);
- the slot its key and value go to (:class:`~mtpctl.model.kv_cache.PassSlots` ``at``);
- each attention window's score bias (which tail slots the token sees).

What stays fixed is the attention's split into head and tail (:class:`~mtpctl.model.decoder.AttentionPlan`):
the head length is a function of the position that changes every ``HEAD_BLOCK`` positions
(:func:`~mtpctl.decode.attention.head_length`), so one graph serves the steps of one head length and
a new one is recorded when the head grows (16 steps a graph; the two latest are kept). The graph computes exactly the kernels
the eager step launches, on the same shapes, so a replayed step gives the eager step's bits, and
speculation's verify passes (eager) still reproduce plain decoding.

Glossary:
    step: one plain decode pass, one token of one sequence.
    head: the cache slots ``[0, head)`` a token reads in place; the graph's key.
    capture: recording a graph (its warm-up runs the step once eagerly first, as torch asks).
    replay: running the recorded kernels on what the buffers hold now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from mtpctl.model.decoder import ROPE_TABLES, AttentionGroup, AttentionPlan, Decoder
from mtpctl.model.kv_cache import KVCache, PassSlots


class CudaCapture:
    """Records a step as a CUDA graph on a stream of its own; the graphs of one engine share one memory
    pool. ``CUDAGraph.capture_begin``/``capture_end`` directly rather than ``torch.cuda.graph``, whose
    entry waits for the device and empties torch's device and pinned-memory caches at every capture
    (every 16 steps here: the eager verify passes and the buffers' pinned copies would allocate anew)."""

    def __init__(self):
        self.pool = None
        self.stream = None

    def __call__(self, step: Callable[[], torch.Tensor]) -> Tuple[Callable[[], None], torch.Tensor]:
        """(replay, the output tensor the replays write) of ``step``: run once eagerly (cuBLAS's handles
        and workspaces for the new shapes, the allocator's blocks), then recorded, both on the capture
        stream after the work queued before them."""
        if self.pool is None:
            self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            step()
            graph.capture_begin(pool=self.pool)
            try:
                out = step()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        return graph.replay, out


@dataclass
class _Step:
    """One head length's graph and the buffers it reads (on the model's device).

    Attributes:
        inputs: ``[2 rows + 1]`` long, what the three views below read, filled in one copy.
        ids: ``[1, rows]`` long, the token then padding.
        positions: ``[1, rows]`` long, the token's position repeated.
        slot: ``[1]`` long, the cache slot of the token's key and value (its position).
        tail_slots: ``[1, TAIL]`` long zeros: a lone token reads its tail in place from the head's end,
            so only this tensor's shape is read (the tail's length).
        biases: attention window -> ``[1, 1, 1, 1, head + TAIL]`` float32 score bias.
        replay: runs the recorded kernels.
        out: ``[1, hidden]`` the replays' hidden state (after the final norm).
        tables: the model's rotary tables when the graph was recorded, kept alive: the graph reads their
            memory, and :meth:`Decoder.reserve_rope` replaces (not extends) them when another cache
            needs more positions, after which torch would hand their memory to other tensors. The
            rows a graph reads (its cache's positions) are the same in the old and the new tables.
    """

    inputs: torch.Tensor
    ids: torch.Tensor
    positions: torch.Tensor
    slot: torch.Tensor
    tail_slots: torch.Tensor
    biases: Dict[Optional[int], torch.Tensor]
    replay: Callable[[], None] = None
    out: torch.Tensor = None
    tables: Tuple[torch.Tensor, ...] = ()


def graph_plan(plans: dict) -> Optional[int]:
    """The head length of a one-token pass's attention plans (window -> a tuple of one
    :class:`AttentionPlan`), or None where they are not the shape a graph records: one sequence, one
    group of the whole pass, no fixes, the tail read in place from the head's end."""
    heads = set()
    for plan in plans.values():
        if not isinstance(plan, tuple) or len(plan) != 1:
            return None
        p = plan[0]
        if len(p.groups) != 1 or p.groups[0].rows is not None or p.fixes is not None:
            return None
        if p.tail_start is None or p.tail_start != p.groups[0].head:
            return None
        heads.add(p.tail_start)
    return heads.pop() if len(heads) == 1 else None


class StepGraphs:
    """The graphs of one engine's plain decode steps (its :class:`KVCache`'s tensors are baked in).

    Args:
        model: a dense body on the device path (:meth:`Decoder.hold_fixed_rows` with ``device_path``).
        cache: the engine's KV cache.
        capture: records a step (:class:`CudaCapture`; the tests' stand-in replays an op tape).

    Raises:
        ValueError: a model whose passes are not held to fixed row blocks (MoE, hybrid or latent
            attention bodies, or the CPU).
    """

    def __init__(self, model: Decoder, cache: KVCache, capture: Optional[Callable] = None):
        if model.pass_block is None:
            raise ValueError("CUDA graphs record the decode steps of a dense body on a GPU's pure-torch path "
                             "(not MoE, hybrid or latent-attention bodies, not the CPU)")
        self.model, self.cache = model, cache
        self.capture = capture if capture is not None else CudaCapture()
        self._steps: Dict[int, _Step] = {}
        self.captures = 0  # graphs recorded
        self.replays = 0  # steps replayed

    def run(self, token: int, plans: dict) -> Optional[torch.Tensor]:
        """The hidden state ``[1, hidden]`` (a copy, after the final norm) of ``token`` decoded after the
        cache's committed slots (at the position and slot after them) (its key and value written, uncommitted), from the
        graph of the plans' head length (recorded on first use); None where the host ``plans``
        (:func:`~mtpctl.decode.attention.pass_plans`, not yet on the device) are not a graph's shape.

        Raises:
            ValueError: the cache has no slot left for the token.
        """
        if self.cache.length + 1 > self.cache.capacity:
            raise ValueError(f"KV cache overflow: {self.cache.length + 1} slots needed, {self.cache.capacity} allocated")
        head = graph_plan(plans)
        if head is None:
            return None
        step = self._steps.get(head)
        if step is None:
            for old in list(self._steps)[:-1]:  # a decode's positions only grow: keep the last graph but one
                del self._steps[old]
            step = self._steps[head] = self._new_step(plans)
        self._fill(step, token, plans)
        if step.replay is None:
            step.tables = tuple(t for t in (getattr(self.model, name) for name in ROPE_TABLES) if t is not None)
            step.replay, step.out = self.capture(lambda: self._forward(step, head))
            self.captures += 1
        else:
            self.replays += 1
        step.replay()
        return step.out.clone()

    def _new_step(self, plans: dict) -> _Step:
        device, rows = self.model.device, self.model.pass_rows(1)
        first = next(iter(plans.values()))[0]
        biases = {window: torch.empty_like(plan[0].groups[0].bias, device=device) for window, plan in plans.items()}
        inputs = torch.zeros(2 * rows + 1, dtype=torch.long, device=device)
        return _Step(inputs=inputs, ids=inputs[:rows].view(1, rows), positions=inputs[rows:2 * rows].view(1, rows),
                     slot=inputs[2 * rows:], tail_slots=torch.zeros_like(first.tail_slots, device=device),
                     biases=biases)

    def _fill(self, step: _Step, token: int, plans: dict) -> None:
        """The step's inputs into the graph's buffers, copied from pinned host memory without blocking: the
        token's id (then padding zeros), its position (the cache's length) repeated and its slot (the same)."""
        rows = step.ids.shape[1]
        inputs = torch.full((2 * rows + 1,), self.cache.length, dtype=torch.long)
        inputs[:rows] = 0
        inputs[0] = token
        host = [(step.inputs, inputs)] + [(step.biases[window], plan[0].groups[0].bias) for window, plan in plans.items()]
        for buffer, values in host:
            buffer.copy_(values.pin_memory(), non_blocking=True)

    def _forward(self, step: _Step, head: int) -> torch.Tensor:
        """The decode pass on the step's buffers (what a capture records): ``[1, hidden]``."""
        plans = {window: (AttentionPlan(step.tail_slots, (AttentionGroup(head, None, bias),), None, head),)
                 for window, bias in step.biases.items()}
        slots = PassSlots([self.cache], [1], at=step.slot)
        return self.model(step.ids, step.positions, slots, None, plans)[0, :1]
