"""Files mtpctl writes and reads: its cache folder, file digests, and outputs written atomically
(a temporary sibling renamed into place when complete, so an interruption leaves nothing half-written
and an existing output is replaced only when asked)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Union

from mtpctl.errors import BadInput


def mtpctl_home() -> Path:
    """Cache root: ``$MTPCTL_HOME``, else ``$XDG_CACHE_HOME/mtpctl``, else ``~/.cache/mtpctl``."""
    if os.environ.get("MTPCTL_HOME"):
        return Path(os.environ["MTPCTL_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtpctl"


def sha256_file(path: Path) -> str:
    """sha256 (hex) of a file's bytes. Raises OSError when it cannot be read."""
    return sha256_files([Path(path)], names=False)


def sha256_files(paths: Iterable[Path], names: bool = True) -> str:
    """sha256 (hex) over the bytes of ``paths`` in the order given, each preceded by its file name
    and a NUL when ``names`` (so moving bytes from one file to the next changes the digest).
    Raises OSError when a file cannot be read."""
    digest = hashlib.sha256()
    for path in paths:
        if names:
            digest.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def _ordinary_modes(paths: Iterable[Path]) -> None:
    """Give files and folders the modes the umask asks for (mkstemp, mkdtemp and some writers make
    them owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        if not Path(path).is_dir() and os.stat(path).st_nlink > 1:
            continue  # a hard link to a file kept unchanged (a shard of the source): its mode is the source's
        os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)


def prepare_output(out: Path, overwrite: bool) -> Path:
    """Check ``out`` and return a fresh temporary folder next to it (renamed by :func:`finish_output`).

    Raises:
        BadInput: ``out`` exists and ``overwrite`` is not set, is a file, or its parent cannot be created.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise BadInput(f"{out} already exists: choose another folder or replace it", option="overwrite")
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out} is a file, not a folder")
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BadInput(f"cannot create the folder {parent}: {err}") from err
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=str(parent)))


def finish_output(tmp: Path, out: Path) -> None:
    """Replace ``out`` by the complete ``tmp`` folder (an old ``out`` is removed only now)."""
    out = Path(out)
    _ordinary_modes([tmp, *tmp.iterdir()])
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


@contextmanager
def output_folder(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """``with output_folder(out) as tmp:`` write into ``tmp``; when the block ends without an error
    ``tmp`` becomes ``out``, otherwise it is removed and ``out`` is left as it was.

    Raises:
        BadInput: see :func:`prepare_output`.
    """
    tmp = prepare_output(out, overwrite)
    try:
        yield tmp
        finish_output(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_writable(path: Path) -> None:
    """BadInput unless ``path`` can be written (its folder exists and is writable; not a folder):
    checked before the work whose output it will hold."""
    path = Path(path)
    folder = path.parent
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise BadInput(f"cannot write {path}: its folder does not exist or is not writable")


def write_file(path: Path, data: Union[str, bytes]) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` atomically: a temporary file in the same folder,
    renamed when complete, with the modes the umask asks for.

    Raises:
        BadInput: the folder does not exist or the file cannot be written.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not folder.is_dir():
        raise BadInput(f"cannot write {path}: its folder does not exist, or it is a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(folder))
    except OSError as err:
        raise BadInput(f"cannot write {path}: {err.strerror or err}") from err
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        _ordinary_modes([Path(tmp)])
        os.replace(tmp, path)
    except OSError as err:
        raise BadInput(f"cannot write {path}: {err.strerror or err}") from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
