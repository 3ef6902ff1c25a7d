"""A peer (llama.cpp, HF transformers) in its own process, so that its crash, hang or failed import
costs the benchmark that peer's row and nothing else.

The parent starts ``python -m mtpctl.bench.peer_worker`` and speaks JSON lines with it on stdin and
stdout: first the peer's request (which peer, its settings), answered by ``{"ready": true}`` once the
peer has loaded; then one ``{"prompt_ids": [...]}`` per run, answered by ``{"token_ids": [...],
"total_ms": ...}``. The worker's own output (and the peer library's) goes to a log file, whose last
line names the fault when the worker dies.

Failures, each raised as :class:`PeerFailed` with the reason that goes in the peer's row:

- the process ended (a signal such as SIGSEGV, or an exit code), with the log's last line;
- no answer within ``timeout_s`` (loading, or one run): the process is killed;
- the worker reported an error (``{"error": ...}``, e.g. an ImportError inside the peer's package).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from mtpctl.decode.loop import GenerationResult, GenerationStats
from mtpctl.errors import MtpctlError

#: where the ``mtpctl`` package lives: put first on the worker's path, so it imports this same mtpctl
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
#: the longest a peer may take to load or to answer one run, seconds, unless the caller says otherwise
DEFAULT_TIMEOUT_S = 900.0


class PeerFailed(MtpctlError):
    """A peer of the benchmark crashed, hung or could not start. The bench marks its row failed with
    this reason, writes every other figure, and exits with code 4 (after the gates)."""

    exit_code = 4


class PeerProcess:
    """One peer running in ``command`` (default: the peer worker under this Python), spoken to in JSON
    lines (module docstring). ``log``: where the worker's stderr goes (a temporary file if None)."""

    def __init__(self, name: str, request: dict, timeout_s: float = DEFAULT_TIMEOUT_S,
                 command: Optional[Sequence[str]] = None, log: Optional[Path] = None):
        self.name = name
        self.timeout_s = timeout_s
        self._log = open(log, "w+", encoding="utf-8") if log else tempfile.TemporaryFile("w+", encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT),
                                                                           os.environ.get("PYTHONPATH")]))}
        self._process = subprocess.Popen(list(command or [sys.executable, "-m", "mtpctl.bench.peer_worker"]),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                         text=True, env=env)
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.failure: Optional[str] = None  # once set, every later message fails at once with it
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.ask(request)  # raises PeerFailed (the worker closed) if the peer cannot start

    def _read(self) -> None:
        """Put each line of the worker's stdout on the queue, then None at its end."""
        for line in self._process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def ask(self, message: dict) -> dict:
        """Send one message, return the worker's answer.

        Raises:
            PeerFailed: the worker died, did not answer within the time limit, or answered an error
                (and, with the same reason, every message after that).
        """
        if self.failure:
            raise PeerFailed(self.failure)
        try:
            return self._exchange(message)
        except PeerFailed as err:
            self.failure = str(err)
            self.close()
            raise

    def _exchange(self, message: dict) -> dict:
        try:
            self._process.stdin.write(json.dumps(message) + "\n")
            self._process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the worker is gone: its end is read below and reported with its cause
        try:
            line = self._lines.get(timeout=self.timeout_s)
        except queue.Empty:
            raise PeerFailed(f"no answer within {self.timeout_s:.0f} s (killed)") from None
        if line is None:
            raise PeerFailed(self._ending())
        answer = json.loads(line)
        if "error" in answer:
            raise PeerFailed(answer["error"])
        return answer

    def _ending(self) -> str:
        """How the worker ended: the signal or exit code, and the last line it wrote to its log."""
        code = self._process.wait()
        cause = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        self._log.seek(0)
        words = last_words(self._log.read())
        return cause + (f" ({words[:300]})" if words else "")

    def close(self) -> None:
        """Stop the worker (killed if it does not leave within 5 s of its stdin closing) and its log."""
        if self._process.poll() is None:
            try:
                self._process.stdin.close()
                self._process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
        if not self._log.closed:
            self._log.close()


def start_peer(name: str, request: dict, eos_ids: Sequence[int], opened: List[PeerProcess],
               timeout_s: float = DEFAULT_TIMEOUT_S) -> Tuple[Callable[[List[int]], GenerationResult], Optional[dict]]:
    """Start a peer in its own process (appended to ``opened``, for the caller to close). Returns its
    runner (:func:`peer_runner`) and which build of it runs (the worker's ``build``), or, for a peer
    that cannot start, a runner that fails with the reason and None."""
    try:
        peer = PeerProcess(name, request, timeout_s)
    except PeerFailed as err:
        return _failing(str(err)), None
    opened.append(peer)
    return peer_runner(peer, eos_ids), peer.ready.get("build")


def _failing(reason: str) -> Callable[[List[int]], GenerationResult]:
    def run(prompt_ids: List[int]) -> GenerationResult:
        raise PeerFailed(reason)
    return run


def last_words(log: str) -> str:
    """What a worker's log says of its end: after a crash, the innermost Python frame of the stack
    ``faulthandler`` printed (where the library was called); otherwise its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    if "Fatal Python error" in log:
        frames = [line for line in lines if line.startswith("File ")]
        if frames:
            return "crashed in " + frames[0].replace("File ", "", 1)
    return lines[-1] if lines else ""


def peer_runner(peer: PeerProcess, eos_ids: Sequence[int]) -> Callable[[List[int]], GenerationResult]:
    """A runner ``prompt ids -> GenerationResult`` for :func:`mtpctl.bench.harness.run_interleaved`
    that has ``peer`` generate; its runs carry total time and new tokens only."""
    eos = set(eos_ids)

    def run(prompt_ids: List[int]) -> GenerationResult:
        answer = peer.ask({"prompt_ids": list(prompt_ids)})
        tokens = list(answer["token_ids"])
        stats = GenerationStats(prompt_tokens=len(prompt_ids), new_tokens=len(tokens), ttft_ms=None,
                                total_ms=answer["total_ms"])
        return GenerationResult(tokens, "", "eos" if tokens and tokens[-1] in eos else "length", stats)

    return run
