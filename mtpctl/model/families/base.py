"""What a model family's description holds (:class:`Family`), and the Llama block's checkpoint
tensors that every family's tensor map is built from.

Pure data and small functions over a parsed ``config.json`` (a dict) or a
:class:`~mtpctl.model.config.DecoderConfig` (read by attribute): nothing here imports the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from mtpctl.model.families.mtp_layouts import MtpLayout

#: the config's dimensions a tensor's shape is written in (:meth:`Family.shapes`)
DIMS = {
    "h": lambda c: c.hidden_size,
    "i": lambda c: c.intermediate_size,
    "q": lambda c: c.num_attention_heads * c.head_dim,
    "kv": lambda c: c.num_key_value_heads * c.head_dim,
    "d": lambda c: c.head_dim,
    "V": lambda c: c.vocab_size,
    "e": lambda c: c.moe.num_experts,
    "mi": lambda c: c.moe.intermediate_size,
    "2mi": lambda c: 2 * c.moe.intermediate_size,
    "si": lambda c: c.moe.shared_intermediate_size,
    # multi-head latent attention (DeepSeek-V3; DecoderConfig.mla)
    "qr": lambda c: c.mla.q_lora_rank,
    "kvr": lambda c: c.mla.kv_lora_rank,
    "kva": lambda c: c.mla.kv_lora_rank + c.mla.qk_rope_head_dim,
    "qh": lambda c: c.num_attention_heads * c.mla.qk_head_dim,
    "kvb": lambda c: c.num_attention_heads * (c.mla.qk_nope_head_dim + c.mla.v_head_dim),
    "vh": lambda c: c.num_attention_heads * c.mla.v_head_dim,
    # gated attention (Qwen3.5): q_proj gives each head's query and its output gate
    "q2": lambda c: 2 * c.num_attention_heads * c.head_dim,
    # Gated DeltaNet layers (DecoderConfig.deltanet)
    "lqkv": lambda c: c.deltanet.conv_dim,
    "lv": lambda c: c.deltanet.value_dim,
    "lhv": lambda c: c.deltanet.num_v_heads,
    "ldv": lambda c: c.deltanet.v_head_dim,
    "lk": lambda c: c.deltanet.conv_kernel,
    "nh": lambda c: c.num_attention_heads,
    "lqkvz": lambda c: c.deltanet.conv_dim + c.deltanet.value_dim,  # Qwen3-Next's fused projections
    "2lhv": lambda c: 2 * c.deltanet.num_v_heads,
    "1": lambda c: 1,
}
#: the per-layer attention types of a config (Hugging Face's ``layer_types`` values)
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor and the parameter it fills.

    Attributes:
        name: its name in the checkpoint; a layer's tensor after the layer's prefix ``model.layers.{i}.``.
        shape: its dimensions, by :data:`DIMS` symbol.
        param: the :class:`~mtpctl.model.decoder.DecoderLayer` (or, for a model tensor,
            :class:`~mtpctl.model.decoder.Decoder`) parameter it fills; the tensors of one parameter are
            stacked by rows in table order (q, k, v -> ``qkv``; gate, up -> ``gate_up``).
        norm: a norm weight (held as ``norm_offset + w`` in float32 where the family has an offset).
        when: the :class:`~mtpctl.model.config.DecoderConfig` flag the tensor exists under
            (``attention_bias``, ``mlp_bias``: config.json's choice), or "" (always).
    """

    name: str
    shape: Tuple[str, ...]
    param: str
    norm: bool = False
    when: str = ""

    def _replace_when(self, when: str) -> "Tensor":
        return Tensor(self.name, self.shape, self.param, self.norm, when)


def _norm(name: str, param: str, dim: str = "h") -> Tensor:
    return Tensor(name + ".weight", (dim,), param, norm=True)


#: the model's own tensors (embeddings, final norm, lm_head; a tied lm_head is optional in a
#: checkpoint and follows the embeddings)
MODEL_TENSORS = (Tensor("model.embed_tokens.weight", ("V", "h"), "embed"),
                 _norm("model.norm", "norm"),
                 Tensor("lm_head.weight", ("V", "h"), "lm_head"))
#: Llama's pre-attention and pre-MLP norms
LLAMA_NORMS = (_norm("input_layernorm", "input_norm"), _norm("post_attention_layernorm", "post_attention_norm"))
#: the attention and MLP projections of the Llama block, fused at load time
PROJECTIONS = (Tensor("self_attn.q_proj.weight", ("q", "h"), "qkv"),
               Tensor("self_attn.k_proj.weight", ("kv", "h"), "qkv"),
               Tensor("self_attn.v_proj.weight", ("kv", "h"), "qkv"),
               Tensor("self_attn.o_proj.weight", ("h", "q"), "o_proj"),
               Tensor("mlp.gate_proj.weight", ("i", "h"), "gate_up"),
               Tensor("mlp.up_proj.weight", ("i", "h"), "gate_up"),
               Tensor("mlp.down_proj.weight", ("h", "i"), "down"))
#: projection biases, where config.json asks for them (``attention_bias``, ``mlp_bias``)
BIASES = (Tensor("self_attn.q_proj.bias", ("q",), "qkv_bias", when="attention_bias"),
          Tensor("self_attn.k_proj.bias", ("kv",), "qkv_bias", when="attention_bias"),
          Tensor("self_attn.v_proj.bias", ("kv",), "qkv_bias", when="attention_bias"),
          Tensor("mlp.gate_proj.bias", ("i",), "gate_up_bias", when="mlp_bias"),
          Tensor("mlp.up_proj.bias", ("i",), "gate_up_bias", when="mlp_bias"),
          Tensor("mlp.down_proj.bias", ("h",), "down_bias", when="mlp_bias"))
#: per-head query and key RMSNorm weights (Qwen3, Gemma 3)
QK_NORMS = (_norm("self_attn.q_norm", "q_norm", "d"), _norm("self_attn.k_norm", "k_norm", "d"))
#: the Llama block's tensors, in Hugging Face's order
LLAMA_LAYER = LLAMA_NORMS + PROJECTIONS + BIASES
#: per-head query and key RMSNorm weights where config.json asks for them (GLM-4.5's ``use_qk_norm``)
OPTIONAL_QK_NORMS = tuple(Tensor(t.name, t.shape, t.param, norm=True, when="qk_norm") for t in QK_NORMS)
#: multi-head latent attention's tensors (DeepSeek-V2/V3): the queries' low-rank pair (or one
#: ``q_proj``) and the shared latent's down projection are fused into ``qkv`` (both read the normed
#: input), the latent's up projection is ``kv_b``
MLA_ATTENTION = (Tensor("self_attn.q_a_proj.weight", ("qr", "h"), "qkv", when="q_lora"),
                 Tensor("self_attn.q_proj.weight", ("qh", "h"), "qkv", when="q_full"),
                 Tensor("self_attn.kv_a_proj_with_mqa.weight", ("kva", "h"), "qkv"),
                 Tensor("self_attn.q_a_proj.bias", ("qr",), "qkv_bias", when="q_lora_bias"),
                 Tensor("self_attn.kv_a_proj_with_mqa.bias", ("kva",), "qkv_bias", when="attention_bias"),
                 _norm("self_attn.q_a_layernorm", "q_a_norm", "qr")._replace_when("q_lora"),
                 Tensor("self_attn.q_b_proj.weight", ("qh", "qr"), "q_b", when="q_lora"),
                 _norm("self_attn.kv_a_layernorm", "kv_a_norm", "kvr"),
                 Tensor("self_attn.kv_b_proj.weight", ("kvb", "kvr"), "kv_b"),
                 Tensor("self_attn.o_proj.weight", ("h", "vh"), "o_proj"),
                 Tensor("self_attn.o_proj.bias", ("h",), "o_bias", when="attention_bias"))
#: the DeepSeek-V3 block's tensors (its dense MLP as Llama's, without biases)
MLA_LAYER = LLAMA_NORMS + MLA_ATTENTION + PROJECTIONS[4:]
#: a Gated DeltaNet layer's tensors (Qwen3.5's names), in Hugging Face's order: the input projections
#: stacked into ``in_proj`` (q, k, v, z, b, a), the convolution, the decay parameters, the gated norm's
#: weight (used as it is: not an offset norm) and the output projection
DELTANET_LAYER = (Tensor("linear_attn.A_log", ("lhv",), "a_log"),
                  Tensor("linear_attn.conv1d.weight", ("lqkv", "1", "lk"), "conv"),
                  Tensor("linear_attn.dt_bias", ("lhv",), "dt_bias"),
                  Tensor("linear_attn.in_proj_qkv.weight", ("lqkv", "h"), "in_proj"),
                  Tensor("linear_attn.in_proj_z.weight", ("lv", "h"), "in_proj"),
                  Tensor("linear_attn.in_proj_b.weight", ("lhv", "h"), "in_proj"),
                  Tensor("linear_attn.in_proj_a.weight", ("lhv", "h"), "in_proj"),
                  Tensor("linear_attn.norm.weight", ("ldv",), "gated_norm_weight"),
                  Tensor("linear_attn.out_proj.weight", ("h", "lv"), "out_proj"))
#: Qwen3-Next's Gated DeltaNet layer: the input projections fused per key head (``in_proj_qkvz``, then
#: ``in_proj_ba``), stacked into ``in_proj`` in that order and put in q, k, v, z, b, a order once loaded
#: (:attr:`Family.grouped_in_proj`)
GROUPED_DELTANET_LAYER = DELTANET_LAYER[:3] + \
    (Tensor("linear_attn.in_proj_qkvz.weight", ("lqkvz", "h"), "in_proj"),
     Tensor("linear_attn.in_proj_ba.weight", ("2lhv", "h"), "in_proj")) + DELTANET_LAYER[7:]


@dataclass(frozen=True)
class Block:
    """Which parts of the functional block (:class:`~mtpctl.model.decoder.DecoderLayer`, and the ONNX
    graph's :func:`~mtpctl.export.onnx._layer_step`) a family uses besides Llama's.

    Attributes:
        qk_norm: per-head RMSNorm on queries and keys before the rotary embedding (Qwen3, Gemma 3).
        norm_offset: RMSNorm weight applied as ``norm_offset + w``, scaled in float32 before the cast
            back (Gemma); 0 = Llama's ``w * x.to(dtype)``.
        sandwich_norms: RMSNorm on the attention and MLP outputs before each residual add, and a
            separate pre-MLP norm (Gemma 2/3: pre/post attention and pre/post feedforward norms).
        scaled_embeddings: embeddings multiplied by ``sqrt(hidden_size)`` (Gemma).
        partial_rotary: the rotary embedding turns the first ``int(head_dim * partial_rotary_factor)``
            values of each query/key head (rotate-half over those), the rest pass (GLM-4.5).
        mla: multi-head latent attention instead of GQA (DeepSeek-V3, :class:`~mtpctl.model.config.MlaConfig`).
        output_gate: ``q_proj`` gives each head's query then its output gate (``2 * head_dim`` rows a
            head); attention's output is multiplied by ``sigmoid(gate)`` before ``o_proj`` (Qwen3.5).
        linear_attention: the layers ``layer_types`` names ``linear_attention`` are Gated DeltaNet layers
            (:mod:`mtpctl.model.gated_deltanet`, ``DecoderConfig.deltanet``) instead of attention.
        attention_sinks: a learned logit per query head (``self_attn.sinks``) joins each softmax's
            denominator and takes no value (gpt-oss); ``o_proj`` has a bias with ``attention_bias``.
        yarn: the family's config may ask for YaRN rope scaling (MLA families may too).
        pair_rope: the rotary embedding turns adjacent pairs of values (2i, 2i+1) as complex numbers in
            float32 (Llama 4's ``apply_rotary_emb``; ERNIE 4.5's rotary, also in float32), not rotate-half.
        nope_layers: the config's ``no_rope_layers`` (else every ``no_rope_layer_interval``-th layer)
            names layers without a rotary embedding (Llama 4's NoPE layers); with
            ``attn_temperature_tuning`` their queries are scaled by position (``floor_scale``,
            ``attn_scale``).
        qk_l2_norm: with the config's ``use_qk_norm`` (default on), the rotary layers' queries and keys
            are RMS-normed per head without a weight after the rotary embedding (Llama 4).
        chunked_attention: the layers ``layer_types`` names ``chunked_attention`` (without it, the rotary
            layers) attend within chunks of ``attention_chunk_size`` positions
            (:class:`~mtpctl.model.config.Chunk`).
        o_bias: ``o_proj`` has a bias where config.json sets ``attention_bias`` (Llama 4).
    """

    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    scaled_embeddings: bool = False
    partial_rotary: bool = False
    mla: bool = False
    output_gate: bool = False
    linear_attention: bool = False
    attention_sinks: bool = False
    yarn: bool = False
    pair_rope: bool = False
    nope_layers: bool = False
    qk_l2_norm: bool = False
    chunked_attention: bool = False
    o_bias: bool = False


def every_layer_slides(cfg: dict, layers: int) -> List[str]:
    """Layer types of a config with a sliding window and no ``layer_types``: every layer slides
    (Mistral's rule)."""
    return [SLIDING] * layers


#: the parameters of a dense layer's MLP, which a MoE layer holds none of
DENSE_MLP = ("gate_up", "down", "gate_up_bias", "down_bias")


@dataclass(frozen=True)
class Experts:
    """Where a MoE layer's router and experts are in a checkpoint (the layer's block config:
    :class:`~mtpctl.model.moe.MoeConfig`, ``DecoderConfig.moe``). Two layouts load, chosen per layer from
    the checkpoint's names: the released one, one tensor per expert and projection
    (``{prefix}experts.{e}.{gate}.weight``, ...), which transformers 5's ``save_pretrained`` writes
    too; and transformers 5's in-memory one, the experts stacked
    (``{fused_prefix}experts.gate_up_proj [E, 2I, H]``, ``{fused_prefix}experts.down_proj [E, H, I]``),
    its ``state_dict``. Both fill the parameters ``router [E, H]``, ``experts_gate_up [E, 2I, H]``
    (each expert's gate rows, then its up rows) and ``experts_down [E, H, I]``.

    Attributes:
        prefix: the block's prefix in the per-expert layout (``mlp.``; Mixtral's ``block_sparse_moe.``).
        names: the per-expert projections' names: gate, up, down (Mixtral: ``w1``, ``w3``, ``w2``).
        fused_prefix: the block's prefix in the stacked layout (``mlp.`` for both).
        score_bias: the router's selection bias (``MoeConfig.score_bias``; parameter ``router_bias [E]``)
            after the block's prefix in the per-expert layout, and ``fused_score_bias`` in the stacked one
            (ERNIE 4.5: ``moe_statics.e_score_correction_bias``, ``gate.moe_statics.e_score_correction_bias``).
        score_bias_shape: its shape by :data:`DIMS` symbol (ERNIE 4.5: ``(1, E)``, read as ``[E]``).
    """

    prefix: str = "mlp."
    names: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    fused_prefix: str = "mlp."
    score_bias: str = "gate.e_score_correction_bias"
    fused_score_bias: str = "gate.e_score_correction_bias"
    score_bias_shape: Tuple[str, ...] = ("e",)

    def per_expert(self, names, layer: int) -> bool:
        """Whether checkpoint ``names`` (a set, or None: the stacked layout) hold layer ``layer``'s experts
        one tensor each."""
        if names is None:
            return False
        stem = f"model.layers.{layer}.{self.prefix}experts.0."
        return any(f"{stem}{n}.weight" in names for n in self.names)

    def tensors(self, cfg, per_expert: bool) -> Tuple[Tensor, ...]:
        """One MoE layer's router and expert tensors of ``cfg`` in either layout (then the router's
        ``e_score_correction_bias`` and the shared experts, with Qwen's ``shared_expert_gate``, where the config
        has them)."""
        p, bias = (self.prefix, self.score_bias) if per_expert else (self.fused_prefix, self.fused_score_bias)
        return self._routed(cfg, per_expert) + self._extras(cfg, p, bias)

    def _extras(self, cfg, p: str, bias: str) -> Tuple[Tensor, ...]:
        out = ()
        if cfg.moe.score_bias:
            out += (Tensor(p + bias, self.score_bias_shape, "router_bias"),)
        if cfg.moe.shared_intermediate_size:  # one gated shared expert (Qwen) or the shared experts as one MLP
            stem = p + ("shared_expert." if cfg.moe.shared_gate else "shared_experts.")
            out += (Tensor(stem + "gate_proj.weight", ("si", "h"), "shared_gate_up"),
                    Tensor(stem + "up_proj.weight", ("si", "h"), "shared_gate_up"),
                    Tensor(stem + "down_proj.weight", ("h", "si"), "shared_down"))
        if cfg.moe.shared_gate:
            out += (Tensor(p + "shared_expert_gate.weight", ("1", "h"), "shared_expert_gate"),)
        return out

    def _routed(self, cfg, per_expert: bool) -> Tuple[Tensor, ...]:
        if not per_expert:
            p = self.fused_prefix
            return (Tensor(p + "gate.weight", ("e", "h"), "router"),
                    Tensor(p + "experts.gate_up_proj", ("e", "2mi", "h"), "experts_gate_up"),
                    Tensor(p + "experts.down_proj", ("e", "h", "mi"), "experts_down"))
        out = [Tensor(self.prefix + "gate.weight", ("e", "h"), "router")]
        gate, up, down = self.names
        for e in range(cfg.moe.num_experts):
            stem = f"{self.prefix}experts.{e}."
            out += [Tensor(f"{stem}{gate}.weight", ("mi", "h"), "experts_gate_up"),
                    Tensor(f"{stem}{up}.weight", ("mi", "h"), "experts_gate_up"),
                    Tensor(f"{stem}{down}.weight", ("h", "mi"), "experts_down")]
        return tuple(out)


#: the kernel paths (:mod:`mtpctl.model.device`) that run a family's block
KERNELS = ("native", "torch")
#: what identifies a model's pass costs (:func:`mtpctl.decode.cost_table.model_identity`): key ->
#: DecoderConfig field, after its ``model_type``
COST_IDENTITY = (("hidden_size", "hidden_size"), ("intermediate_size", "intermediate_size"),
                 ("layers", "num_hidden_layers"), ("heads", "num_attention_heads"),
                 ("kv_heads", "num_key_value_heads"), ("vocab_size", "vocab_size"))


@dataclass(frozen=True)
class Family:
    """One architecture family, chosen by config.json's ``model_type`` (never by a model's name): how
    its config is read, its checkpoint's tensors, the parts of the block it uses, how serving engines
    and the exporter see it, and which kernels run it. Facts from each family's published
    architecture and its Hugging Face config class.

    Attributes:
        model_type: config.json's ``model_type``.
        architecture: its causal LM's Hugging Face architecture (``architectures`` of a serving
            engine's target config where config.json names none).
        layer_tensors: one layer's checkpoint tensors, in Hugging Face's order, and the parameters
            they fill (:class:`Tensor`).
        block: the parts of the functional block it uses (:class:`Block`).
        attention_bias: q/k/v projection bias when config.json has no ``attention_bias_key`` key.
        attention_bias_key: the config.json key that gives q/k/v biases (``attention_bias``); "" where the
            family's config class reads none (ERNIE 4.5's ``use_bias``, refused, gives every projection one).
        activation_key: the config key naming the MLP activation.
        defaults: values of config keys the family's config class fills in when config.json omits
            them (e.g. Gemma 3's rope bases, sliding window and query_pre_attn_scalar).
        layer_types: ``(config dict with defaults, layers) -> layer_types`` for a config with a
            sliding window and no ``layer_types`` (Mistral: every layer; Qwen2: from
            ``max_window_layers``; Gemma 3: every ``sliding_window_pattern``-th layer global).
        exportable: the ONNX export (:mod:`mtpctl.export.onnx`) reproduces its block.
        kernels: the kernel paths that run it (:data:`KERNELS`).
        native_stack: the native layer stack (all layers in one C call) may cover its block; it still
            checks the config and the weights (:meth:`mtpctl.model.decoder.Decoder.native_stack`).
        model_tensors: the model's own checkpoint tensors (:data:`MODEL_TENSORS`).
        experts: a Mixture-of-Experts family's router and experts (:class:`Experts`): its config.json is
            read into ``DecoderConfig.moe`` (:meth:`mtpctl.model.moe.MoeConfig.from_hf`), and the layers
            that config makes MoE hold them instead of the dense MLP; None: a dense family.
        qk_norm_key: the config.json key that turns the per-head QK-norm on (GLM-4.5's
            ``use_qk_norm``), where the family's block leaves it to the config; "" where it does not.
        mlp_bias_key: the config.json key that gives the dense MLP biases; "" where the family's MLP
            never has them (GLM-4.5, DeepSeek-V3).
        linear_tensors: a Gated DeltaNet layer's tensors (:data:`DELTANET_LAYER`), for a family with
            ``block.linear_attention``; the layers its config makes linear hold them instead of
            :attr:`layer_tensors`' attention (the norms and the MLP stay).
        grouped_in_proj: the Gated DeltaNet input projection's rows are grouped per key head in the
            checkpoint (Qwen3-Next's :data:`GROUPED_DELTANET_LAYER`); loading reorders them
            (:func:`mtpctl.model.gated_deltanet.grouped_rows`).
        ignored: name prefixes of checkpoint tensors the body does not read (Qwen3.5's ``mtp.``).
        text_config: config.json is a multimodal model's, the body's keys under ``text_config``
            (:meth:`text_part`).
        renames: (checkpoint prefix, the prefix the tensor map names) pairs: a multimodal checkpoint's
            text body under ``model.language_model.`` read as ``model.``.
        intermediate_key: the config key of the dense MLP's intermediate size (Llama 4's
            ``intermediate_size_mlp``; its ``intermediate_size`` is the experts').
        mtp_layout: where its checkpoints keep native MTP layers (:mod:`.mtp_layouts`), None where
            mtpctl reads none.
    """

    model_type: str
    architecture: str
    layer_tensors: Tuple[Tensor, ...] = LLAMA_LAYER
    block: Block = Block()
    attention_bias: bool = False
    attention_bias_key: str = "attention_bias"
    activation_key: str = "hidden_act"
    defaults: Tuple[Tuple[str, object], ...] = ()
    layer_types: Callable[[dict, int], List[str]] = every_layer_slides
    exportable: bool = True
    kernels: Tuple[str, ...] = KERNELS
    native_stack: bool = True
    model_tensors: Tuple[Tensor, ...] = MODEL_TENSORS
    experts: Optional[Experts] = None
    qk_norm_key: str = ""
    mlp_bias_key: str = "mlp_bias"
    linear_tensors: Tuple[Tensor, ...] = ()
    grouped_in_proj: bool = False
    ignored: Tuple[str, ...] = ()
    text_config: bool = False
    renames: Tuple[Tuple[str, str], ...] = ()
    intermediate_key: str = "intermediate_size"
    mtp_layout: Optional[MtpLayout] = None

    def text_part(self, cfg: dict) -> dict:
        """``cfg`` (a parsed config.json) as the body reads it: for a :attr:`text_config` family its
        ``text_config`` keys, with this ``model_type`` and the file's own ``tie_word_embeddings`` where it
        has one; ``cfg`` itself otherwise (or where it nests nothing)."""
        text = cfg.get("text_config") if self.text_config else None
        if not isinstance(text, dict):
            return cfg
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        return {**text, "model_type": self.model_type, "tie_word_embeddings": tie}

    def with_defaults(self, cfg: dict) -> dict:
        """``cfg`` (a parsed config.json) with the family's :attr:`defaults` where it omits them."""
        return {**dict(self.defaults), **cfg}

    def is_moe_layer(self, cfg, layer: int) -> bool:
        """Whether layer ``layer`` of ``cfg`` holds router and experts instead of the dense MLP."""
        moe = getattr(cfg, "moe", None)
        return self.experts is not None and moe is not None and moe.is_moe_layer(layer)

    def is_linear_layer(self, cfg, layer: int) -> bool:
        """Whether layer ``layer`` of ``cfg`` is a Gated DeltaNet layer instead of attention."""
        deltanet = getattr(cfg, "deltanet", None)
        return bool(self.linear_tensors) and deltanet is not None and deltanet.is_linear_layer(layer)

    def tensors(self, cfg, layer: Optional[int] = None, names=None) -> List[Tensor]:
        """The tensors a checkpoint of ``cfg`` (a DecoderConfig) holds: one layer's (names after its
        prefix) or, with ``layer`` None, the model's own; those of a flag ``cfg`` lacks left out. A MoE
        layer's experts in the layout checkpoint ``names`` hold them in (a set; None: the stacked one,
        :class:`Experts`)."""
        if layer is None:
            table = self.model_tensors
        else:
            table = self.layer_tensors
            if self.is_linear_layer(cfg, layer):  # a Gated DeltaNet layer's tensors instead of attention's
                table = tuple(t for t in table if not t.name.startswith("self_attn.")) + self.linear_tensors
            if self.is_moe_layer(cfg, layer):  # router and experts instead of the dense MLP
                table = tuple(t for t in table if t.param not in DENSE_MLP) + \
                    self.experts.tensors(cfg, self.experts.per_expert(names, layer))
        return [t for t in table if not t.when or getattr(cfg, t.when)]

    def shapes(self, cfg, names=None) -> Dict[str, tuple]:
        """Tensor name -> shape of every tensor of a checkpoint of ``cfg``: the model's own, then layer
        by layer (MoE layers' experts in the layout of checkpoint ``names``, :meth:`tensors`)."""
        def shape(t: Tensor) -> tuple:
            return tuple(DIMS[d](cfg) for d in t.shape)

        out = {t.name: shape(t) for t in self.tensors(cfg)}
        for n in range(cfg.num_hidden_layers):
            out.update((f"model.layers.{n}.{t.name}", shape(t)) for t in self.tensors(cfg, n, names))
        return out

    def slots(self, cfg, layer: Optional[int] = None, names=None) -> List[Tuple[str, Tuple[str, ...], bool]]:
        """(parameter, its checkpoint tensors' full names stacked by rows, is a norm) of one layer of
        ``cfg``, or with ``layer`` None of the model's own parameters, in table order (a tensor of more
        than two dims stacks as its rows of the last dim: expert after expert)."""
        prefix = "" if layer is None else f"model.layers.{layer}."
        out: Dict[str, Tuple[List[str], bool]] = {}
        for t in self.tensors(cfg, layer, names):
            out.setdefault(t.param, ([], t.norm))[0].append(prefix + t.name)
        return [(param, tuple(names), norm) for param, (names, norm) in out.items()]

    def cost_identity(self, cfg) -> dict:
        """What identifies the pass costs of a model of ``cfg``: its type and shape (a MoE model's
        expert count, experts per token and expert size too)."""
        out = {"model_type": self.model_type, **{key: getattr(cfg, field) for key, field in COST_IDENTITY}}
        moe = getattr(cfg, "moe", None)
        if self.experts is not None and moe is not None:
            out.update(experts=moe.num_experts, experts_per_token=moe.top_k,
                       expert_intermediate_size=moe.intermediate_size,
                       moe_layers=sum(moe.is_moe_layer(i) for i in range(cfg.num_hidden_layers)))
        return out
