"""The documentation is true to the tree: every `harness ...` command shown in README.md and docs/*.md
(in code spans and code blocks) exists in the typer app with every option it names, and every relative
markdown link in README.md, docs/*.md and paper_figures/*.md points at a file that exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from harness.cli import app

ROOT = Path(__file__).resolve().parents[1]
COMMAND_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK_DOCS = [*COMMAND_DOCS, *sorted((ROOT / "paper_figures").glob("*.md"))]

FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?:^|(?<=[\s/]))harness\s+(.*)$")
SHELL_END = re.compile(r"\s(?:\||&&|;|>|2>|#)\s?.*$")  # a pipe, a chain, a redirect or a comment
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _code_lines(text: str) -> list[str]:
    """Every line of every fenced block, then every inline code span outside them."""
    lines = [line for block in FENCE.findall(text) for line in block.splitlines()]
    prose = FENCE.sub("", text)
    return lines + SPAN.findall(prose)


def shown_commands(path: Path) -> list[list[str]]:
    """The argument lists after `harness` of every command shown in `path`'s code."""
    out = []
    for line in _code_lines(path.read_text(encoding="utf-8")):
        m = COMMAND.search(re.sub(r"(^|\s)#.*$", "", line).strip())  # a shell comment is prose
        if not m:
            continue
        rest = SHELL_END.sub("", m.group(1)).strip()
        if not re.match(r"-|[a-z][\w-]*(\s|$)", rest):
            continue  # prose in code (a diagram: `harness (expand, run) ──> ...`), not a command line
        try:
            tokens = shlex.split(rest)
        except ValueError:
            tokens = rest.split()
        tokens = [t[1:-1] if t.startswith("[") and t.endswith("]") else t for t in tokens]  # [--opt]
        if tokens:
            out.append(tokens)
    return out


def check_command(tokens: list[str], root) -> str | None:
    """None when `harness <tokens>` names an existing (sub)command and only options it has; else why not.
    `root` is the click command tree of the typer app (typer.main.get_command; groups have `.commands`)."""
    cmd, path = root, ["harness"]
    rest = list(tokens)
    while hasattr(cmd, "commands") and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        if name not in cmd.commands:
            if name.isupper() or name.startswith("<") or name == "...":
                return None  # a placeholder for the command (`harness COMMAND --help`)
            return f"{' '.join(path)} has no command {name!r} (has: {', '.join(sorted(cmd.commands))})"
        cmd = cmd.commands[name]
        path.append(name)
    if hasattr(cmd, "commands") and cmd is not root and not rest:
        return None  # a group on its own (`harness bench`)
    opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    for t in rest:
        if not t.startswith("-") or re.match(r"-\d|-\.\d", t) or t in ("-", "--", "..."):
            continue
        name = t.split("=", 1)[0]
        if name not in opts:
            return f"{' '.join(path)} has no option {name!r} (has: {', '.join(sorted(opts))})"
    return None


def _all_commands():
    return [(p.relative_to(ROOT).as_posix(), t) for p in COMMAND_DOCS for t in shown_commands(p)]


def test_docs_show_commands():
    """The extractor finds the commands the docs show (a broken extractor would make the next test pass)."""
    shown = {" ".join(t[:2]) for _, t in _all_commands()}
    assert {"run paper", "bench step", "plan --workload", "simulate --workload"} <= shown


@pytest.mark.parametrize("doc,tokens", _all_commands(), ids=lambda x: x if isinstance(x, str) else None)
def test_every_shown_command_exists(doc, tokens):
    problem = check_command(tokens, typer.main.get_command(app))
    assert problem is None, f"{doc}: `harness {' '.join(tokens)}`: {problem}"


def test_checker_catches_a_wrong_command_and_option():
    root = typer.main.get_command(app)
    assert check_command(["plan", "--ranks", "8"], root) is None
    assert "no command 'sim'" in check_command(["sim"], root)
    assert "no option '--rank'" in check_command(["plan", "--rank", "8"], root)
    assert "no option '--nope'" in check_command(["bench", "step", "--nope=1"], root)


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    text = SPAN.sub("", text)
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, mailto:, an anchor in the same file
        out.append(target.split("#", 1)[0])
    return out


@pytest.mark.parametrize("doc", LINK_DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc):
    broken = [t for t in relative_links(doc) if not (doc.parent / t).exists()]
    assert not broken, f"{doc.relative_to(ROOT)}: links to files that do not exist: {broken}"


def test_link_checker_sees_links_and_skips_urls_and_code(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("[a](docs/a.md#part) ![b](fig.png) [c](https://x.org) [d](#here) `[e](code.md)`\n"
                   "```\n[f](block.md)\n```\n")
    assert relative_links(doc) == ["docs/a.md", "fig.png"]
