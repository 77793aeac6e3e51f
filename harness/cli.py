"""The `harness` command: one typer app; each command lives in its own `harness.cmd_*` module.

Every module in `COMMAND_MODULES` defines `register(app, bench)` adding its commands to the main
app or to the `bench` sub-app; each command is a `harness.options.OptionCommand`, so that bad input
names the option the user typed. Heavy imports (torch, simpy, pulp) happen inside the commands so
`harness --help` stays fast.
"""

from __future__ import annotations

import importlib
import sys

import typer

from dmuon.errors import InputError

from .errors import RunFailed
from .options import OptionCommand

COMMAND_MODULES: list[str] = [
    "harness.cmd_plan",
    "harness.cmd_profile",
    "harness.cmd_bench_kernels",
    "harness.cmd_bench_step",
    "harness.cmd_simulate",
    "harness.cmd_sensitivity",
    "harness.cmd_run",
    "harness.cmd_search",
]

app = typer.Typer(
    name="harness",
    help="DMuon harness: simulate, benchmark, plan and sweep distributed Muon experiments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench = typer.Typer(help="Real measurements on this machine (kernels, training steps).", no_args_is_help=True)
app.add_typer(bench, name="bench")

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app, bench)
for _group in (app, bench):  # every command's InputErrors name its options as typed (harness.options)
    for _info in _group.registered_commands:
        if not (isinstance(_info.cls, type) and issubclass(_info.cls, OptionCommand)):
            _info.cls = OptionCommand  # typer's default TyperCommand


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: bad input -> one clear line on stderr and exit code 2 (a path that
    cannot be read or written counts as bad input); a run that failed (harness.errors.RunFailed) -> its
    message and exit code 1. Anything else is a bug and keeps its traceback."""
    from . import provenance

    provenance.ARGV = list(argv) if argv is not None else sys.argv[1:]  # the command line, as typed
    try:
        app(args=argv, prog_name="harness")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.filename is None:
            raise
        print(f"error: cannot use {str(e.filename)!r}: {e.strerror or type(e).__name__}; give a path "
              "that exists and that you may read (inputs) or write (outputs)", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:  # typer/click end every run with SystemExit (usage errors: code 2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
