"""The ``mtpctl`` entry point: the command group and the one place where errors become a line on
stderr and an exit code (see :mod:`mtpctl.errors`)."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import click

from mtpctl.version import __version__
from mtpctl.cli.add_heads import add_heads_cmd
from mtpctl.cli.bench import bench_cmd
from mtpctl.cli.export import export_cmd
from mtpctl.cli.generate import generate_cmd
from mtpctl.cli.models import models_group
from mtpctl.cli.pair import pair_cmd
from mtpctl.errors import MtpctlError, OutputClosed

INTERNAL_ERROR, INTERRUPTED = 3, 130


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog="""\b
Examples:
  mtpctl generate "Write a haiku about caches."
  mtpctl generate --speculate ngram --stats --prompt-file notes.txt
  mtpctl bench --methods plain,ngram --limit 1 --fail-below-speedup 1.1
  mtpctl models list

\b
Environment:
  MTPCTL_HOME              cache root (default $XDG_CACHE_HOME/mtpctl, else ~/.cache/mtpctl): models/
                           and gguf/ (imported models), hub/, work/ (add-heads' cached features and
                           --resume checkpoints), kernels/ (the native kernel library) and
                           pass_costs/ (the auto policy's tables measured on first use); all but
                           models/ and gguf/ are rebuilt when deleted
  CC                       C compiler (may carry arguments, e.g. "ccache gcc") for the native kernels
                           (attention, RMSNorm, RoPE, int4); default cc
  MTPCTL_NATIVE_KERNELS    0, false, off or no: torch's ops instead of the native kernels
  MTPCTL_MEASURE_POLICY    off: the auto policy never measures a pass-cost table for a model without
                           one, it borrows the shipped table of this CPU's kind
  MTPCTL_DEBUG             1: as --debug
""")
@click.version_option(__version__, prog_name="mtpctl")
@click.option("--debug", is_flag=True, help="Show the full traceback of an error.")
def cli(debug: bool) -> None:
    """mtpctl: multi-token prediction heads and speculative decoding for LLMs.

    stdout carries the product (text, JSON or JSONL), stderr progress and logs; nothing prompts.
    Exit codes: 0 ok, 1 a gate failed, 2 bad input or a missing resource, 3 internal error (a bug:
    the traceback with --debug), 130 interrupted, 141 stdout closed by its reader.
    """


cli.add_command(generate_cmd)
cli.add_command(add_heads_cmd)
cli.add_command(bench_cmd)
cli.add_command(models_group)
cli.add_command(export_cmd)
cli.add_command(pair_cmd)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI; return its exit code. ``--debug`` (or ``MTPCTL_DEBUG=1``) re-raises errors."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("MTPCTL_DEBUG") == "1"
    try:
        result = cli.main(args=args, prog_name="mtpctl", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except click.exceptions.Abort:
        return INTERRUPTED
    except click.ClickException as err:
        if debug:
            raise
        return _fail(err.format_message(), err.exit_code)
    except MtpctlError as err:
        if debug:
            raise
        return _fail(str(err), err.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted", INTERRUPTED)
    except OutputClosed as err:  # stdout's reader went away (e.g. `| head`): stop quietly
        return err.exit_code
    except Exception as err:  # a bug: one line, the traceback with --debug
        if debug:
            raise
        return _fail(f"internal error: {type(err).__name__}: {err} (rerun with --debug for the traceback)",
                     INTERNAL_ERROR)


def _fail(message: str, code: int) -> int:
    click.echo(f"mtpctl: error: {' '.join(message.split())}", err=True)
    return code


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
