"""CLI errors that name the option the user typed.

The library raises `InputError`s that name its own parameters ("world_size must be a positive integer,
got -3"; "unknown balancer 'foo'; accepted: ..."). Every `harness` command is an `OptionCommand`
(harness.cli makes it the default): when an InputError leaves the command, its message is rewritten to
name the command's options as typed on the command line:

- a message that starts with a parameter name ("seq_len must ...", "gpus=12 is not ...", "workload 'x'
  has ...") starts with the option instead ("--seq-len must ..."), and a hint "set gpus_per_node"
  becomes "set --gpus-per-node";
- an unknown choice (`dmuon.errors.choice_error`) is prefixed with the option whose value it was
  ("--balancer: unknown balancer 'foo'; accepted: ...").

A command's own options are known from its click parameters (`max_batch` -> `--max-batch`). Where the
library calls a value by another name than the option, the command says so:
`cls=option_command(world_size="ranks")` (library name -> the command's parameter name). The error keeps
its class and traceback; only its message changes.
"""

from __future__ import annotations

import ast
import re

from typer.core import TyperCommand

from dmuon.errors import InputError

_SUBJECT = r"(?=\s+must\b|\s+is\b|\s+has\b|=|\s+')"  # "name must ...", "name=12 is ...", "name 'x' has"
_CHOICE = re.compile(r"unknown [^'\"]*?('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")")


def _flags(command) -> dict[str, str]:
    """parameter name -> the option as typed (its first long form), for the command's options."""
    out = {}
    for p in command.params:
        longs = [o for o in p.opts if o.startswith("--")]
        if longs and p.name:
            out[p.name] = longs[0]
    return out


def _choice_value(err: InputError, message: str):
    """The rejected value of an unknown-choice error (choice_error's `got`, else parsed), or None."""
    if getattr(err, "got", None) is not None:
        return err.got
    m = _CHOICE.match(message)
    if not m:
        return None
    try:
        return ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError):
        return None


def _holds(value, got) -> bool:
    """Whether an option's value is `got`, or a comma list / list that contains it."""
    if value is None or isinstance(value, bool):
        return False
    if isinstance(value, (list, tuple)):
        return any(_holds(v, got) for v in value)
    if value == got:
        return True
    return isinstance(value, str) and str(got) in [x.strip() for x in value.split(",")]


def name_options(err: InputError, message: str, flags: dict[str, str], params: dict,
                 typed: set[str]) -> str:
    """`message` with the library's parameter names replaced by the options in `flags` (name -> option).
    `params` are the command's values by parameter name and `typed` the names given on the command line
    (they win when several options hold a rejected choice)."""
    if message.startswith("-"):
        return message  # names an option already
    for name in sorted(flags, key=len, reverse=True):
        if re.match(re.escape(name) + _SUBJECT, message):
            message = flags[name] + message[len(name):]
            break
    for name in sorted(flags, key=len, reverse=True):
        message = re.sub(r"(?<=\bset )" + re.escape(name) + r"\b", flags[name], message)
    got = _choice_value(err, message)
    if got is not None and not message.startswith("-"):
        holders = [n for n in params if n in flags and _holds(params[n], got)]
        holders.sort(key=lambda n: n not in typed)
        if holders:
            message = f"{flags[holders[0]]}: {message}"
    return message


class OptionCommand(TyperCommand):
    """A typer command whose InputErrors name its options as typed (see the module docstring)."""

    library_names: dict[str, str] = {}  # library parameter name -> this command's parameter name

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as e:
            flags = _flags(self)
            flags.update({lib: flags[own] for lib, own in self.library_names.items() if own in flags})
            typed = {n for n in ctx.params
                     if getattr(ctx.get_parameter_source(n), "name", "") == "COMMANDLINE"}
            message = str(e)
            new = name_options(e, message, flags, ctx.params, typed)
            if new != message:
                e.args = (new,)
            raise


def option_command(**library_names: str) -> type[OptionCommand]:
    """An OptionCommand class for a command whose library calls some values by other names:
    option_command(world_size="ranks") names `--ranks` where the library says `world_size`."""
    namespace = {"library_names": dict(library_names), "__module__": __name__}
    return type("OptionCommand", (OptionCommand,), namespace)


__all__ = ["OptionCommand", "name_options", "option_command"]
