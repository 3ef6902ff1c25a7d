"""Where a family's checkpoints keep their native MTP layers, and how the engines that run them read
their inputs: one :class:`MtpLayout` per layout, named by a family's description
(:attr:`~mtpctl.model.families.Family.mtp_layout`), read by :class:`mtpctl.drafters.mtp.MtpLayers`.

Every layout is the same computation (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.2):
row j reads the target's hidden state ``h_j`` after its final norm and the next token ``x_{j+1}``,
``u_j = proj [norm_e(embed(x_{j+1})) ; norm_h(h_j)]`` (or the hidden state first), one decoder block of the
family with its own KV cache, a final norm, and the target's (or the layer's own) lm_head. The layouts
differ in names, concatenation order, norm storage and what the engines feed a recursive step:

- :data:`DEEPSEEK` (glm4_moe, deepseek_v3): ``model.layers.{L + k}.{enorm, hnorm, eh_proj, shared_head.norm}``
  beside the block's own names, optional copies of the target's lm_head and embedding
  (``shared_head.head``, ``embed_tokens``); vLLM's ``deepseek_mtp.py`` / ``glm4_moe_mtp.py``.
- :data:`QWEN` (qwen3_5_text, qwen3_5, qwen3_5_moe_text, qwen3_5_moe, qwen3_next), as vLLM's
  ``qwen3_next_mtp.py`` and ``qwen3_5_mtp.py`` build it: ``mtp.fc [H, 2H]`` over
  ``[pre_fc_norm_embedding(e) ; pre_fc_norm_hidden(h)]`` (the embedding first), the block
  ``mtp.layers.{k}.*`` a decoder layer of the family built with ``layer_type="full_attention"`` (gated
  attention; the dense MLP or MoE block by the family's rule at layer index 0, as vLLM reads the index
  from ``mtp.layers.0``), ``mtp.norm``; every norm the family's ``1 + w`` (vLLM's ``Qwen3NextRMSNorm``
  and ``Qwen3_5RMSNorm`` are its ``GemmaRMSNorm``); no embedding or lm_head of its own (vLLM loads the
  target's ``embed_tokens`` and ``lm_head``); the count ``mtp_num_hidden_layers`` (vLLM's speculative
  config reads it for Qwen3.5, from ``text_config`` in the multimodal configs; its Qwen3-Next MTP reads
  ``num_nextn_predict_layers``, default 1, also accepted here). The predictor's forward returns the
  state after ``mtp.norm``, which its next step reads (``carry="normed"``), and it does not zero position
  0's embedding. ``mtp_use_dedicated_embeddings`` (false in the released configs) is refused.
- :data:`MIMO` (mimo), as vLLM's ``mimo_mtp.py`` (and Xiaomi's ``modeling_mimo.py``) read it:
  ``model.mtp_layers.{k}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}`` beside the
  Qwen2 decoder layer's own names (``self_attn.*``, ``mlp.*``, ``input_layernorm``,
  ``post_attention_layernorm``: vLLM adds its ``mtp_block.`` module prefix when loading, the checkpoint has
  none); ``input_proj`` over ``[hidden_layernorm(h) ; token_layernorm(e)]`` (the hidden state first);
  plain RMSNorms; position 0's embedding zeroed; the forward returns the state after ``final_layernorm``
  (``carry="normed"``); the target's embedding and lm_head; the count ``num_nextn_predict_layers``.

- :data:`ERNIE` (ernie4_5_moe), as released (the ``-PT`` checkpoints) and read by transformers' ``MtpModel``
  (its ``conversion_mapping.py`` renames ``mtp_block.{k}``, ``mtp_emb_norm.{k}``, ``mtp_hidden_norm.{k}``,
  ``mtp_linear_proj.{k}`` after the ``model.`` prefix; ``Ernie4_5_MoePreTrainedModel._keys_shared_with_mtp``
  makes the body's ``model.norm`` the layer's post-norm), vLLM's ``ernie_mtp.py`` and Baidu's FastDeploy
  (``ernie4_5_mtp.py``): ``model.mtp_block.{k}.*`` a decoder layer of the family at layer index 0 (dense
  where ``moe_layer_start_index`` > 0, as released: transformers' ``Ernie4_5_MoeDecoderLayer(config, 0)``,
  vLLM's Llama layer, FastDeploy's layer ``mtp_block.0``), ``model.mtp_linear_proj.{k} [H, 2H]`` over
  ``[mtp_emb_norm(e) ; mtp_hidden_norm(h)]`` (the embedding first), plain RMSNorms, no final norm of its
  own: the body's ``model.norm`` (``final_norm=""``; transformers and FastDeploy apply it, vLLM applies
  none); the target's embedding and lm_head; the count ``num_nextn_predict_layers``. The defaults follow
  transformers and FastDeploy, whose forward returns the normed state (``carry="normed"``) and which do not
  zero position 0's embedding (vLLM does). Paddle's training code (PaddleFormers' ``Ernie4_5_Model``) feeds
  the MTP layers the body's output before ``model.norm`` and chains depths on the raw block output; the
  engines above, and mtpctl, read the normed hidden state.

Pure data: nothing here imports the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, Optional, Tuple

from mtpctl.errors import BadInput

#: MtpSettings.carry values
CARRIES = ("raw", "normed")


@dataclass(frozen=True)
class MtpSettings:
    """Where the engines running MTP layers differ (docs/heads.md, "Native MTP layers"); a field left
    None takes the layout's default (:meth:`MtpLayout.settings_for`).

    Attributes:
        carry: what a recursive step reads as the hidden state of the step before: ``raw`` (the block's
            output before the final norm: vLLM's DeepSeek/GLM and the DeepSeek-V3 report's ``h^k``) or
            ``normed`` (after it: transformers' ``MtpModel``; vLLM's Qwen and MiMo predictors, whose
            forward returns the normed state).
        zero_first_embedding: zero the token embedding of the row at position 0 (vLLM's
            ``inputs_embeds[positions == 0] = 0`` in its DeepSeek and MiMo layers); transformers does not.
        own_vocab: use the layer's own embedding / lm_head copies where the layout has them and the
            checkpoint holds them (vLLM); False: the target's embedding and lm_head always (transformers).
        hidden_first: the projection reads ``[norm_h(h) ; norm_e(e)]`` instead of ``[norm_e(e) ; norm_h(h)]``
            (MiMo's order; transformers' ``mtp_hidden_states_first`` for the others).
    """

    carry: Optional[str] = None
    zero_first_embedding: Optional[bool] = None
    own_vocab: Optional[bool] = None
    hidden_first: Optional[bool] = None

    def check(self) -> None:
        if self.carry is not None and self.carry not in CARRIES:
            raise BadInput(f"MTP carry {self.carry!r}: choose raw or normed", option="mtp")

    def over(self, defaults: "MtpSettings") -> "MtpSettings":
        """These settings, ``defaults``' value where a field is None."""
        return MtpSettings(**{f.name: getattr(defaults, f.name) if getattr(self, f.name) is None
                              else getattr(self, f.name) for f in fields(self)})


#: the roles of an MTP layer's own tensors besides its block, in the order :class:`MtpLayout` names them
ROLES = ("embedding_norm", "hidden_norm", "projection", "final_norm")


@dataclass(frozen=True)
class MtpLayout:
    """One checkpoint layout of native MTP layers. Names are templates of ``n``, the layer's number: its
    index k among the MTP layers, or ``num_hidden_layers + k`` with :attr:`after_body`.

    Attributes:
        prefix: what every name of the layer starts with (``model.layers.{n}.``, ``mtp.``).
        embedding_norm, hidden_norm: the RMSNorm weights ``[H]`` of the token embedding and of the
            target's hidden state, after :attr:`prefix`.
        projection: the ``[H, 2H]`` projection of the two, after :attr:`prefix`.
        final_norm: the RMSNorm ``[H]`` of the block's output before the lm_head, after :attr:`prefix`;
            "" where it is the body's own final norm (``model.norm``: ERNIE-4.5's layout).
        block: the decoder block's prefix after :attr:`prefix` ("" where its names sit beside the others);
            the block is one layer of the family under its own names (:attr:`block_config`).
        count_keys: the config.json keys that count the layers (the first present; a multimodal
            config's under its ``text_config``, :meth:`~mtpctl.model.families.Family.text_part`).
        after_body: ``n`` counts on from the body's layers (``num_hidden_layers + k``).
        hidden_first: the projection reads the hidden state first (the layout's concatenation order).
        offset_norms: the four norms and the block's are stored as ``w`` of ``offset + w`` (the family's
            ``Block.norm_offset``) and applied in float32, as the family's body norms are.
        head_copy, embedding_copy: optional copies of the target's lm_head and embedding ``[V, H]``
            after :attr:`prefix` ("" where the layout has none).
        block_config: config.json keys set for the one-layer block (besides ``num_hidden_layers``: 1):
            what makes layer 0 the MTP block (DeepSeek's MoE layer, Qwen's full-attention layer).
        refused: config.json (key, value) pairs of layout variants that are not read.
        transformers_reads: transformers' ``MtpModel`` reads the layout (``generate(use_mtp=True)``: the
            ``mtpctl bench --baseline transformers-mtp`` peer).
        settings: the defaults of :class:`MtpSettings` but ``hidden_first`` (the engine followed).
    """

    prefix: str
    embedding_norm: str
    hidden_norm: str
    projection: str
    final_norm: str
    block: str
    count_keys: Tuple[str, ...]
    after_body: bool = False
    hidden_first: bool = False
    offset_norms: bool = False
    head_copy: str = ""
    embedding_copy: str = ""
    block_config: Tuple[Tuple[str, object], ...] = ()
    refused: Tuple[Tuple[str, object], ...] = ()
    transformers_reads: bool = False
    settings: MtpSettings = MtpSettings(carry="raw", zero_first_embedding=False, own_vocab=True)

    def number(self, body_layers: int, k: int = 0) -> int:
        """The number ``n`` of MTP layer ``k`` of a body of ``body_layers`` layers."""
        return body_layers + k if self.after_body else k

    def names(self, n: int) -> Dict[str, str]:
        """Role (:data:`ROLES`, then ``head_copy``, ``embedding_copy``) -> name after the prefix of layer
        ``n``'s own tensors besides its block (roles the layout lacks left out)."""
        named = dict(zip(ROLES, (self.embedding_norm, self.hidden_norm, self.projection, self.final_norm)))
        named.update(head_copy=self.head_copy, embedding_copy=self.embedding_copy)
        return {role: name.format(n=n) for role, name in named.items() if name}

    def tensor_prefixes(self, body_layers: int, count: int) -> Tuple[str, ...]:
        """Name prefixes of all ``count`` MTP layers' tensors (the body leaves them to the MTP reader)."""
        out = []
        for k in range(count):
            n = self.number(body_layers, k)
            prefix = self.prefix.format(n=n)
            out += [prefix + self.block.format(n=n)] + [prefix + name for name in self.names(n).values()]
        return tuple(dict.fromkeys(out))

    def settings_for(self, given: MtpSettings) -> MtpSettings:
        """``given`` with this layout's defaults where it leaves a field None."""
        return given.over(MtpSettings(carry=self.settings.carry, zero_first_embedding=self.settings.zero_first_embedding,
                                      own_vocab=self.settings.own_vocab, hidden_first=self.hidden_first))


#: DeepSeek-V3's and GLM-4.5's layers after the body's (the block a MoE layer: first_k_dense_replace 0)
DEEPSEEK = MtpLayout(prefix="model.layers.{n}.", embedding_norm="enorm.weight", hidden_norm="hnorm.weight",
                     projection="eh_proj.weight", final_norm="shared_head.norm.weight", block="",
                     count_keys=("num_nextn_predict_layers", "num_mtp_layers"), after_body=True,
                     head_copy="shared_head.head.weight", embedding_copy="embed_tokens.weight",
                     block_config=(("first_k_dense_replace", 0),), transformers_reads=True)
#: Qwen3.5's and Qwen3-Next's ``mtp.*`` (the block a full-attention layer)
QWEN = MtpLayout(prefix="mtp.", embedding_norm="pre_fc_norm_embedding.weight", hidden_norm="pre_fc_norm_hidden.weight",
                 projection="fc.weight", final_norm="norm.weight", block="layers.{n}.",
                 count_keys=("mtp_num_hidden_layers", "num_nextn_predict_layers"), offset_norms=True,
                 block_config=(("layer_types", ("full_attention",)),),
                 refused=(("mtp_use_dedicated_embeddings", True),),
                 settings=MtpSettings(carry="normed", zero_first_embedding=False, own_vocab=True))
#: Xiaomi MiMo's ``model.mtp_layers.{k}.*`` (a Qwen2 decoder layer)
MIMO = MtpLayout(prefix="model.mtp_layers.{n}.", embedding_norm="token_layernorm.weight",
                 hidden_norm="hidden_layernorm.weight", projection="input_proj.weight",
                 final_norm="final_layernorm.weight", block="", count_keys=("num_nextn_predict_layers",),
                 hidden_first=True, settings=MtpSettings(carry="normed", zero_first_embedding=True, own_vocab=True))
#: ERNIE-4.5-MoE's ``model.mtp_*.{k}`` (its final norm the body's ``model.norm``)
ERNIE = MtpLayout(prefix="model.", embedding_norm="mtp_emb_norm.{n}.weight", hidden_norm="mtp_hidden_norm.{n}.weight",
                  projection="mtp_linear_proj.{n}.weight", final_norm="", block="mtp_block.{n}.",
                  count_keys=("num_nextn_predict_layers",), transformers_reads=True,
                  settings=MtpSettings(carry="normed", zero_first_embedding=False, own_vocab=True))
