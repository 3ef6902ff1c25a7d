"""Every error mtpctl reports to a user, with its exit code, in one place.

The CLI turns an :class:`MtpctlError` into one line on stderr and its ``exit_code``; anything else
that escapes is a bug (exit code 3, traceback with ``--debug``).

Exit codes: 0 ok, 1 a gate failed, 2 bad input or a missing resource, 3 internal error,
4 a peer of ``bench`` failed (:class:`mtpctl.bench.peer_process.PeerFailed`: the rest was written),
130 interrupted, 141 stdout closed early (as a Unix tool killed by SIGPIPE).
"""

from __future__ import annotations

from typing import Optional


class MtpctlError(Exception):
    """Base class: a problem the user can fix; ``str(err)`` says what went wrong and how to fix it.

    ``option`` names the setting at fault by its library name (a parameter such as ``weights`` or
    ``heads_dir``), where there is one: the CLI turns it into the flag that sets it (``--weights``),
    so the library never names a flag itself.
    """

    exit_code = 2

    def __init__(self, message: str, option: Optional[str] = None):
        super().__init__(message)
        self.option = option


class BadInput(MtpctlError):
    """An argument, prompt or option value is not usable (empty prompt, prompt too long, ...)."""


class ModelNotFound(MtpctlError):
    """An alias, folder or file named by ``--model`` does not exist or is not installed."""


class HubUnreachable(MtpctlError):
    """A hub repo id was given but the Hugging Face hub could not be reached."""


class CorruptModel(MtpctlError):
    """A weights, config, GGUF or tokenizer file is truncated, malformed or inconsistent."""


class UnsupportedModel(MtpctlError):
    """The checkpoint is well formed but uses an architecture or feature the runtime lacks."""


class NonFinite(MtpctlError):
    """A NaN or inf in the target's or a drafter's logits (broken weights, or values that overflow the
    dtype): the request fails rather than turn it into a token."""


class InternalFault(MtpctlError):
    """A bug met while serving one request of a batch (its drafter's or engine's own work): it ends
    that request alone, the original exception as its ``__cause__``; exit code 3."""

    exit_code = 3


class GateFailed(MtpctlError):
    """A benchmark gate (speedup, latency) was missed."""

    exit_code = 1


class OutputClosed(Exception):
    """stdout was closed by its reader (e.g. ``| head``): stop quietly, exit code 141."""

    exit_code = 141
