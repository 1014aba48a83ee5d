"""The user's guide and the reference docs stay true to the code: links resolve, every CLI option
is in its help and in docs/cli.md, the tuned-defaults table is the code's, and the README's
Python quick start runs (on tiny models standing in for the catalog's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from speclm import defaults
from speclm.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)  # benchmarks' records.md fence outputs with ~~~


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def broken_links(page: Path) -> list[str]:
    """Relative links of a page (outside code blocks) whose file, or heading anchor, is missing."""
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), f"{page.name}: broken links {broken_links(page)}"


def test_the_link_check_finds_broken_links(tmp_path):
    (tmp_path / "other.md").write_text("## A `code` heading (v2)\n")
    page = tmp_path / "p.md"
    page.write_text("# Title\n[ok](#title) [ok](other.md#a-code-heading-v2) [gone](missing.md) "
                    "[bad anchor](#nowhere) [web](https://example.org)\n```\n[in code](skipped.md)\n```\n")
    assert broken_links(page) == ["missing.md", "#nowhere"]


def _commands(parser):
    """(name, subparser) for every leaf command: generate, bench, demo, models list, models pull."""
    for action in parser._subparsers._group_actions:
        for name, sub in action.choices.items():
            if sub._subparsers is not None:
                yield from ((f"{name} {n}", s) for n, s in _commands(sub))
            else:
                yield name, sub


COMMANDS = dict(_commands(build_parser()))


def test_every_command_is_documented():
    assert set(COMMANDS) == {"generate", "bench", "demo", "serve", "bench-serve", "tune", "models list", "models pull",
                             "models rm", "models verify", "heads data", "heads layers", "heads train", "draft distill"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_is_in_its_help_and_in_the_cli_docs(command):
    parser = COMMANDS[command]
    helptext = parser.format_help()
    cli_doc = (ROOT / "docs" / "cli.md").read_text()
    top = command.split()[0]
    section = cli_doc.split(f"## speclm {top}\n", 1)[1].split("\n## ", 1)[0]
    for action in parser._actions:
        for option in action.option_strings:
            if option in ("-h", "--help"):
                continue
            assert option in helptext, f"{command}: {option} missing from --help"
            assert action.help, f"{command}: {option} has no help text"
            assert f"`{option}" in section or f"{option} " in section, f"{command}: {option} not in docs/cli.md"


def test_k_help_states_the_tuned_defaults():
    for command in ("generate", "demo"):
        k = next(a for a in COMMANDS[command]._actions if "--k" in a.option_strings)
        assert f"default {defaults.K_DRAFT}" in k.help and f"{defaults.K_DRAFT_INT4} with an int4 draft" in k.help
    k = next(a for a in COMMANDS["generate"]._actions if "--k" in a.option_strings)
    assert f"{defaults.K_PLD}, {defaults.K_PLD_QUANTIZED} on int8/int4 weights" in k.help


def test_the_defaults_page_shows_the_code_table():
    page = (ROOT / "docs" / "defaults.md").read_text()
    table = defaults.markdown_table()
    assert table in page, "docs/defaults.md is out of date; paste speclm.defaults.markdown_table() into it"
    assert len(table.splitlines()) == len(defaults.TABLE) + 2


@pytest.mark.parametrize("tuned", defaults.TABLE, ids=lambda t: t.name)
def test_every_default_names_a_committed_run(tuned):
    path, _, anchor = tuned.run.partition("#")  # a record: a section of its machine's records.md
    assert (ROOT / path).exists(), f"{tuned.name}: {tuned.run} is not committed"
    assert not anchor or anchor in _anchors(ROOT / path), f"{tuned.name}: {tuned.run} has no such section"
    assert getattr(defaults, tuned.name) == tuned.value


def test_readme_is_a_short_guide():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12_500
    first_block = FENCE.search(text).group(0).splitlines()[1:-1]
    assert [line.split()[:2] for line in first_block] == [["make", "demo"], ["make", "test"]]


def test_readme_python_quick_start_runs(folders, monkeypatch, capsys):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)  # run in order, one namespace
    code = "\n".join(blocks)
    assert len(blocks) >= 2 and "engine.batch(" in blocks[1]
    assert 'load_model("qwen2.5-coder-1.5b"' in code and 'load_model("qwen2.5-coder-0.5b"' in code
    code = code.replace('"qwen2.5-coder-1.5b"', repr(folders["target"])).replace('"qwen2.5-coder-0.5b"', repr(folders["draft"]))
    code = code.replace("max_new_tokens=128", "max_new_tokens=12")  # tiny models: a short reply is enough
    code = code.replace('temperature=0.7, seed=1)', 'temperature=0.7, seed=1, max_new_tokens=12)')
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert len(out.token_ids) >= 1 and out.stats.target_forwards >= 1
    assert namespace["a"].done and namespace["b"].done and not namespace["batch"].active
    assert capsys.readouterr().out.strip()  # it printed the text and statistics


def test_serving_docs_list_the_fields_taken_and_not_acted_on():
    from speclm.serve.protocol import HARMLESS

    text = (ROOT / "docs" / "serving.md").read_text()
    for field in HARMLESS:
        assert f"`{field}`" in text, field
