"""EAGLE-3 heads in the layouts serving engines load, and the way back into
:class:`~mtpctl.drafters.heads.eagle3.Eagle3Head`.

Facts read from the engines' loaders (vLLM 0.32 ``model_executor/models/llama_eagle3.py`` and
``transformers_utils/configs/speculators/``, the ``speculators`` package's ``Eagle3SpeculatorConfig``,
the EAGLE / SpecForge checkpoints that SGLang and TensorRT-LLM's PyTorch backend read):

- **speculators** (vLLM's own format): ``config.json`` with ``speculators_model_type: eagle3``,
  ``architectures: [Eagle3Speculator]``, ``speculators_config`` (``algorithm``, ``proposal_methods``
  with ``speculative_tokens``, ``default_proposal_method``, ``verifier`` with ``name_or_path``, the
  target's name where it is served, and ``architectures``, the target's own),
  ``transformer_layer_config`` (a one-layer Llama config; its ``vocab_size`` is the target's),
  ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` and
  ``norm_before_residual``, always written: vLLM takes it as true when absent, the speculators
  package as false. Tensors in ``model.safetensors``: ``fc.weight [H, k H]``,
  ``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]``,
  ``layers.0.self_attn.{q,k,v}_proj.weight [*, 2H]`` (the layer reads [embedding ; feature]),
  ``layers.0.self_attn.o_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
  ``norm.weight [H]``, ``lm_head.weight [V_d, H]`` and, with a draft vocabulary, ``d2t [V_d]``
  (int64 offsets: target id = draft id + d2t[draft id]) and ``t2d [V]`` (bool: target id is in the
  draft vocabulary). No ``embed_tokens``: the engines share the target's.
- **eagle** (the EAGLE-3 authors' layout, SpecForge's, read by SGLang, by vLLM with
  ``method: eagle3`` and by TensorRT-LLM's PyTorch backend as ``speculative_model_dir``): the same
  tensors with ``midlayer.`` in place of ``layers.0.``, and a Llama ``config.json`` with
  ``architectures: [LlamaForCausalLMEagle3]``, ``num_hidden_layers: 1``, ``draft_vocab_size`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (engines that ignore the ids use
  ``(2, n // 2, n - 3)``, mtpctl's default).

Both configs also carry ``mtpctl`` (the head folder's config without its training record) so that
the way back restores the exact :class:`HeadsConfig`.

EAGLE-1 heads are read (imported, not written): the EAGLE authors' layout (``fc.weight [H, 2H]``,
``fc.bias``, ``layers.0.self_attn.*``, ``layers.0.mlp.*``, ``layers.0.post_attention_layernorm``, no
input layernorm; a Llama ``config.json``) and the speculators one (``speculators_model_type: eagle``:
``fusion_fc.*``, ``transformer.*``; ``layernorms: true`` is refused). Both concatenate
[embedding ; feature], which mtpctl's ``eagle`` layer reads as [feature ; embedding]: ``fc``'s two
halves swap places.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import torch

from mtpctl.drafters.heads.config import EagleLayerConfig, HeadsConfig
from mtpctl.drafters.heads.eagle3 import default_aux_layers
from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.export.entry import meta, mtpctl_entry
from mtpctl.model.config import DecoderConfig

LAYOUTS = ("speculators", "eagle")
PREFIX = {"speculators": "layers.0.", "eagle": "midlayer."}
WEIGHTS = "model.safetensors"
#: mtpctl's parameter -> the layer's tensor name(s) in the layouts (a fused mtpctl weight is split in rows)
LAYER = {"embed_norm": ("input_layernorm.weight",), "hidden_norm": ("hidden_norm.weight",),
         "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "o_proj": ("self_attn.o_proj.weight",), "post_attention_norm": ("post_attention_layernorm.weight",),
         "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "down": ("mlp.down_proj.weight",)}
TOP = {"fc": "fc.weight", "norm": "norm.weight", "lm_head": "lm_head.weight"}
#: EAGLE-3 variants vLLM knows and mtpctl's layer does not compute
VARIANTS = ("norm_before_fc", "fc_norm", "norm_output")


def _splits(cfg: HeadsConfig) -> Dict[str, List[int]]:
    """Row splits of mtpctl's fused weights into the layouts' tensors."""
    lc = cfg.layer
    q, kv = lc.attention_heads * lc.head_dim, lc.kv_heads * lc.head_dim
    return {"qkv": [q, kv, kv], "gate_up": [lc.intermediate_size] * 2}


def eagle3_tensors(cfg: HeadsConfig, state: Dict[str, torch.Tensor], layout: str) -> Dict[str, torch.Tensor]:
    """Tensor name -> tensor of EAGLE-3 heads of ``cfg`` in ``layout`` (speculators | eagle), from
    ``state``, the head folder's tensors by :class:`Eagle3Head`'s names. Weights keep their dtype
    (fused ones come back as row views); ``d2t`` is int64 and ``t2d`` bool."""
    out = {name: state[attr] for attr, name in TOP.items()}
    splits = _splits(cfg)
    for attr, names in LAYER.items():
        parts = state[attr].split(splits[attr]) if attr in splits else (state[attr],)
        out.update({PREFIX[layout] + name: part for name, part in zip(names, parts)})
    out = {k: v.detach() for k, v in out.items()}
    if cfg.draft_vocab_size:
        token_map = state["token_map"].long()
        out["d2t"] = token_map - torch.arange(len(token_map))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[token_map] = True
        out["t2d"] = t2d
    return out


def _layer_config(cfg: HeadsConfig, target: DecoderConfig, dtype: str) -> dict:
    """The draft layer as a one-layer Llama config (what the layouts' ``transformer_layer_config`` and
    the EAGLE layout's ``config.json`` hold), its weights in ``dtype``."""
    lc = cfg.layer
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": cfg.hidden_size,
            "intermediate_size": lc.intermediate_size, "num_attention_heads": lc.attention_heads,
            "num_key_value_heads": lc.kv_heads, "head_dim": lc.head_dim, "num_hidden_layers": 1,
            "hidden_act": "silu", "rms_norm_eps": lc.rms_norm_eps, "rope_theta": lc.rope_theta,
            "max_position_embeddings": target.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype}


def speculators_config(cfg: HeadsConfig, target: DecoderConfig, verifier: str, architectures: List[str],
                       dtype: str = "float32") -> dict:
    """The speculators layout's ``config.json`` for heads of ``cfg`` (weights in ``dtype``) made for
    ``target``: its ``verifier`` is the target's name where it is served (a hub id or a folder there)
    and ``architectures`` its own (its config.json's)."""
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": cfg.num_heads}],
                                   "verifier": {"name_or_path": verifier, "architectures": list(architectures)}},
            "transformer_layer_config": _layer_config(cfg, target, dtype),
            "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size, "target_hidden_size": cfg.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(cfg.layer.aux_layers),
            "norm_before_residual": cfg.layer.norm_before_residual, "torch_dtype": dtype, "mtpctl": meta(cfg)}


def eagle_config(cfg: HeadsConfig, target: DecoderConfig, dtype: str = "float32") -> dict:
    """The EAGLE-3 authors' layout's ``config.json`` (weights in ``dtype``)."""
    out = _layer_config(cfg, target, dtype)
    out.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=cfg.draft_vocab_size or cfg.vocab_size,
               target_hidden_size=cfg.hidden_size, norm_before_residual=cfg.layer.norm_before_residual,
               eagle_config={"eagle_aux_hidden_state_layer_ids": list(cfg.layer.aux_layers),
                             "use_aux_hidden_state": True},
               mtpctl=meta(cfg))
    return out


#: EAGLE-1 layout -> (prefix of fc, prefix of the layer)
EAGLE1_PREFIX = {"eagle1": ("fc.", "layers.0."), "speculators-eagle1": ("fusion_fc.", "transformer.")}
EAGLE1_LAYER = {"qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                "o_proj": ("self_attn.o_proj.weight",), "post_attention_norm": ("post_attention_layernorm.weight",),
                "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "down": ("mlp.down_proj.weight",)}


def detect(config: dict, names) -> Optional[str]:
    """``speculators`` or ``eagle`` (EAGLE-3), ``speculators-eagle1`` or ``eagle1`` (EAGLE-1) when
    ``config.json`` and the tensor names are heads in that layout, else None."""
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if config.get("speculators_model_type") == "eagle":
        return "speculators-eagle1"
    if any(n.startswith(PREFIX["eagle"]) for n in names) and "fc.weight" in names:
        return "eagle"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names) and \
            "layers.0.hidden_norm.weight" not in names:
        return "eagle1"
    return None


def expected_shapes(cfg: HeadsConfig, layout: str) -> Dict[str, tuple]:
    """Tensor name -> shape of heads of ``cfg`` in ``layout`` (``d2t``/``t2d`` with a draft vocabulary)."""
    lc, h = cfg.layer, cfg.hidden_size
    q, kv, i = lc.attention_heads * lc.head_dim, lc.kv_heads * lc.head_dim, lc.intermediate_size
    layer = {"input_layernorm.weight": (h,), "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
             "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    out = {PREFIX[layout] + k: v for k, v in layer.items()}
    out.update({"fc.weight": (h, len(lc.aux_layers) * h), "norm.weight": (h,),
                "lm_head.weight": (cfg.draft_vocab_size or cfg.vocab_size, h)})
    if cfg.draft_vocab_size:
        out.update({"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)})
    return out


def heads_config(config: dict, layout: str, target: DecoderConfig, notes: List[str]) -> HeadsConfig:
    """The :class:`HeadsConfig` of an EAGLE-3 layout's ``config.json`` (``mtpctl``'s own entry where
    present) for ``target``; ``notes`` gets a line for each value not given and taken as the engines do.

    Raises:
        CorruptModel: a config without the layer's shapes. UnsupportedModel: an EAGLE-3 variant mtpctl's
            layer does not compute (``norm_before_fc``, ``fc_norm``, ``norm_output``, more than one layer).
    """
    if isinstance(config.get("mtpctl"), dict):
        return mtpctl_entry(config, ("eagle3",))
    layer = config.get("transformer_layer_config", {}) if layout == "speculators" else config
    if not isinstance(layer, dict):
        raise CorruptModel("config.json's transformer_layer_config is not a mapping")
    extra = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    used = [v for v in VARIANTS if config.get(v) or extra.get(v)]
    if used or layer.get("num_hidden_layers", 1) != 1:
        raise UnsupportedModel(f"an EAGLE-3 variant mtpctl does not run ({', '.join(used) or 'several layers'})")
    hidden, shapes = _layer_shapes(layer)
    try:
        vocab = int(layer.get("vocab_size") or target.vocab_size)
        draft = int(config.get("draft_vocab_size") or vocab)
    except (TypeError, ValueError) as err:
        raise CorruptModel(f"config.json's vocabulary sizes are not numbers ({err})") from err
    ids = config.get("eagle_aux_hidden_state_layer_ids") or extra.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = list(default_aux_layers(target.num_hidden_layers))
        notes.append(f"the config names no target layers: reading {ids}, the engines' default")
    before = config.get("norm_before_residual")
    if before is None:
        before = False
        notes.append("the config does not say norm_before_residual: taken as false (the EAGLE-3 authors' layer "
                     "and the speculators package; vLLM would take true)")
    try:
        shapes = replace(shapes, aux_layers=list(ids), norm_before_residual=before)
    except (TypeError, ValueError) as err:
        raise CorruptModel(f"config.json's target layers {ids!r} or norm_before_residual {before!r} are not valid "
                           f"({err})") from err
    steps = _speculative_tokens(config)
    return HeadsConfig("eagle3", steps, 0, True, hidden, vocab, 0 if draft == vocab else draft, layer=shapes,
                       tree=[[0] * d for d in range(1, steps + 1)])


def _layer_shapes(layer: dict, **flags) -> Tuple[int, EagleLayerConfig]:
    """(hidden size, the draft layer's shapes) of a Llama layer config.

    Raises:
        CorruptModel: the shapes are missing or not valid.
    """
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        return hidden, EagleLayerConfig(heads, int(layer.get("num_key_value_heads", heads)),
                                        int(layer.get("head_dim") or hidden // heads), int(layer["intermediate_size"]),
                                        float(_rope_theta(layer)), float(layer.get("rms_norm_eps", 1e-6)), **flags)
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptModel(f"config.json lacks the draft layer's shapes ({err})") from err


def eagle1_config(config: dict, layout: str, target: DecoderConfig) -> HeadsConfig:
    """The :class:`HeadsConfig` (kind ``eagle``, ``layer.eagle1``) of EAGLE-1 heads for ``target``.

    Raises:
        CorruptModel: a config without the layer's shapes. UnsupportedModel: the speculators
            variant with layernorms, or several layers.
    """
    layer = config.get("transformer_layer_config", {}) if layout == "speculators-eagle1" else config
    if not isinstance(layer, dict):
        raise CorruptModel("config.json's transformer_layer_config is not a mapping")
    if config.get("layernorms") or layer.get("num_hidden_layers", 1) != 1:
        raise UnsupportedModel("an EAGLE-1 variant mtpctl does not run (layernorms, or several layers)")
    hidden, shapes = _layer_shapes(layer, eagle1=True)
    steps = _speculative_tokens(config, default=4)
    return HeadsConfig("eagle", steps, 0, False, hidden, target.vocab_size, layer=shapes,
                       tree=[[0] * d for d in range(1, steps + 1)])


def eagle1_shapes(cfg: HeadsConfig, layout: str, bias: bool) -> Dict[str, tuple]:
    """Tensor name -> shape of EAGLE-1 heads of ``cfg`` in ``layout`` (``fc``'s bias where ``bias``)."""
    lc, h = cfg.layer, cfg.hidden_size
    q, kv, i = lc.attention_heads * lc.head_dim, lc.kv_heads * lc.head_dim, lc.intermediate_size
    fc, prefix = EAGLE1_PREFIX[layout]
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
              "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    out = {prefix + k: v for k, v in shapes.items()}
    out[fc + "weight"] = (h, 2 * h)
    if bias:
        out[fc + "bias"] = (h,)
    return out


def eagle1_state_dict(cfg: HeadsConfig, layout: str, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """EAGLE-1 tensors (checked by :func:`eagle1_shapes`) -> an :class:`EagleHead` state dict: ``fc``'s
    [embedding ; feature] halves swapped to mtpctl's [feature ; embedding], a missing bias as zeros."""
    fc, prefix = EAGLE1_PREFIX[layout]
    h = cfg.hidden_size
    weight = tensors[fc + "weight"]
    out = {"fc": torch.cat((weight[:, h:], weight[:, :h]), dim=1),
           "fc_bias": tensors.get(fc + "bias", torch.zeros(h))}
    for attr, names in EAGLE1_LAYER.items():
        out[attr] = torch.cat([tensors[prefix + n] for n in names])
    return out


def _speculative_tokens(config: dict, default: int = 3) -> int:
    """The draft depth a speculators config proposes (``proposal_methods[0].speculative_tokens``), else ``default``.

    Raises:
        CorruptModel: a value that is not a positive integer.
    """
    try:
        value = config.get("speculators_config", {}).get("proposal_methods", [{}])[0].get("speculative_tokens")
    except (AttributeError, IndexError, TypeError) as err:
        raise CorruptModel(f"config.json's speculators_config is malformed ({err})") from err
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CorruptModel(f"config.json's speculative_tokens is {value!r}, not a positive integer")
    return value


def _rope_theta(layer: dict) -> float:
    params = layer.get("rope_parameters") if isinstance(layer.get("rope_parameters"), dict) else {}
    return layer.get("rope_theta") or params.get("rope_theta") or 10000.0


def state_dict(cfg: HeadsConfig, layout: str, tensors: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], Optional[torch.Tensor]]:
    """The layout's tensors (checked by name and shape against :func:`expected_shapes`) -> an
    :class:`Eagle3Head` state dict and its ``token_map`` (None without a draft vocabulary).

    Raises:
        CorruptModel: a d2t/t2d pair that does not describe one draft vocabulary inside the target's.
    """
    out = {attr: tensors[name] for attr, name in TOP.items()}
    for attr, names in LAYER.items():
        out[attr] = torch.cat([tensors[PREFIX[layout] + n] for n in names]) if len(names) > 1 else tensors[PREFIX[layout] + names[0]]
    token_map = None
    if cfg.draft_vocab_size:
        token_map = torch.arange(cfg.draft_vocab_size) + tensors["d2t"].long()
        t2d = tensors["t2d"].bool()
        if int(token_map.min()) < 0 or int(token_map.max()) >= cfg.vocab_size or \
                len(set(token_map.tolist())) != len(token_map) or int(t2d.sum()) != len(token_map) or \
                not bool(t2d[token_map].all()):
            raise CorruptModel("d2t and t2d do not describe one draft vocabulary inside the target's "
                               "(target id = draft id + d2t[draft id], t2d marking exactly those ids)")
        out["token_map"] = token_map
    return out, token_map
