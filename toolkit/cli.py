"""`toolkit`: a thin click layer over the library; each command lives in toolkit/commands/."""

from __future__ import annotations

import click

from artifact.errors import ToolkitError
from toolkit import __version__


class UserError(click.ClickException):
    """A ToolkitError at the CLI edge: one line on stderr, exit status 2 (1 means "backends disagree")."""

    exit_code = 2


class ToolkitGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ToolkitError as exc:
            raise UserError(str(exc)) from None


@click.group(cls=ToolkitGroup)
@click.version_option(__version__, prog_name="toolkit")
def main():
    """Export transformer decoders to ONNX and cross-check every backend against PyTorch."""
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
