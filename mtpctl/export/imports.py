"""``mtpctl models import-heads SRC --target MODEL --out DIR``: heads published in a serving engine's or
a training project's layout, read strictly into mtpctl's own head folder, bound to the target's
weights (their sha256), so that they decode, export and bench like heads ``add-heads`` trained.

Layouts read (:func:`read_layout` detects which from ``config.json`` and the tensor names):

- Medusa, the original repository's (FasterDecoding: ``medusa_lm_head.pt`` or ``.safetensors``) and
  TensorRT-LLM's input, and vLLM's Medusa layout (:mod:`~mtpctl.export.medusa_layouts`);
- EAGLE-3 in the speculators layout and in the EAGLE authors' / SpecForge layout, with ``d2t`` /
  ``t2d``, and EAGLE-1 in both (:mod:`~mtpctl.export.eagle_layouts`; EAGLE-1 becomes an ``eagle``
  head with ``layer.eagle1``: ``fc`` with a bias, no norm before the attention nor after the MLP).

Pickles (``.pt``, ``.bin``, ``.pth``) are read with torch's tensor-only unpickler
(``weights_only=True``): a file that holds anything but a flat mapping of names to plain tensors is
refused with one line, and nothing in it runs. Everything else is strict: missing, unexpected,
mis-shaped or non-finite tensors, heads for another hidden size or vocabulary, are each one error
(exit code 2). What the files leave unsaid or get wrong (a head count in ``config.json`` that the
tensors contradict, target layers not named) is decided as the engines decide it and reported in
``notes``.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Tuple, Union

import torch

from mtpctl.drafters.heads.eagle import EagleHead
from mtpctl.drafters.heads.eagle3 import Eagle3Head, check_aux_layers
from mtpctl.drafters.heads.folder import save_heads
from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel
from mtpctl.export import eagle_layouts, medusa_layouts
from mtpctl.files import output_folder
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import Decoder
from mtpctl.model.weights import EMBEDDING, check_tensors, read_lm_head, read_vocab_tensor, weights_hash
from mtpctl.version import __version__

PICKLES = (".pt", ".bin", ".pth")


@dataclass(frozen=True)
class TargetWeights:
    """What importing heads reads of the target: its config, and its lm_head and embedding
    ``[vocab, hidden]`` as float32, each read only when called (:meth:`from_folder` reads the one
    tensor from its safetensors file; the rest of the checkpoint stays on disk)."""

    cfg: DecoderConfig
    lm_head: Callable[[], torch.Tensor]
    embedding: Callable[[], torch.Tensor]

    @classmethod
    def from_folder(cls, folder: Path) -> "TargetWeights":
        """The checkpoint in ``folder``: its ``config.json`` now, a tensor when asked.

        Raises:
            CorruptModel, UnsupportedModel: an unreadable or unsupported ``config.json`` (the tensors
                raise CorruptModel when read: see :func:`mtpctl.model.weights.read_vocab_tensor`).
        """
        folder = Path(folder)
        cfg = DecoderConfig.from_folder(folder)
        return cls(cfg, lambda: read_lm_head(folder, cfg).float(),
                   lambda: read_vocab_tensor(folder, cfg, EMBEDDING).float())

    @classmethod
    def from_model(cls, model: Decoder) -> "TargetWeights":
        """A target already loaded."""
        return cls(model.cfg, lambda: model.dense_lm_head().float(), lambda: model.embed.detach().float())


def read_pickle(path: Path) -> Dict[str, torch.Tensor]:
    """A pickled state dict, unpickled tensor-only: name -> plain tensor.

    Raises:
        BadInput: the file holds something else than a flat mapping of names to tensors (it was not run).
        CorruptModel: an unreadable file.
    """
    try:
        raw = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise BadInput(f"{path} holds objects other than tensors, refused unread (tensor-only unpickling: "
                       f"{first})") from err
    except (OSError, RuntimeError, EOFError, ValueError) as err:
        raise CorruptModel(f"{path} is not a readable PyTorch file ({err})") from err
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise BadInput(f"{path} holds a {type(raw).__name__}, not a mapping of tensor names to tensors")
    bad = [k for k, v in raw.items() if type(v) not in (torch.Tensor, torch.nn.Parameter)]
    if bad:
        raise BadInput(f"{path}: {bad[0]!r} is a {type(raw[bad[0]]).__name__}, not a tensor; only plain tensors are read")
    return {k: v.detach() for k, v in raw.items()}


def read_safetensors(path: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of a safetensors file. Raises CorruptModel when it cannot be read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError) as err:
        raise CorruptModel(f"{path} is not a readable safetensors file ({err})") from err


def read_source(src: Path) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """``config.json`` (an empty mapping where there is none) and the tensors of a head folder, or of
    one weights file (with the ``config.json`` beside it): safetensors where the folder has any,
    else its pickles.

    Raises:
        BadInput: no such file or folder, no weights in it, a tensor name in two files, a config
            that is not a JSON object; see :func:`read_pickle`. CorruptModel: unreadable files.
    """
    src = Path(src)
    if not src.exists():
        raise BadInput(f"{src} does not exist", option="src")
    folder = src if src.is_dir() else src.parent
    files = [src] if src.is_file() else (sorted(src.glob("*.safetensors")) or
                                          sorted(p for p in src.iterdir() if p.suffix in PICKLES))
    if not files:
        raise BadInput(f"{src} holds no heads' weights (*.safetensors, or {', '.join(PICKLES)} pickles)", option="src")
    tensors: Dict[str, torch.Tensor] = {}
    for path in files:
        part = read_safetensors(path) if path.suffix == ".safetensors" else read_pickle(path)
        twice = set(part) & set(tensors)
        if twice:
            raise BadInput(f"tensor {sorted(twice)[0]!r} is in two files of {folder}")
        tensors.update(part)
    config = {}
    if (folder / "config.json").is_file():
        try:
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise BadInput(f"{folder / 'config.json'} is not readable JSON ({err})") from err
        if not isinstance(config, dict):
            raise BadInput(f"{folder / 'config.json'} is not a JSON object")
    return config, tensors


def read_layout(src: Path, target: Union[TargetWeights, Decoder], notes: List[str]) -> Tuple[str, torch.nn.Module]:
    """The heads in ``src`` (folder or file), in whichever supported layout they are, checked strictly
    against ``target`` (a :class:`TargetWeights`, or a loaded model): (layout, :class:`MedusaHeads`,
    :class:`EagleHead` or :class:`Eagle3Head`, float32, frozen).
    ``notes`` gets one line per quirk decided on the way.

    Raises:
        BadInput: see :func:`read_source`; heads for another hidden size, vocabulary or layer count.
        CorruptModel: missing, unexpected, mis-shaped or non-finite tensors.
        UnsupportedModel: a variant mtpctl does not run (EAGLE-3's norm_before_fc, fc_norm, norm_output;
            EAGLE-1 with layernorms; embeddings of their own).
    """
    if isinstance(target, Decoder):
        target = TargetWeights.from_model(target)
    config, tensors = read_source(src)
    names = set(tensors)
    layout = eagle_layouts.detect(config, names) or medusa_layouts.detect(config, names)
    if layout in ("vllm", "medusa"):
        return layout, medusa_layouts.read_medusa(layout, config, tensors, target.lm_head(), notes)
    if layout is None:
        raise BadInput(f"{src} is not a layout mtpctl imports (Medusa: FasterDecoding, TensorRT-LLM or vLLM; "
                       "EAGLE-1 and EAGLE-3: speculators or EAGLE/SpecForge)", option="src")
    _drop_target_embedding(tensors, target, notes)
    if layout in eagle_layouts.EAGLE1_PREFIX:
        return layout, _read_eagle1(layout, config, tensors, target)
    return layout, _read_eagle3(layout, config, tensors, target, notes)


def _drop_target_embedding(tensors: Dict[str, torch.Tensor], target: TargetWeights, notes: List[str]) -> None:
    """Drop an ``embed_tokens.weight`` that is the target's embedding (EAGLE checkpoints may carry a
    copy); UnsupportedModel for embeddings of their own (mtpctl's EAGLE layers read the target's)."""
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is None:
        return
    shape = (target.cfg.vocab_size, target.cfg.hidden_size)
    if tuple(embed.shape) != shape or not torch.equal(embed.float(), target.embedding()):
        raise UnsupportedModel("these heads carry embeddings of their own, not the target's; mtpctl's EAGLE layers "
                               "read the target's")
    notes.append("embed_tokens.weight is the target's embedding: dropped (the heads read the target's)")


def _check_target(hidden: int, vocab: int, target: TargetWeights) -> None:
    tc = target.cfg
    if hidden != tc.hidden_size or vocab != tc.vocab_size:
        raise BadInput(f"these heads were made for a model with hidden size {hidden} and vocabulary {vocab}; the "
                       f"target has {tc.hidden_size} and {tc.vocab_size}")


def _read_eagle1(layout: str, config: dict, tensors: Dict[str, torch.Tensor], target: TargetWeights) -> EagleHead:
    cfg = eagle_layouts.eagle1_config(config, layout, target.cfg)
    _check_target(cfg.hidden_size, cfg.vocab_size, target)
    bias = eagle_layouts.EAGLE1_PREFIX[layout][0] + "bias" in tensors
    check_tensors(tensors, eagle_layouts.eagle1_shapes(cfg, layout, bias), source=f"{layout} EAGLE-1 heads")
    head = EagleHead(cfg, torch.float32)
    head.load_state_dict({k: v.float() for k, v in eagle_layouts.eagle1_state_dict(cfg, layout, tensors).items()})
    return head.requires_grad_(False)


def _read_eagle3(layout: str, config: dict, tensors: Dict[str, torch.Tensor], target: TargetWeights,
                 notes: List[str]) -> Eagle3Head:
    cfg = eagle_layouts.heads_config(config, layout, target.cfg, notes)
    _check_target(cfg.hidden_size, cfg.vocab_size, target)
    try:
        check_aux_layers(cfg.layer.aux_layers, target.cfg.num_hidden_layers)
    except ValueError as err:
        raise BadInput(str(err)) from err
    check_tensors(tensors, eagle_layouts.expected_shapes(cfg, layout), source=f"{layout} EAGLE-3 heads")
    state, token_map = eagle_layouts.state_dict(cfg, layout, tensors)
    head = Eagle3Head(cfg, torch.float32, target.lm_head(), token_map)
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return head.requires_grad_(False)


def import_heads(src: Path, target_folder: Path, target_name: str, out: Path, overwrite: bool = False) -> dict:
    """Read the heads in ``src`` for the checkpoint in ``target_folder`` and write them to ``out`` as an
    mtpctl head folder (atomically), bound to the target's weights sha256. Returns a summary:
    ``layout``, ``kind``, ``num_heads``, ``draft_vocab_size``, ``notes``, ``out``.

    The target is not loaded: its ``config.json`` is read, its weights hashed, and only the tensors
    the heads need read alone (:class:`TargetWeights`): the lm_head (the embedding of a tied
    checkpoint), and the embedding where the heads carry a copy of it to compare.

    Raises:
        BadInput, CorruptModel, UnsupportedModel: see :func:`read_layout`; ``out`` exists without
            ``overwrite``.
    """
    notes: List[str] = []
    with output_folder(Path(out), overwrite) as tmp:
        target = TargetWeights.from_folder(Path(target_folder))
        layout, heads = read_layout(Path(src), target, notes)
        cfg = heads.cfg
        cfg.target, cfg.target_hash, cfg.mtpctl_version = target_name, weights_hash(Path(target_folder)), __version__
        cfg.tree = cfg.tree or [[0] * d for d in range(1, cfg.num_heads + 1)]
        cfg.training = {"imported_from": str(Path(src).resolve()), "layout": layout, "notes": list(notes)}
        save_heads(heads, tmp)
    return {"out": str(out), "layout": layout, "kind": cfg.kind, "num_heads": cfg.num_heads,
            "draft_vocab_size": cfg.draft_vocab_size, "notes": notes}
