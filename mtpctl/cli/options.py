"""Options shared by the commands, defined once so that ``generate``, ``bench`` and ``export`` cannot
drift apart, and the one place where a library error's setting becomes the flag that sets it.

Bundles (each a decorator adding its options, and a function turning the parsed values into the
library's settings):

- :func:`model_options`: ``--model``, ``--backend``, ``--dtype``, ``--weights``, ``--threads``, and
  :func:`device_options`: ``--device``, ``--kernels``;
- :func:`sampling_options`: ``--temperature``, ``--top-k``, ``--top-p``, ``--seed`` -> :func:`sampling_from`;
- :func:`drafter_options`: the drafters' settings (``--heads``, ``--tree``, ``--tree-nodes``,
  ``--draft-len``, ``--draft``, ``--draft-map``, ``--datastore``, ``--retrieval-nodes``,
  ``--ngram-max``, ``--ngram-min``, ``--lookahead``, ``--suffix-*``, ``--acceptance``) ->
  :func:`draft_options_from`;
- :func:`policy_option`: ``--speculate-policy``.

Their defaults are the library's (:data:`mtpctl.drafters.pipeline.DEFAULTS`, :class:`SamplingParams`),
and :func:`pipeline_spec_from` turns the parsed values into the one builder's settings
(:class:`~mtpctl.drafters.pipeline.PipelineSpec`).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import click

from mtpctl.backends import BACKENDS
from mtpctl.decode.policy import POLICIES
from mtpctl.decode.session import ACCEPTANCE
from mtpctl.decode.sampling import SamplingParams
from mtpctl.drafters.build import DraftOptions
from mtpctl.drafters.pipeline import DEFAULTS, PipelineSpec
from mtpctl.drafters.lookahead import LookaheadSettings
from mtpctl.drafters.suffix import OPTION_OF as SUFFIX_OPTIONS, SuffixSettings
from mtpctl.errors import BadInput, MtpctlError
from mtpctl.model.device import KERNELS


class Command(click.Command):
    """A click command whose library errors name the flag at fault: an
    :class:`~mtpctl.errors.MtpctlError` whose ``option`` is one of this command's parameters gets
    that parameter's flag (``--weights``) or argument name (``MODEL``) appended to its message.
    ``aliases`` maps a library setting to another parameter of the command (``speculate`` to
    ``methods`` in ``bench``)."""

    def __init__(self, *args, aliases: Optional[Dict[str, str]] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.aliases = aliases or {}

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MtpctlError as err:
            flag = self.flag_of(err.option)
            if flag is not None:
                err.args = (f"{err} ({flag})",)
                err.option = None
            raise

    def flag_of(self, setting: Optional[str]) -> Optional[str]:
        """The flag (or argument name) of this command that sets ``setting``, or None."""
        name = self.aliases.get(setting, setting)
        for param in self.params:
            if param.name == name:
                if isinstance(param, click.Option):
                    return max(param.opts, key=len)
                return param.human_readable_name
        return None


class DraftLenType(click.ParamType):
    """``--draft-len``: a number >= 1, or ``auto`` (None: a draft model's adaptive length)."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        if str(value).strip().lower() == "auto":
            return None
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            self.fail(f"{value!r} is not a number >= 1 or 'auto'", param, ctx)
        return number


DRAFT_LEN = DraftLenType()


class LookaheadType(click.ParamType):
    """``--lookahead W,N,G``: three whole numbers -> :class:`LookaheadSettings` (what a pass can carry
    is checked against the model once it is loaded)."""

    name = "W,N,G"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, LookaheadSettings):
            return value
        try:
            return LookaheadSettings.parse(str(value))
        except BadInput as err:
            self.fail(str(err), param, ctx)


LOOKAHEAD = LookaheadType()
_LA = LookaheadSettings()  # the defaults, for --help
_DRAFT = DEFAULTS.draft  # the drafters' defaults
_SAMPLING = SamplingParams()  # the sampling defaults
_SUFFIX = SuffixSettings()  # the defaults, for --help


def _apply(options) -> Callable:
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f
    return decorate


def device_options(f):
    """``--device``, ``--kernels``."""
    return _apply([
        click.option("--device", default=DEFAULTS.device, show_default=True, metavar="auto|cpu|cuda[:N]",
                     help="Where the target computes: auto takes a CUDA GPU when torch sees one, else the CPU."),
        click.option("--kernels", type=click.Choice(KERNELS), default=DEFAULTS.kernels, show_default=True,
                     help="native: mtpctl's C kernels (CPU only, fastest there). torch: torch's own ops, the path "
                          "CUDA runs (on the CPU too, to check it). auto: native on the CPU, torch elsewhere."),
    ])(f)


def model_options(f):
    """``--model``, ``--backend``, ``--dtype``, ``--weights``, ``--threads``, ``--cuda-graphs``, ``--device``,
    ``--kernels``."""
    return device_options(_apply([
        click.option("-m", "--model", default=DEFAULTS.model, show_default=True,
                     help="Alias, checkpoint folder, .gguf file or hub repo id (an export folder for an exported "
                          "backend)."),
        click.option("--backend", type=click.Choice(BACKENDS), default=DEFAULTS.backend, show_default=True,
                     help="torch: the native runtime on a checkpoint. onnxruntime: an `mtpctl export --onnx` folder "
                          "given as --model. tensorrt: an export folder with an engine built by `mtpctl export "
                          "--trt` (needs a CUDA GPU and tensorrt)."),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default=DEFAULTS.dtype,
                     show_default=True),
        click.option("--weights", type=click.Choice(["dense", "int4"]), default=DEFAULTS.weights, show_default=True,
                     help="int4: keep GGUF Q4_1/Q8_0 weights packed for the int4 kernels (needs --dtype bfloat16)."),
        click.option("--threads", type=click.IntRange(min=1), default=DEFAULTS.threads,
                     help="CPU threads (default: torch's)."),
        click.option("--cuda-graphs", is_flag=True, default=DEFAULTS.cuda_graphs,
                     help="Replay plain decode steps as CUDA graphs (--device cuda, --kernels torch, a dense model): "
                          "one launch a step instead of a few hundred. Not yet measured on a GPU."),
    ])(f))


def sampling_options(f):
    """``--temperature``, ``--top-k``, ``--top-p``, ``--seed``."""
    return _apply([
        click.option("--temperature", type=click.FloatRange(min=0), default=_SAMPLING.temperature, show_default=True,
                     help="0 = greedy."),
        click.option("--top-k", type=click.IntRange(min=0), default=_SAMPLING.top_k, show_default=True,
                     help="0 = off."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=_SAMPLING.top_p, show_default=True),
        click.option("--seed", type=int, default=_SAMPLING.seed, help="Seed for sampling (same seed, same output)."),
    ])(f)


def sampling_from(options: dict) -> SamplingParams:
    """The sampling settings of :func:`sampling_options`' values.

    Raises:
        BadInput: a value :class:`SamplingParams` refuses (a temperature that is not finite, a seed
            out of range, ...), naming it.
    """
    try:
        return SamplingParams(options["temperature"], options["top_k"], options["top_p"], options["seed"])
    except ValueError as err:
        raise BadInput(str(err)) from err


def drafter_options(f):
    """The drafters' settings and the acceptance rule."""
    return _apply([
        click.option("--heads", "heads_dir", type=click.Path(file_okay=False), default=_DRAFT.heads_dir,
                     help="MTP head folder (mtpctl add-heads) for the heads drafter (and its datastore for "
                          "retrieval)."),
        click.option("--tree", "tree_file", type=click.Path(dir_okay=False), default=_DRAFT.tree_file,
                     help="Draft tree for the heads drafter: YAML/JSON list of paths of top-k ranks, e.g. "
                          "[[0],[1],[0,0]]."),
        click.option("--tree-nodes", type=click.IntRange(min=1), default=_DRAFT.tree_nodes,
                     help="Size of the draft tree grown from the heads' accuracy [default: 4; 2 with --weights int4]."),
        click.option("--dynamic-tree", is_flag=True, default=_DRAFT.dynamic_tree,
                     help="EAGLE and EAGLE-3 heads draft EAGLE-2's dynamic tree of the same size: the nodes with the "
                          "highest path probability under the draft layer's own distribution, chosen each step."),
        click.option("--draft-len", type=DRAFT_LEN, default=_DRAFT.draft_len, show_default=True,
                     help="Most draft tokens of the prompt-lookup chain or the draft model per step; auto (draft "
                          "model): longer after a fully accepted draft, shorter after a rejection."),
        click.option("--draft", "draft_model", default=_DRAFT.draft_model,
                     help="Draft model for the draft drafter (alias, folder, .gguf; check it with mtpctl pair), or "
                          "self[:LAYERS]: the target through some of its own layers (self:0-11,20-29; plain self "
                          "chooses them by a short search on calibration prompts, once per model and dtype)."),
        click.option("--draft-map", type=click.Path(dir_okay=False), default=_DRAFT.draft_map,
                     help="Id map from mtpctl pair --out (else computed from the tokenizers)."),
        click.option("--datastore", type=click.Path(dir_okay=False), default=_DRAFT.datastore,
                     help="Retrieval datastore (mtp_datastore.safetensors) [default: the one in --heads]."),
        click.option("--retrieval-nodes", type=click.IntRange(min=1), default=_DRAFT.retrieval_nodes,
                     help="Nodes of the retrieval drafter's tree [default: 4]."),
        click.option("--ngram-max", type=click.IntRange(min=1), default=_DRAFT.ngram_max, show_default=True,
                     help="Longest n-gram the prompt-lookup drafter matches."),
        click.option("--ngram-min", type=click.IntRange(min=1), default=_DRAFT.ngram_min, show_default=True,
                     help="Shortest n-gram the prompt-lookup drafter matches."),
        click.option("--lookahead", type=LOOKAHEAD, default=_DRAFT.lookahead,
                     help=f"Lookahead decoding's window W, n-gram size N and candidates G [default: "
                          f"{_LA.window},{_LA.ngram},{_LA.candidates}]: a pass carries W*(N-1)-1 window tokens and up "
                          "to G*(N-1) candidate tokens."),
        click.option("--suffix-nodes", type=click.IntRange(1, 64), default=None,
                     help=f"Most draft tokens a step of the suffix drafter's tree [default: {_SUFFIX.nodes}]."),
        click.option("--suffix-depth", type=click.IntRange(min=2), default=None,
                     help=f"Longest pattern the suffix drafter's indexes hold: match + draft tokens [default: "
                          f"{_SUFFIX.max_depth}]."),
        click.option("--suffix-min-prob", type=click.FloatRange(0, 1), default=None,
                     help=f"Least estimated probability (from the indexes' counts) of a token the suffix drafter "
                          f"drafts [default: {_SUFFIX.min_prob}]."),
        click.option("--suffix-factor", type=click.FloatRange(min=0, min_open=True), default=None,
                     help=f"A suffix draft holds at most this many times the match length tokens [default: "
                          f"{_SUFFIX.factor}]."),
        click.option("--suffix-min-match", type=click.IntRange(min=1), default=None,
                     help=f"Shortest suffix match the suffix drafter drafts from [default: {_SUFFIX.min_match}; 2 "
                          f"skips single-token matches, which are mostly chance on chat text]."),
        click.option("--suffix-max-nodes", type=click.IntRange(min=1), default=None,
                     help=f"Most nodes of the suffix drafter's global index of earlier responses (about 140 bytes "
                          f"each); the oldest responses are evicted beyond it [default: {_SUFFIX.max_nodes}]."),
        click.option("--suffix-cache", type=click.Path(dir_okay=False), default=None,
                     help="File keeping the suffix drafter's global index between runs: loaded at the start when it "
                          "exists, written atomically at the end of generate (bench only reads it); a file made with "
                          "another tokenizer is refused."),
        click.option("--acceptance", type=click.Choice(ACCEPTANCE), default=DEFAULTS.acceptance,
                     show_default=True,
                     help="exact: lossless; typical: Medusa's typical acceptance when sampling (lossy)."),
    ])(f)


def policy_option(f):
    """``--speculate-policy``: how many draft tokens each request verifies each step."""
    return click.option("--speculate-policy", type=click.Choice(POLICIES), default=DEFAULTS.speculate_policy,
                        show_default=True,
                        help="auto: a request drafts only while its drafts are expected to pay for the rows they add "
                             "to the pass (measured pass costs of this mode), cut to the size that pays best; alone "
                             "that is almost always, in a full batch less or not at all. always: every request drafts "
                             "its whole --draft-len or tree every step.")(f)


def draft_options_from(options: dict) -> DraftOptions:
    """The drafters' settings of :func:`drafter_options`' values (the MTP layers' settings are the
    library's only: the CLI runs them with their defaults)."""
    fields = {name: options[name] for name in DraftOptions.__dataclass_fields__ if name not in ("suffix", "mtp")}
    return DraftOptions(**fields, suffix=suffix_settings_from(options))


#: the settings of :class:`PipelineSpec` that the CLI's shared options set, by the same names
SPEC_OPTIONS = ("model", "backend", "dtype", "weights", "threads", "device", "kernels", "speculate_policy",
                "acceptance", "cuda_graphs")


def pipeline_spec_from(options: dict, speculate: str = DEFAULTS.speculate) -> PipelineSpec:
    """The builder's settings of :func:`model_options`', :func:`drafter_options`' and
    :func:`policy_option`'s values, drafting with ``speculate``."""
    return PipelineSpec(speculate=speculate, draft=draft_options_from(options),
                        **{name: options[name] for name in SPEC_OPTIONS})


def suffix_settings_from(options: dict):
    """The suffix drafter's settings of the ``--suffix-*`` values given (None: none given)."""
    given = {field: options[name] for field, name in SUFFIX_OPTIONS.items() if options.get(name) is not None}
    return SuffixSettings(**given) if given else None


def draft_line(draft: dict) -> str:
    """The stderr line naming the draft model a run drafts with (:meth:`DraftModelDrafter.describe`)."""
    return f"draft {draft['folder']}: {draft['verdict']}, drafting in {draft['mode']}"


def debug_option(f):
    """``--debug`` (read by :func:`mtpctl.cli.main.main` before parsing; listed for ``--help``)."""
    return click.option("--debug", is_flag=True, help="Show the full traceback of an error.")(f)


def check_backend(options: dict, what: str) -> None:
    """BadInput unless ``options["backend"]`` is torch: ``what`` runs on the torch backend only."""
    if options["backend"] != "torch":
        raise BadInput(f"{what} runs on the torch backend", option="backend")
