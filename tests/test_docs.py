"""The documentation is true to the tree: every `harness ...` command shown in README.md and docs/*.md
(in code spans and code blocks) exists in the typer app with every option it names and answers --help;
every scripts/, examples/, tests/ and experiments/ path they name exists; and every relative markdown
link in README.md, docs/*.md and paper_figures/*.md points at a file that exists, and its #anchor at a
heading of that file (GitHub's slugs)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from harness.cli import app, main

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


def link_targets(path: Path) -> list[tuple[str, str | None]]:
    """(file, anchor) of every relative link outside code; file '' for an anchor in the same file."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    text = SPAN.sub("", text)
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, mailto:
        file, sep, anchor = target.partition("#")
        out.append((file, anchor if sep else None))
    return out


def relative_links(path: Path) -> list[str]:
    return [file for file, _ in link_targets(path) if file]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (links, code and emphasis marks dropped),
    lowercased, every character but letters, digits, '_', '-' and spaces dropped, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file (outside code blocks), with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


@pytest.mark.parametrize("doc", LINK_DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc):
    broken = [t for t in relative_links(doc) if not (doc.parent / t).exists()]
    assert not broken, f"{doc.relative_to(ROOT)}: links to files that do not exist: {broken}"
    bad = []
    for file, anchor in link_targets(doc):
        target = doc.parent / file if file else doc
        if anchor is None or target.suffix != ".md" or not target.is_file():
            continue
        if anchor not in anchors(target):
            bad.append(f"{file}#{anchor}")
    assert not bad, f"{doc.relative_to(ROOT)}: links to headings that do not exist: {bad}"


def test_slugs_follow_github():
    assert slug("Benchmark: `harness bench step`") == "benchmark-harness-bench-step"
    assert slug("Multi-node physics (16+ nodes)") == "multi-node-physics-16-nodes"
    assert slug("8. Orthogonalization variants measured on this CPU") == (
        "8-orthogonalization-variants-measured-on-this-cpu")
    assert slug("The `moe` experiments") == "the-moe-experiments"
    assert slug("Split NS: [owner groups](x.md) in the_simulator") == "split-ns-owner-groups-in-the_simulator"


def test_anchor_checker_catches_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n## Part one\n## Part one\n```\n# not a heading\n```\n")
    assert anchors(tmp_path / "a.md") == {"top", "part-one", "part-one-1"}
    (tmp_path / "b.md").write_text("[x](a.md#part-one-1) [y](a.md#not-a-heading) [z](#here)\n")
    assert link_targets(tmp_path / "b.md") == [("a.md", "part-one-1"), ("a.md", "not-a-heading"),
                                               ("", "here")]


# ---- every command answers --help; every named script, example, test and experiment file exists --------
def _distinct_commands() -> list[tuple[str, ...]]:
    """The (sub)command paths the docs name, once each (`bench step`, `run`, ...)."""
    root = typer.main.get_command(app)
    out = set()
    for _, tokens in _all_commands():
        cmd, path = root, []
        for t in tokens:
            if not hasattr(cmd, "commands") or t not in cmd.commands:
                break
            cmd = cmd.commands[t]
            path.append(t)
        if path:
            out.add(tuple(path))
    return sorted(out)


def test_every_shown_command_answers_help(capsys):
    commands = _distinct_commands()
    assert {("run",), ("bench", "step"), ("plan",), ("simulate",)} <= set(commands)
    failed = []
    for path in commands:
        code = main([*path, "--help"])
        out = capsys.readouterr().out
        if code != 0 or "Usage" not in out:
            failed.append(f"harness {' '.join(path)} --help: exit {code}")
    assert not failed, "\n".join(failed)


PATH = re.compile(r"(?<![\w./-])((?:scripts|examples|tests|experiments)/[\w./-]*[\w/])")


def named_paths(path: Path) -> list[str]:
    """scripts/..., examples/..., tests/..., experiments/... paths named in `path` (placeholders with *,
    <...> or $ skipped: they name a pattern, not a file)."""
    out = []
    for m in PATH.finditer(path.read_text(encoding="utf-8")):
        after = m.string[m.end(): m.end() + 1]
        if after in ("*", "<", "$", "{"):
            continue
        out.append(m.group(1))
    return out


# files the docs ask the reader to write (not in the tree on purpose)
YOURS = {"experiments/my_question.toml"}  # docs/user_guide.md, "Write a sweep"


@pytest.mark.parametrize("doc", COMMAND_DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_named_script_and_example_exists(doc):
    missing = sorted({p for p in named_paths(doc) if not (ROOT / p).exists() and p not in YOURS})
    assert not missing, f"{doc.relative_to(ROOT)}: names paths that do not exist: {missing}"


def test_path_finder_skips_patterns(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("run `scripts/gpu_check.sh`, see experiments/*.toml, experiments/clusters/<name>.toml "
                   "and tests/test_docs.py. Also examples/train_hf.py, a/scripts/no.py\n")
    assert named_paths(doc) == ["scripts/gpu_check.sh", "tests/test_docs.py", "examples/train_hf.py"]


def test_link_checker_sees_links_and_skips_urls_and_code(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("[a](docs/a.md#part) ![b](fig.png) [c](https://x.org) [d](#here) `[e](code.md)`\n"
                   "```\n[f](block.md)\n```\n")
    assert relative_links(doc) == ["docs/a.md", "fig.png"]


def test_readme_commands_table_lists_every_command():
    """README's "Commands" table has one row per command of the app, and no row for a command it lacks."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("## Commands", 1)[1].split("\n## ", 1)[0]
    shown = re.findall(r"^\| `harness ([a-z][\w -]*?)(?: \[[A-Z]+\])?`", table, re.M)
    rows = {tuple(m.split()) for m in shown}
    root = typer.main.get_command(app)
    have = {(name, *sub) for name, cmd in root.commands.items()
            for sub in ([[s] for s in cmd.commands] if hasattr(cmd, "commands") else [[]])}
    assert rows == have, f"README Commands table lacks {sorted(have - rows)}, has {sorted(rows - have)}"

