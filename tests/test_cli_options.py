"""CLI errors name the option the user typed (harness.options), not the library's parameter name:
numeric options of plan, simulate, bench step, profile, validate and bench kernels, and choice options
(the rejected value is traced back to the option that held it). Every check fails before any work."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from dmuon.errors import InputError, choice_error
from harness.cli import app
from harness.options import OptionCommand, name_options

PLAN = ["plan", "--workload", "qwen2.5-7b"]
CASES = [  # (argv, the message must start with)
    ([*PLAN, "--ranks", "-3"], "--ranks must be a positive integer (at most 1048576), got -3"),
    ([*PLAN, "--ranks", "8", "--max-batch", "0"], "--max-batch must be a positive integer, got 0"),
    ([*PLAN, "--ranks", "8", "--bucket-numel", "-1"], "--bucket-numel must be a non-negative integer"),
    ([*PLAN, "--ranks", "8", "--time-limit", "-1"], "--time-limit must be positive, got -1.0"),
    ([*PLAN, "--ranks", "8", "--scale", "-1"], "--scale must be a finite number > 0, got -1.0"),
    ([*PLAN, "--ranks", "8", "--blocks", "0"], "--blocks must be a positive integer, got 0"),
    ([*PLAN, "--ranks", "8", "--memory-cap-gb", "-1"], "--memory-cap-gb must be a positive number of GB"),
    ([*PLAN, "--ranks", "8", "--balancer", "foo"], "--balancer: unknown balancer 'foo'; accepted: "),
    ([*PLAN, "--ranks", "8", "--dtype", "fp8"], "--dtype: unknown dtype 'fp8'; accepted: "),
    (["simulate", "--gpus", "-3"], "--gpus must be an integer >= 1 and <= 65536, got -3"),
    (["simulate", "--seq-len", "0"], "--seq-len must be an integer >= 1, got 0"),
    (["simulate", "--gpus-per-node", "0"], "--gpus-per-node must be an integer >= 1, got 0"),
    (["simulate", "--overlap-slowdown", "-1"], "--overlap-slowdown must be a finite number >= 0"),
    (["simulate", "--gpus", "12"], "--gpus=12 is not a whole number of 8-GPU nodes"),
    (["simulate", "--layout", "zero4"], "--layout: unknown layout 'zero4'; accepted: "),
    (["simulate", "--gpu", "b200"], "--gpu: unknown gpu profile 'b200'; accepted: "),
    (["bench", "step", "--ranks", "-3"], "--ranks must be an integer >= 1, got -3"),
    (["bench", "step", "--micro-batch", "0"], "--micro-batch must be an integer >= 1, got 0"),
    (["bench", "step", "--layers", "0"], "--layers must be a positive integer, got 0"),
    (["bench", "step", "--timeout-s", "-1"], "--timeout-s must be a finite number of seconds > 0"),
    (["bench", "step", "--width-scale", "-1"], "--width-scale must be > 0, got '-1'"),
    (["bench", "step", "--strategy", "dmuon,sgd"], "--strategy: unknown strategy 'sgd'; accepted: "),
    (["bench", "step", "--exchange", "ring"], "--exchange: unknown exchange 'ring'; accepted: "),
    (["profile", "--max-batch", "0"], "--max-batch must be a positive integer, got 0"),
    (["profile", "--repeats", "0"], "--repeats must be a positive integer, got 0"),
    (["profile", "--methods", "newton"], "--methods: unknown method 'newton'; accepted: "),
    (["validate", "--ranks", "0,2"], "--ranks must be a comma list of positive integers, got '0,2'"),
    (["bench", "kernels", "--scale", "0"], "--scale must be a positive integer, got 0"),
]


@pytest.mark.parametrize("argv,start", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_error_names_the_option_typed(argv, start):
    result = CliRunner().invoke(app, argv)
    assert isinstance(result.exception, InputError), result.output
    assert str(result.exception).startswith(start), str(result.exception)


def test_every_command_is_an_option_command():
    root = typer.main.get_command(app)
    stack, seen = [root], []
    while stack:
        cmd = stack.pop()
        if hasattr(cmd, "commands"):
            stack += list(cmd.commands.values())
        else:
            seen.append(cmd.name)
            assert isinstance(cmd, OptionCommand), cmd.name
    assert {"plan", "simulate", "run", "step", "profile", "validate", "kernels"} <= set(seen)


def test_only_names_at_the_start_or_in_a_set_hint_are_rewritten():
    flags = {"workload": "--workload", "gpus_per_node": "--gpus-per-node", "blocks": "--blocks"}
    err = InputError("x")
    # a file's own key (not the subject of the message) keeps its name
    assert name_options(err, "w.toml: blocks must be a positive integer", flags, {}, set()) \
        == "w.toml: blocks must be a positive integer"
    assert name_options(err, "the workload's matrices differ", flags, {}, set()) \
        == "the workload's matrices differ"
    assert name_options(err, "gpus=12 ...; or set gpus_per_node", flags, {}, set()) \
        == "gpus=12 ...; or set --gpus-per-node"
    assert name_options(err, "--ranks must be", {"ranks": "--x"}, {}, set()) == "--ranks must be"


def test_a_choice_is_traced_to_the_option_that_held_it():
    err = choice_error("dtype", "fp8", ("bf16", "fp32"))
    assert (err.got, err.accepted) == ("fp8", ("bf16", "fp32"))
    flags = {"dtype": "--dtype", "methods": "--methods"}
    msg = name_options(err, str(err), flags, {"dtype": "bf16,fp8", "methods": None}, {"dtype"})
    assert msg == "--dtype: unknown dtype 'fp8'; accepted: bf16, fp32"
    # no option holds the value (it came from a file): the message stays as it is
    assert name_options(err, str(err), flags, {"dtype": "bf16"}, set()) == str(err)
    # a hand-written 'unknown ...' message is parsed the same way
    plain = InputError("unknown profile 'nope'; accepted: a800")
    assert re.match(r"--profile: ", name_options(plain, str(plain), {"profile": "--profile"},
                                                 {"profile": "nope"}, set()))


@pytest.mark.parametrize("command", ["search", "simulate", "sensitivity"])
def test_gpu_help_lists_every_builtin_profile(command):
    """--gpu's help text is built from simulator/profiles/*.toml (harness.profile_help): every built-in
    profile is named (sensitivity: those with an [uncertainty] table, and no other)."""
    from simulator.fabric.hardware import PROFILE_DIR, profile_names

    r = CliRunner().invoke(app, [command, "--help"], terminal_width=400, env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    line = " ".join(ln for ln in r.output.splitlines() if "--gpu " in ln)
    assert "a100" in profile_names()  # the profile the old hand-written texts left out
    for name in profile_names():
        has_table = "[uncertainty]" in (PROFILE_DIR / f"{name}.toml").read_text()
        if command != "sensitivity" or has_table:
            assert re.search(rf"\b{re.escape(name)}\b", line), (name, line)
        else:
            assert not re.search(rf"\b{re.escape(name)}\b", line), (name, line)
