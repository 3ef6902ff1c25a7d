"""``mtpctl export --onnx``: the fused draft/verify graph of a target (and its MTP heads) as ONNX.

One graph serves prefill and every decode step: it takes a step's N token ids, their positions,
the attention mask of the N new tokens over the past + N slots (a chain is causal, a draft tree is
its ancestor mask) and the past KV cache of every layer, and returns the target's logits for the N
tokens, its hidden states (or the Medusa heads' logits) and the present KV cache (past + N slots).
An empty past (length 0) is a prefill.

The graph is traced from the runtime's own :class:`mtpctl.model.decoder.Decoder` (its parameters and
its RMSNorm / rotary / linear helpers) through :class:`FusedStep`, a thin wrapper whose KV cache is
functional (tensors in, tensors out) instead of the runtime's in-place :class:`KVCache`; attention
is written as one batched masked softmax (the runtime's token-at-a-time loop keeps verify passes
batch-invariant, which a graph with a symbolic N cannot unroll).

Files of an export folder (written to a temporary folder and renamed when complete):

- ``model.onnx`` + ``model.onnx.data`` (external data: every initializer of 1 KiB or more, so
  ``model.onnx`` stays far below protobuf's 2 GB limit at any model size; :func:`write_external_data`);
- ``config.json``, ``generation_config.json`` and the tokenizer files of the target, copied;
- ``mtp_config.json`` when heads were exported (their config, tree included);
- ``manifest.json``: every file with its size and sha256, the target's weight hash, the graph's
  inputs and outputs with dtypes and symbolic shapes.

Graph I/O (names in :mod:`mtpctl.backends.graph`): ``input_ids`` int64 ``[batch, new_tokens]``,
``position_ids`` int64 ``[batch, new_tokens]``, ``attention_mask`` bool ``[batch, new_tokens,
total_length]`` (True = may attend; total_length = past_length + new_tokens), ``past_key.{i}`` /
``past_value.{i}`` float32 ``[batch, kv_heads, past_length, head_dim]`` -> ``logits`` float32
``[batch, new_tokens, vocab]``, ``hidden_states`` ``[batch, new_tokens, hidden]`` (after the final
norm), ``medusa_logits`` ``[batch, new_tokens, K, vocab]`` (with heads only), ``present_key.{i}`` /
``present_value.{i}`` ``[batch, kv_heads, total_length, head_dim]``.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mtpctl.version import __version__
from mtpctl.backends.graph import GRAPH_DATA_FILE, GRAPH_FILE, MANIFEST_FILE, io_names
from mtpctl.drafters.heads.config import WEIGHTS_FILE, HeadsConfig
from mtpctl.drafters.heads.medusa import MedusaHeads
from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.export.heads import exportable_heads
from mtpctl.files import output_folder, sha256_file
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import Decoder, _linear, attention_out_and_mlp, qkv_heads
from mtpctl.model.families import FAMILIES
from mtpctl.model.weights import weights_hash

OPSET = 17
#: model types whose layer math FusedStep reproduces (the families that say they are exportable)
EXPORTABLE = tuple(t for t, family in FAMILIES.items() if family.exportable)
#: files of a checkpoint folder copied next to the graph (tokenizer, chat template, configs)
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
          "added_tokens.json")
#: the most bytes one protobuf message holds: ``model.onnx`` must stay under it (its weights are
#: external data), and torch's exporter writes a graph whose weights pass it with one file per tensor
PROTOBUF_LIMIT = (1 << 31) - 1
#: initializers of at least this many bytes go to ``model.onnx.data``
EXTERNAL_MIN_BYTES = 1024
#: initializers of at least ALIGN_MIN_BYTES start at a multiple of ALIGN_BYTES in ``model.onnx.data``
#: (as onnxruntime and onnx_ir align theirs, so that each can be memory-mapped)
ALIGN_MIN_BYTES, ALIGN_BYTES = 1 << 20, 1 << 16
#: bytes copied at a time from one external data file to another
COPY_BYTES = 16 << 20


def _layer_step(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: torch.Tensor,
                past_v: torch.Tensor, mask: torch.Tensor):
    """One :class:`mtpctl.model.decoder.DecoderLayer` with a functional KV cache: the layer's own
    parameters, norm function, activation and flags (QK-norm, sandwich norms, attention scale), and the
    block's own math around attention (:func:`~mtpctl.model.decoder.qkv_heads`,
    :func:`~mtpctl.model.decoder.attention_out_and_mlp`); attention here is one masked softmax.

    x ``[batch, N, hidden]``; cos/sin ``[batch, N, 1, head_dim]``; past_k/past_v ``[batch, kv_heads,
    past, head_dim]``; mask bool ``[batch, N, past + N]``. Returns the layer output ``[batch, N,
    hidden]`` and the present keys/values ``[batch, kv_heads, past + N, head_dim]``.
    """
    cfg = layer.cfg
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    q, k, v = qkv_heads(layer, _linear(layer.norm(x, layer.input_norm, cfg.rms_norm_eps), layer.qkv, layer.qkv_bias),
                        cos, sin, layer.norm)
    keys = torch.cat((past_k, k.float()), dim=2)
    values = torch.cat((past_v, v.float()), dim=2)
    # grouped-query attention: the query heads of one KV group share its keys (no repeat_kv copy)
    qg = q.float().unflatten(1, (kv_heads, heads // kv_heads))  # [b, kv_heads, group, N, hd]
    scores = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)) * cfg.scale  # [b, kvh, g, N, T]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    attn = torch.matmul(torch.softmax(scores, dim=-1), values.unsqueeze(2))  # [b, kvh, g, N, hd]
    attn = attn.flatten(1, 2).transpose(1, 2).flatten(2).to(x.dtype)  # [b, N, heads * hd]
    return attention_out_and_mlp(layer, x, attn, layer.norm), keys, values


def check_exportable(cfg: DecoderConfig) -> None:
    """Raises UnsupportedModel where ``cfg``'s family has no exported graph (:data:`EXPORTABLE`)."""
    if not cfg.family.exportable:
        raise UnsupportedModel(f"model_type {cfg.model_type!r} cannot be exported yet "
                               f"(exportable: {', '.join(EXPORTABLE)})")


class FusedStep(nn.Module):
    """The fused draft/verify step of ``model`` (and ``heads``) with the KV cache as inputs/outputs.

    ``forward(input_ids, position_ids, attention_mask, *past)`` with ``past`` = (key_0, value_0,
    key_1, value_1, ...) returns ``(logits, hidden_states, [medusa_logits,] present key_0, value_0,
    ...)``; shapes in the module docstring. Committed slot j of the past holds position j (the
    engine compacts the accepted path), which the sliding-window masks rely on.

    Raises:
        UnsupportedModel: a model type outside :data:`EXPORTABLE`, or packed (int4) weights.
    """

    def __init__(self, model: Decoder, heads: Optional[MedusaHeads] = None):
        super().__init__()
        check_exportable(model.cfg)
        if model.packed_weights:
            raise UnsupportedModel("packed int4 weights cannot be exported: load the model with dense weights")
        self.model, self.heads = model, heads
        model.reserve_rope(model.cfg.max_position_embeddings)  # the graph takes any position of the context

    def forward(self, input_ids, position_ids, attention_mask, *past):
        m = self.model
        cfg = m.cfg
        # a tied embedding is read through one transposed view [hidden, vocab] for the lookup and for
        # the lm_head, so the graph stores it once (the exporter folds each transpose into a copy)
        self._tied = m.lm_head.t() if m.lm_head is m.embed else None
        if self._tied is not None:
            x = self._tied.index_select(1, input_ids.reshape(-1)).t().reshape(*input_ids.shape, cfg.hidden_size)
        else:
            x = F.embedding(input_ids, m.embed)
        if m.embed_scale is not None:
            x = x * m.embed_scale
        rot = tuple(t.unsqueeze(2) for t in m.rope(position_ids))  # the whole tables: constants of the graph
        local = rot if m.rope_local_cos is None else tuple(t.unsqueeze(2) for t in m.rope(position_ids, True))
        masks: Dict[Optional[int], torch.Tensor] = {None: attention_mask}
        windows = set(w for w in cfg.layer_windows if w is not None)
        if windows:  # past slot j holds position j; new slot j holds position_ids[:, j]
            past_pos = torch.ones_like(past[0][:, 0, :, 0], dtype=torch.long).cumsum(-1) - 1
            slot_pos = torch.cat((past_pos, position_ids), dim=1)  # [b, past + N]
            distance = position_ids[:, :, None] - slot_pos[:, None, :]  # [b, N, past + N]
            for w in windows:
                masks[w] = attention_mask & (distance < w)
        presents: List[torch.Tensor] = []
        for i, (layer, window, is_local) in enumerate(zip(m.layers, cfg.layer_windows, m.local_rope)):
            cos, sin = local if is_local else rot
            x, k, v = _layer_step(layer, x, cos, sin, past[2 * i], past[2 * i + 1], masks[window])
            presents += [k, v]
        hidden = m.final_norm(x, m.norm, cfg.rms_norm_eps)
        logits = self.project(hidden)
        heads = ()
        if self.heads is not None:
            embeds = None
            if self.heads.cfg.token_conditioned:  # a row's pending token, taken as its argmax (greedy)
                embeds = F.embedding(logits.argmax(-1), m.embed).to(hidden.dtype)
            heads = (self.heads(hidden, self.project, token_embeds=embeds),)
        return (logits, hidden, *heads, *presents)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The target's lm_head, ``[..., hidden] -> [..., vocab]`` float32, as
        :meth:`mtpctl.model.decoder.Decoder.logits` computes it (a tied one through the embedding's
        transposed view of :meth:`forward`)."""
        m = self.model
        tied = getattr(self, "_tied", None)
        logits = (torch.matmul(x, tied) if tied is not None else F.linear(x, m.lm_head)).float()
        cap = m.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def graph_metadata(model: Decoder, heads_cfg: Optional[HeadsConfig], target_hash: str) -> Dict[str, str]:
    """``metadata_props`` of the graph: the mtpctl version, target config, head config and tree."""
    meta = {"mtpctl_version": __version__, "mtpctl_graph": "fused_draft_verify",
            "target_hash": target_hash, "model_type": model.cfg.model_type,
            "num_layers": str(model.cfg.num_hidden_layers), "kv_heads": str(model.cfg.num_key_value_heads),
            "head_dim": str(model.cfg.head_dim), "vocab_size": str(model.cfg.vocab_size),
            "max_position_embeddings": str(model.cfg.max_position_embeddings),
            "heads": "none", "tree": "[]"}
    if heads_cfg is not None:
        from dataclasses import asdict

        meta["heads"] = json.dumps({k: v for k, v in asdict(heads_cfg).items() if k not in ("training",)})
        meta["tree"] = json.dumps(heads_cfg.tree)
    return meta


def export_graph(model: Decoder, heads: Optional[MedusaHeads], folder: Path,
                 metadata: Dict[str, str]) -> None:
    """Trace :class:`FusedStep` to ``folder/model.onnx`` + ``model.onnx.data`` (every initializer of
    :data:`EXTERNAL_MIN_BYTES` or more, at any model size), opset 17, with symbolic ``batch``,
    ``new_tokens``, ``past_length`` and ``total_length`` axes; then run onnx.checker and shape
    inference on it. The weights pass from torch's trace to ``model.onnx.data`` one tensor at a time.

    Raises:
        UnsupportedModel: see :class:`FusedStep`; a graph over :data:`PROTOBUF_LIMIT` without its weights.
    """
    import onnx

    wrapper = FusedStep(model, heads).eval()
    trace = folder / "trace"
    trace.mkdir()
    raw = trace / "raw.onnx"
    trace_graph(wrapper, raw)
    proto = onnx.load(str(raw), load_external_data=False)
    load_attribute_data(proto, trace)
    fold_constants(proto)
    onnx.helper.set_model_props(proto, metadata)
    proto.doc_string = "mtpctl fused draft/verify graph"
    write_external_data(proto, trace, folder / GRAPH_DATA_FILE)
    shutil.rmtree(trace)
    save_graph(proto, folder / GRAPH_FILE)


def trace_graph(wrapper: "FusedStep", raw: Path) -> None:
    """``torch.onnx.export`` (TorchScript) of ``wrapper`` to ``raw``, with sample inputs of 3 new
    tokens over a past of 2. torch writes the weights into ``raw`` itself while the graph stays under
    2 GB, and beside it, one file per tensor, past that."""
    cfg, with_heads = wrapper.model.cfg, wrapper.heads is not None
    names = io_names(cfg.num_hidden_layers, with_heads)
    b, n, past = 1, 3, 2  # sample sizes for tracing (not 0/1, which tracers may specialise)
    ids = torch.zeros(b, n, dtype=torch.long)
    pos = torch.arange(past, past + n)[None]
    mask = torch.ones(b, n, past + n, dtype=torch.bool).tril(past)
    kv = [torch.zeros(b, cfg.num_key_value_heads, past, cfg.head_dim) for _ in range(2 * cfg.num_hidden_layers)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about Python ints taken from shapes
        torch.onnx.export(wrapper, (ids, pos, mask, *kv), str(raw), dynamo=False, opset_version=OPSET,
                          input_names=names.inputs, output_names=names.outputs, dynamic_axes=_dynamic_axes(names),
                          do_constant_folding=True)


def _dynamic_axes(names) -> Dict[str, Dict[int, str]]:
    """The symbolic axes of every input and output named in ``names`` (:func:`io_names`)."""
    axes = {"input_ids": {0: "batch", 1: "new_tokens"}, "position_ids": {0: "batch", 1: "new_tokens"},
            "attention_mask": {0: "batch", 1: "new_tokens", 2: "total_length"},
            "logits": {0: "batch", 1: "new_tokens"}, "hidden_states": {0: "batch", 1: "new_tokens"}}
    if "medusa_logits" in names.outputs:
        axes["medusa_logits"] = {0: "batch", 1: "new_tokens"}
    for name in names.past:
        axes[name] = {0: "batch", 2: "past_length"}
    for name in names.present:
        axes[name] = {0: "batch", 2: "total_length"}
    return axes


def load_attribute_data(proto, source: Path) -> None:
    """Read the external data of ``proto``'s tensor attributes (the ``Constant`` nodes: rotary tables,
    small next to the weights) from their files in ``source`` into the graph: torch writes those over
    its size threshold to files of their own in a graph over 2 GB. Initializers stay external."""
    from onnx import AttributeProto
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    for node in proto.graph.node:
        for attribute in node.attribute:
            if attribute.type == AttributeProto.TENSOR and uses_external_data(attribute.t):
                load_external_data_for_tensor(attribute.t, str(source))


def write_external_data(proto, source: Path, data_path: Path) -> int:
    """Write every initializer of ``proto`` of :data:`EXTERNAL_MIN_BYTES` or more to ``data_path``, one
    tensor at a time, and point it there (``location``, ``offset``, ``length``); tensors of
    :data:`ALIGN_MIN_BYTES` or more start at a multiple of :data:`ALIGN_BYTES`. An initializer's bytes
    are its inline data or, where it is already external (torch's one file per tensor over 2 GB), read
    from its file in ``source``, which is deleted once no initializer left needs it. Returns the bytes
    of ``data_path``.

    Raises:
        CorruptModel: an external file outside ``source``, missing, or shorter than its tensor.
    """
    from onnx import TensorProto

    pending = _external_files(proto, source)
    with open(data_path, "wb") as out:
        for tensor in proto.graph.initializer:
            external = tensor.data_location == TensorProto.EXTERNAL
            if not external and len(tensor.raw_data) < EXTERNAL_MIN_BYTES:
                continue
            size = _tensor_bytes(tensor, source) if external else len(tensor.raw_data)
            if size >= ALIGN_MIN_BYTES:
                out.write(b"\0" * (-out.tell() % ALIGN_BYTES))
            offset = out.tell()
            if external:
                _copy_external(tensor, source, out, pending)
            else:
                out.write(tensor.raw_data)
            _point_at(tensor, data_path.name, offset, out.tell() - offset)
        return out.tell()


def _external_files(proto, source: Path) -> Dict[Path, int]:
    """The external data files of ``proto``'s initializers (resolved in ``source``) -> how many
    initializers read each."""
    from onnx import TensorProto
    from onnx.external_data_helper import ExternalDataInfo

    counts: Dict[Path, int] = {}
    for tensor in proto.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            path = _inside(source, ExternalDataInfo(tensor).location, tensor.name)
            counts[path] = counts.get(path, 0) + 1
    return counts


def _inside(source: Path, location: str, name: str) -> Path:
    """``source/location``, refused (CorruptModel) unless it lies inside ``source``."""
    path = (source / location).resolve()
    if source.resolve() not in path.parents:
        raise CorruptModel(f"the traced graph's tensor {name!r} points outside {source}: {location!r}")
    return path


def _tensor_bytes(tensor, source: Path) -> int:
    """The bytes of an external tensor: its ``length``, else the rest of its file after ``offset``."""
    from onnx.external_data_helper import ExternalDataInfo

    info = ExternalDataInfo(tensor)
    if info.length is not None:
        return int(info.length)
    path = _inside(source, info.location, tensor.name)
    if not path.is_file():
        raise CorruptModel(f"the traced graph's tensor {tensor.name!r} has no data file ({info.location!r})")
    return path.stat().st_size - int(info.offset or 0)


def _copy_external(tensor, source: Path, out, pending: Dict[Path, int]) -> None:
    """Append the bytes of external ``tensor`` to ``out`` in chunks of :data:`COPY_BYTES`; delete its
    file once no other pending initializer reads it."""
    from onnx.external_data_helper import ExternalDataInfo

    info = ExternalDataInfo(tensor)
    path = _inside(source, info.location, tensor.name)
    left = _tensor_bytes(tensor, source)
    try:
        with open(path, "rb") as handle:
            handle.seek(int(info.offset or 0))
            while left:
                chunk = handle.read(min(left, COPY_BYTES))
                if not chunk:
                    raise CorruptModel(f"{path} ends inside the traced graph's tensor {tensor.name!r}")
                out.write(chunk)
                left -= len(chunk)
    except OSError as err:
        raise CorruptModel(f"cannot read the traced graph's tensor {tensor.name!r} from {path}: {err}") from err
    pending[path] -= 1
    if not pending[path]:
        path.unlink()


def _point_at(tensor, location: str, offset: int, length: int) -> None:
    """Make ``tensor`` external data: ``length`` bytes from ``offset`` of ``location``; no inline bytes."""
    from onnx import TensorProto

    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def save_graph(proto, path: Path) -> None:
    """Write ``proto`` (weights already external) to ``path`` and check it: onnx.checker with strict
    shape inference, which reads the file and not the weights.

    Raises:
        UnsupportedModel: the graph alone is over :data:`PROTOBUF_LIMIT`.
    """
    import onnx

    size = proto.ByteSize()
    if size > PROTOBUF_LIMIT:
        raise UnsupportedModel(f"the exported graph is {size} bytes without its weights, over protobuf's "
                               f"{PROTOBUF_LIMIT}-byte limit: ONNX cannot hold it")
    onnx.save_model(proto, str(path))
    onnx.checker.check_model(str(path), full_check=True)  # full_check runs strict shape inference


def fold_constants(proto, max_elements: int = 4096) -> int:
    """Replace every small node whose inputs are all ``Constant`` outputs by a ``Constant`` holding its
    result (the TorchScript exporter leaves shape arithmetic such as ``Mod`` of two constants, an
    operator some TensorRT versions do not parse). Returns the number of nodes folded."""
    import onnx
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    values = {}
    nodes, folded = [], 0
    for node in proto.graph.node:
        if node.op_type == "Constant" and len(node.output) == 1 and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
            nodes.append(node)
            continue
        if node.input and node.domain in ("", "ai.onnx") and not any(a.g.node for a in node.attribute) and \
                all(i in values for i in node.input) and sum(values[i].size for i in node.input) <= max_elements:
            inputs = [helper.make_tensor_value_info(f"in{k}", onnx.TensorProto.UNDEFINED, None) for k in range(len(node.input))]
            outputs = [helper.make_tensor_value_info(f"out{k}", onnx.TensorProto.UNDEFINED, None) for k in range(len(node.output))]
            single = helper.make_node(node.op_type, [f"in{k}" for k in range(len(node.input))],
                                      [f"out{k}" for k in range(len(node.output))])
            single.attribute.extend(node.attribute)
            graph = helper.make_graph([single], "fold", inputs, outputs)
            results = ReferenceEvaluator(helper.make_model(graph, opset_imports=proto.opset_import)).run(
                None, {f"in{k}": values[i] for k, i in enumerate(node.input)})
            for name, value in zip(node.output, results):
                values[name] = value
                nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name)))
            folded += 1
            continue
        nodes.append(node)
    used = {i for node in nodes for i in node.input} | {o.name for o in proto.graph.output}
    nodes = [n for n in nodes if n.op_type != "Constant" or n.output[0] in used]  # inputs of folded nodes
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return folded


def graph_io(path: Path) -> Dict[str, list]:
    """Inputs and outputs of an ONNX graph: name, dtype and shape (ints, or symbolic axis names)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)

    def describe(values):
        out = []
        for v in values:
            t = v.type.tensor_type
            shape = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
            out.append({"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                        "shape": shape})
        return out

    return {"inputs": describe(proto.graph.input), "outputs": describe(proto.graph.output)}


def write_manifest(folder: Path, target_hash: str, extra: dict) -> dict:
    """Write ``folder/manifest.json``: every file (size, sha256; the graph's external data file
    ``graph_data`` among them), the target's weight hash, the graph's I/O with dtypes and shapes, and
    ``extra``. Returns the manifest."""
    files = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE):
        files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"format": "mtpctl-onnx-export", "format_version": 1, "mtpctl_version": __version__,
                "target_hash": target_hash, "graph": GRAPH_FILE, "graph_data": GRAPH_DATA_FILE, "files": files,
                "tokenizer_files": [n for n in files if n in COPIED and n not in ("config.json", "generation_config.json")],
                **graph_io(folder / GRAPH_FILE), **extra}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def export_onnx(model_folder: Path, out: Path, heads_dir: Optional[Path] = None, overwrite: bool = False,
                progress=lambda line: None, finish: Optional[Callable[[Path], None]] = None) -> dict:
    """Export the fused draft/verify graph of the checkpoint in ``model_folder`` (and the MTP heads
    in ``heads_dir``) to the folder ``out``; returns the manifest.

    The folder is written under a temporary name next to ``out`` and renamed when complete; an
    interruption or an error leaves no folder behind. ``finish(tmp_folder)`` runs before the rename
    (e.g. a TensorRT build, :func:`mtpctl.export.tensorrt.build_engine`); the manifest then also
    lists the files it added.

    Raises:
        BadInput: ``out`` exists without ``overwrite``; heads of another model.
        CorruptModel, UnsupportedModel: unreadable or unsupported checkpoint or heads.
    """
    model_folder = Path(model_folder)
    # from config.json, before the weights are hashed and loaded in float32 (minutes, or more memory than
    # the machine has, for a large MoE model that would then be refused)
    check_exportable(DecoderConfig.from_folder(model_folder))
    with output_folder(Path(out), overwrite) as tmp:
        progress(f"hashing the weights of {model_folder}")
        target_hash = weights_hash(model_folder)
        model = Decoder.from_folder(model_folder, torch.float32)
        heads = heads_cfg = None
        if heads_dir is not None:
            heads = exportable_heads(Path(heads_dir), model, target_hash)
            heads_cfg = heads.cfg
        progress(f"tracing the fused draft/verify graph ({model.cfg.num_hidden_layers} layers"
                 f"{', ' + str(heads_cfg.num_heads) + ' Medusa heads' if heads_cfg else ''})")
        export_graph(model, heads, tmp, graph_metadata(model, heads_cfg, target_hash))
        for name in COPIED:
            if (model_folder / name).is_file():
                shutil.copy2(model_folder / name, tmp / name)
        if heads_cfg is not None:
            heads_cfg.save(tmp)
        c = model.cfg
        extra_keys = ("opset", "dtype", "source", "heads", "model")
        manifest = write_manifest(tmp, target_hash, {
            "opset": OPSET, "dtype": "float32", "source": str(model_folder),
            "heads": None if heads_cfg is None else {
                "kind": heads_cfg.kind, "num_heads": heads_cfg.num_heads, "tree": heads_cfg.tree,
                "source": str(heads_dir), "weights_sha256": sha256_file(Path(heads_dir) / WEIGHTS_FILE)},
            "model": {"model_type": c.model_type, "num_layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads,
                      "head_dim": c.head_dim, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
                      "max_position_embeddings": c.max_position_embeddings}})
        if finish is not None:
            finish(tmp)
            manifest = write_manifest(tmp, target_hash, {k: v for k, v in manifest.items() if k in extra_keys})
    return manifest
