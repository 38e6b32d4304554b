"""`toolkit`: a thin click layer over the library; each command lives in toolkit/commands/."""

from __future__ import annotations

import errno
import os
import sys
import traceback

import click

from artifact.errors import ToolkitError
from toolkit import __version__

# Exit statuses (README "Exit statuses"): a verdict is 0 or 1 and nothing else may read as one.
EXIT_PASS, EXIT_DIVERGED, EXIT_USER_ERROR, EXIT_INTERNAL_ERROR = 0, 1, 2, 3
DEBUG_ENV = "TOOLKIT_DEBUG"
# Errors of the file system a user can act on (a full disk, a read-only or forbidden directory, a file where a
# directory belongs), and what to do about each.
_WRITABLE = "free space or choose a writable location"
_USER_ERRNOS = {
    **dict.fromkeys(
        (errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EDQUOT, errno.ENAMETOOLONG),
        _WRITABLE,
    ),
    **dict.fromkeys(
        (errno.ENOTDIR, errno.EISDIR, errno.EEXIST),
        "a path names a file where a directory belongs, or the reverse; choose another location",
    ),
}


EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE


class UserError(click.ClickException):
    """A ToolkitError at the CLI edge: one line on stderr, exit status 2 (1 means "backends disagree")."""

    exit_code = EXIT_USER_ERROR


class InternalError(click.ClickException):
    """Anything else that escapes a command: one line, exit status 3, so a crash never reads as a verdict."""

    exit_code = EXIT_INTERNAL_ERROR


class ToolkitGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ToolkitError as exc:
            raise UserError(str(exc)) from None
        except click.exceptions.UsageError as exc:
            # click prints usage, a hint and the error on three lines; every failure here is one line.
            where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            raise UserError(f"{exc.format_message()} (see `{where} --help`)") from None
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except BrokenPipeError:
            # The reader of our output went away (`toolkit ... | head`): not a verdict and not a bug. Python's
            # documented handling: stdout to devnull, so the interpreter's last flush cannot raise again, and the
            # status a shell gives a writer killed by SIGPIPE.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(EXIT_BROKEN_PIPE)
        except OSError as exc:
            if exc.errno in _USER_ERRNOS:
                where = f"{exc.filename}: " if exc.filename else ""
                raise UserError(f"{where}{exc.strerror or exc}; {_USER_ERRNOS[exc.errno]}") from None
            raise _internal(ctx, exc) from None
        except Exception as exc:  # the last resort: see InternalError
            raise _internal(ctx, exc) from None


def _internal(ctx, exc: BaseException) -> InternalError:
    if (ctx.obj or {}).get("debug") or os.environ.get(DEBUG_ENV) == "1":
        traceback.print_exception(exc, file=sys.stderr)
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "no message")
    return InternalError(
        f"internal error ({type(exc).__name__}: {first[:300]}); this is a toolkit bug, please report it with the "
        "command line (--debug prints the traceback)"
    )


@click.group(cls=ToolkitGroup)
@click.version_option(__version__, prog_name="toolkit")
@click.option("--debug", is_flag=True, help="Print the traceback of an internal error (exit status 3).")
@click.pass_context
def main(ctx, debug):
    """Export transformer decoders to ONNX and cross-check every backend against PyTorch.

    Exit statuses: 0 pass, 1 the backends diverge (check), 2 a user error (one line saying what to do), 3 an
    internal error (a toolkit bug; --debug shows its traceback)."""
    ctx.obj = {"debug": debug}
    from artifact.hashing import HASH_PROGRESS
    from toolkit.progress import Progress

    # Loading a multi-GB artifact hashes every file first; on a terminal that shows (toolkit/progress.py).
    progress = Progress("load")
    HASH_PROGRESS.set(progress if progress.enabled else None)


def _register() -> None:
    from toolkit.commands import (
        bench,
        check,
        depth,
        export,
        generate,
        inspect,
        presets,
        quantize,
        run,
        serve,
        walkthrough,
    )

    for module in (export, check, run, generate, serve, walkthrough, inspect, presets, depth, quantize, bench):
        main.add_command(module.command)


_register()
