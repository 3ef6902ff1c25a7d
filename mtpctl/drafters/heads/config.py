"""The head folder's configuration (``mtp_config.json``, format version 1): what kind of MTP heads a
folder holds, their shapes, the target they were trained for and their held-out figures.

A head folder holds ``mtp_config.json`` (:class:`HeadsConfig`) and ``mtp_heads.safetensors``
(:mod:`mtpctl.drafters.heads.folder`); the target's weights are referenced by their sha256
(:func:`mtpctl.model.weights.weights_hash`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel

FORMAT_VERSION = 1
CONFIG_FILE = "mtp_config.json"
WEIGHTS_FILE = "mtp_heads.safetensors"
KINDS = ("medusa", "hydra", "eagle", "eagle3")
LAYER_KINDS = ("eagle", "eagle3")  # kinds with one draft decoder layer (HeadsConfig.layer)


@dataclass
class EagleLayerConfig:
    """Shapes of the EAGLE layer (recorded in ``mtp_config.json`` as ``layer``); by default those of
    one of the target's own decoder layers.

    EAGLE-3 (kind ``eagle3``) also records ``aux_layers``, the target layers whose residual streams
    it fuses (ids as in :meth:`mtpctl.model.decoder.Decoder.forward`: after that many layers), and
    ``norm_before_residual`` (the residual of its layer takes the fused feature after ``hidden_norm``
    rather than before it; speculators' option of that name). ``eagle1`` (kind ``eagle``, imported
    heads) is the EAGLE-1 authors' layer: ``fc`` with a bias, no norm before the attention nor after
    the MLP."""

    attention_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    aux_layers: Optional[List[int]] = None  # eagle3 only
    norm_before_residual: bool = False  # eagle3 only
    eagle1: bool = False  # eagle only: EAGLE-1's layer (imported heads)

    def __post_init__(self) -> None:
        sizes = (self.attention_heads, self.kv_heads, self.head_dim, self.intermediate_size)
        numbers = (self.rope_theta, self.rms_norm_eps)
        aux = self.aux_layers
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes) or \
                self.attention_heads % self.kv_heads or self.head_dim % 2 or \
                not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in numbers) or \
                not isinstance(self.norm_before_residual, bool) or not isinstance(self.eagle1, bool) or (aux is not None and (
                    not isinstance(aux, list) or not aux or
                    not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in aux))):
            raise ValueError(f"EAGLE layer shapes are not valid (positive integer sizes, heads divisible by "
                             f"KV heads, an even head_dim, rope_theta and rms_norm_eps > 0, aux_layers a "
                             f"non-empty list of layer ids >= 0): {self}")


@dataclass
class HeadsConfig:
    """What ``mtp_config.json`` records about a set of MTP heads (format version 1).

    ``tree`` is the default static draft tree (paths of top-k ranks, see :class:`StaticTree`);
    ``topk_accuracy[k][r]`` the held-out probability that head k+1's rank-r candidate is the target's
    token, from which trees of any size are built (:func:`tree_from_accuracy`).
    """

    kind: str  # "medusa", "hydra" (sequential heads; always token-conditioned), "eagle" or "eagle3" (one draft layer)
    num_heads: int  # K: the deepest draft (for eagle, the draft steps evaluated)
    head_layers: int  # residual blocks per head
    own_lm_head: bool  # a trainable vocabulary projection per head (else the target's lm_head)
    hidden_size: int
    vocab_size: int  # logits width of the target (rows of its lm_head)
    draft_vocab_size: int = 0  # heads score only this many frequent tokens (token_map); 0 = all
    token_conditioned: bool = False  # heads also read the pending token's embedding (see MedusaHeads)
    target: str = ""  # how the target was named when the heads were trained (alias, folder, repo id)
    target_hash: str = ""  # sha256 of the target's safetensors files
    tree: List[List[int]] = field(default_factory=list)
    topk_accuracy: List[List[float]] = field(default_factory=list)  # [K][ranks]
    training: dict = field(default_factory=dict)  # the settings and figures of the training run
    format_version: int = FORMAT_VERSION
    mtpctl_version: str = ""
    layer: Optional[EagleLayerConfig] = None  # eagle, eagle3: the draft layer's shapes (a mapping in the JSON)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"head kind {self.kind!r} is not one of the known kinds ({', '.join(KINDS)})")
        if self.kind == "hydra" and not self.token_conditioned:
            raise ValueError("hydra heads read tokens, so token_conditioned must be true")
        if isinstance(self.layer, dict):
            self.layer = EagleLayerConfig(**self.layer)
        elif self.layer is not None and not isinstance(self.layer, EagleLayerConfig):
            raise ValueError(f"layer must be a mapping of the draft layer's shapes, got {self.layer!r}")
        if (self.kind in LAYER_KINDS) != (self.layer is not None):
            raise ValueError("eagle and eagle3 heads, and only they, need the draft layer's shapes (layer)")
        if self.kind == "eagle" and self.own_lm_head:
            raise ValueError("eagle heads project through the target's lm_head (own_lm_head must be false)")
        if self.kind == "eagle3" and not (self.own_lm_head and self.layer.aux_layers):
            raise ValueError("eagle3 heads have their own lm_head (own_lm_head true) and read the target "
                             "layers of layer.aux_layers")
        if self.kind == "eagle" and (self.layer.aux_layers is not None or self.layer.norm_before_residual):
            raise ValueError("aux_layers and norm_before_residual belong to eagle3 heads")
        if self.kind == "eagle3" and self.layer.eagle1:
            raise ValueError("eagle1 is a variant of eagle heads")

    def save(self, folder: Path) -> None:
        """Write ``mtp_config.json`` into ``folder``."""
        (Path(folder) / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> "HeadsConfig":
        """Read and check ``folder/mtp_config.json``.

        Raises:
            BadInput: the folder or its config is missing (not a head folder).
            CorruptModel: the config is malformed.
            UnsupportedModel: a newer format version or an unknown head kind.
        """
        path = Path(folder) / CONFIG_FILE
        if not Path(folder).exists():
            raise BadInput(f"head folder {folder} does not exist; make one with mtpctl add-heads", option="heads_dir")
        if not path.is_file():
            raise BadInput(f"{folder} is not an MTP head folder (no {CONFIG_FILE}); make one with mtpctl add-heads",
                           option="heads_dir")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            version = raw.get("format_version")
            if not isinstance(version, int) or version > FORMAT_VERSION:
                raise UnsupportedModel(f"{path}: format_version {version!r}; this mtpctl reads up to "
                                       f"{FORMAT_VERSION} (upgrade mtpctl)")
            if raw.get("kind") not in KINDS:
                raise UnsupportedModel(f"{path}: head kind {raw.get('kind')!r} is not supported (known: "
                                       f"{', '.join(KINDS)})")
            cfg = cls(**raw)  # its size fields read by name below, each checked to be an integer
            if not all(isinstance(getattr(cfg, n), int) for n in ("num_heads", "head_layers", "hidden_size",
                                                                    "vocab_size", "draft_vocab_size")):
                raise ValueError("sizes must be integers")
        except (ValueError, TypeError, AttributeError) as err:
            raise CorruptModel(f"{path} is not a valid head config: {err}") from err
        if cfg.num_heads < 1 or cfg.head_layers < 0:
            raise CorruptModel(f"{path}: num_heads {cfg.num_heads} and head_layers {cfg.head_layers} are not valid")
        return cfg


def check_heads_match(cfg: HeadsConfig, hidden_size: int, vocab_size: int, target_hash: Optional[str]) -> None:
    """Raise BadInput unless heads of ``cfg`` were made for this target (sizes, and the weights'
    sha256 when ``target_hash`` is given)."""
    if cfg.hidden_size != hidden_size or cfg.vocab_size != vocab_size:
        raise BadInput(f"these heads were made for a model with hidden size {cfg.hidden_size} and vocabulary "
                       f"{cfg.vocab_size}; the target has {hidden_size} and {vocab_size} (train heads for it "
                       "with mtpctl add-heads)", option="heads_dir")
    if target_hash is not None and cfg.target_hash != target_hash:
        raise BadInput(f"these heads were trained on another model ({cfg.target}, weights sha256 "
                       f"{cfg.target_hash[:12]}...); the target's weights hash to {target_hash[:12]}... "
                       "(train heads for it with mtpctl add-heads)", option="heads_dir")
