"""Every setting of an ``add-heads`` run, in one dataclass (a recipe's ``settings`` and the CLI's
options fill it; ``mtp_config.json`` records it), and the defaults that depend on the device and the
target (:func:`resolve_settings`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

import torch

from mtpctl.decode.attention import MAX_DRAFT_DEPTH
from mtpctl.drafters.heads.config import KINDS
from mtpctl.errors import BadInput
from mtpctl.train.magpie import MagpieSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: what add-heads trains: the head kinds of a head folder, and the checkpoint's own MTP layers
TRAINED_KINDS = KINDS + ("mtp",)


@dataclass
class TrainSettings:
    """Every setting of an ``add-heads`` run (recorded in ``mtp_config.json``)."""

    kind: str = "medusa"
    num_heads: int = 4
    head_layers: int = 1
    own_lm_head: bool = False
    draft_vocab: int = 0  # score only the N most frequent target predictions (0 = the full vocabulary)
    condition_on_token: bool = False  # heads also read the pending token's embedding (HeadsConfig.token_conditioned)
    self_distill: bool = False  # prompts get responses written by the target
    response_tokens: int = 128  # longest self-distilled response
    distill_batch: int = 32  # prompts decoded together
    distill_dtype: str = "bfloat16"
    features_dtype: Optional[str] = None  # the target's teacher-forced pass (None: bfloat16 on CUDA, float32 on CPU)
    target_dtype: Optional[str] = None  # the target's embedding and lm_head while heads train; bfloat16 trains
    # under autocast (None: bfloat16 on CUDA, float32 on the CPU)
    shard_positions: int = 0  # positions per feature shard at most (0: about SHARD_BYTES of features a shard)
    max_seq_len: int = 512  # longer sequences are cut
    soft_labels: bool = False  # KL to the target's top-m distribution instead of CE to its argmax
    soft_top: int = 16  # m
    epochs: float = 2.0
    steps: int = 0  # optimizer steps (0: from epochs)
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: float = 0.05  # fraction of the optimizer steps
    batch_tokens: int = 256  # positions per optimizer micro-batch
    grad_accum: int = 1
    head_decay: float = 0.8  # loss weight of head k is head_decay ** (k - 1)
    holdout: float = 0.05  # fraction of sequences held out for accuracy
    measure_prompts: int = 16  # held-out prompts decoded at the end to measure tau (0: none; mtpctl.train.measure)
    tree_nodes: int = 4  # nodes of the default draft tree (the size generate uses by default, session.DEFAULT_TREE_NODES)
    seed: int = 0
    aux_layers: Optional[List[int]] = None  # eagle3: the target layers it reads (None: the engines' default)
    magpie: Optional[MagpieSettings] = None  # prompts the target writes itself, added to the data (a mapping in a recipe)

    def __post_init__(self):
        self.magpie = MagpieSettings.from_value(self.magpie)

    @property
    def magpie_count(self) -> int:
        """Magpie requests to draw (0 without Magpie settings)."""
        return self.magpie.count if self.magpie is not None else 0

    def check(self) -> None:
        """Raise BadInput on a setting that cannot work."""
        if self.kind not in TRAINED_KINDS:
            raise BadInput(f"head kind {self.kind!r} is not available (choose from {', '.join(TRAINED_KINDS)})")
        for name in ("num_heads", "batch_tokens", "grad_accum", "response_tokens", "distill_batch",
                     "tree_nodes", "soft_top"):
            if getattr(self, name) < 1:
                raise BadInput(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_seq_len < 2:
            raise BadInput(f"max-seq-len must be at least 2, got {self.max_seq_len} (a training sequence needs "
                           "two tokens)")
        if self.head_layers < 0 or self.draft_vocab < 0:
            raise BadInput("head-layers and draft-vocab must be >= 0")
        if not self.epochs > 0 or not self.lr > 0:
            raise BadInput(f"epochs and lr must be > 0, got {self.epochs} and {self.lr}")
        if not 0 < self.holdout < 1 or not 0 <= self.warmup < 1 or not 0 < self.head_decay <= 1:
            raise BadInput("holdout must be in (0, 1), warmup in [0, 1), head-decay in (0, 1]")
        if self.kind == "eagle" and self.own_lm_head:
            raise BadInput("eagle heads project through the target's lm_head, not their own", option="own_lm_head")
        if self.kind in ("eagle", "eagle3") and self.condition_on_token:
            raise BadInput(f"an {self.kind} head always reads the next token: it takes no token conditioning",
                           option="condition_on_token")
        if self.kind in ("eagle", "eagle3") and self.soft_labels:
            raise BadInput(f"{self.kind} heads train on the target's argmax only, not soft labels", option="soft_labels")
        if self.aux_layers is not None and (self.kind != "eagle3" or not isinstance(self.aux_layers, list)
                                            or not self.aux_layers):
            raise BadInput("aux-layers is a non-empty list of target layer ids, for eagle3 heads only")
        if self.num_heads > MAX_DRAFT_DEPTH:
            raise BadInput(f"num-heads must be at most {MAX_DRAFT_DEPTH} (the deepest draft tree verification "
                           f"supports), got {self.num_heads}")
        if self.steps < 0:
            raise BadInput(f"steps must be >= 0, got {self.steps}", option="steps")
        if self.kind == "mtp":
            self._check_mtp()
        if self.measure_prompts < 0:
            raise BadInput(f"measure-prompts must be >= 0, got {self.measure_prompts}", option="measure_prompts")
        if self.shard_positions < 0:
            raise BadInput(f"shard-positions must be >= 0, got {self.shard_positions}", option="shard_positions")
        if self.magpie is not None:
            self.magpie.check()
            if self.magpie.count and not self.self_distill:
                raise BadInput("Magpie prompts need self-distillation: the target answers them", option="self_distill")
        for name in ("distill_dtype", "features_dtype", "target_dtype"):
            value = getattr(self, name)
            if value not in DTYPES and not (value is None and name != "distill_dtype"):
                raise BadInput(f"{name.replace('_', ' ')} {value!r}: choose from {', '.join(DTYPES)}", option=name)

    def _check_mtp(self) -> None:
        """The settings native MTP layers cannot take: they draft through their own layer from the
        target's argmax, over the full vocabulary, in float32."""
        for name in ("own_lm_head", "soft_labels", "condition_on_token", "draft_vocab", "aux_layers"):
            if getattr(self, name):
                raise BadInput(f"native MTP layers take no {name.replace('_', '-')} (they train on the target's argmax "
                               "through their own layer)", option=name)
        if self.target_dtype not in (None, "float32"):
            raise BadInput(f"native MTP layers train in float32, not target dtype {self.target_dtype}",
                           option="target_dtype")


#: bytes of features a shard holds at most when ``shard_positions`` is 0 (what one process reads at once)
SHARD_BYTES = 256 << 20


def position_bytes(settings: TrainSettings, hidden_size: int) -> int:
    """Bytes one position takes in a feature shard: the hidden state (bfloat16), the prediction and
    the input id (int64 each), EAGLE-3's aux streams (bfloat16) and soft labels (int32 + bfloat16)."""
    streams = 1 + (len(settings.aux_layers or ()) if settings.kind == "eagle3" else 0)
    soft = settings.soft_top * 6 if settings.soft_labels else 0
    return 2 * hidden_size * streams + 16 + soft


def resolve_settings(settings: TrainSettings, hidden_size: int, context: int, device: torch.device) -> TrainSettings:
    """The settings with every device- or target-dependent default made concrete: ``max_seq_len``
    capped at the target's ``context``, ``features_dtype`` and ``target_dtype`` bfloat16 on CUDA and
    float32 on the CPU when not given, ``shard_positions`` from :data:`SHARD_BYTES` when 0 (EAGLE-3's
    ``aux_layers`` must already be resolved)."""
    default = "bfloat16" if device.type == "cuda" else "float32"
    target_default = "float32" if settings.kind == "mtp" else default  # MTP layers train in float32
    shard = settings.shard_positions or max(1, SHARD_BYTES // position_bytes(settings, hidden_size))
    return replace(settings, max_seq_len=min(settings.max_seq_len, context),
                   features_dtype=settings.features_dtype or default, target_dtype=settings.target_dtype or target_default,
                   shard_positions=shard)
