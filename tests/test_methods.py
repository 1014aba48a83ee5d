"""The method registry (speclm.methods): every method declared once, read everywhere else.

No module outside the registry and the proposers branches on a method's name: a comparison, a
membership test or a prefix test against a method name fails here (`none` is left out: it is
also a weights mode, `--quantize none`; speclm/heads names its kinds of heads, which are the
Medusa and EAGLE methods' names too). The command line's choices, the server's, the bench's
and the docs' table are the registry's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from speclm import methods
from speclm.methods import NAMES, REGISTRY, Weights
from speclm.options import GenerationOptions

ROOT = Path(__file__).resolve().parent.parent
NAMED = set(NAMES) - {"none"}


def branches(source: str) -> list[tuple[int, str]]:
    """(line, name) for each comparison, membership or startswith test against a method name."""
    found = []

    def names_in(node) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMED:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [n for e in node.elts for n in names_in(e)]
        if isinstance(node, ast.BinOp):  # ("draft",) + (...)
            return names_in(node.left) + names_in(node.right)
        return []

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for side in sides:
                # "auto" is also a value of --quantize, --tree, --layers and OpenVINO's precision: a
                # branch on it counts where the other side is a method
                found += [(node.lineno, n) for n in names_in(side)
                          if n != "auto" or any("method" in ast.unparse(other) for other in sides if other is not side)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "startswith", "endswith", "partition"):
            found += [(node.lineno, n) for arg in node.args for n in names_in(arg)]
    return found


def modules() -> list[Path]:
    skip = {ROOT / "speclm" / "methods.py"}  # the heads' package names its kinds of heads, "medusa" and "eagle"
    return [p for p in sorted((ROOT / "speclm").rglob("*.py"))
            if p not in skip and "proposers" not in p.parts and "heads" not in p.parts]


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_branches_on_a_method_name(path):
    assert branches(path.read_text()) == []


def test_the_check_finds_branches():
    code = '''
if opts.method == "draft": pass
if method in ("medusa", "eagle"): pass
ok = label.startswith("draft")
x = name in DRAFT + ("eagle+pld",)
if quantize == "none": pass
engine.generate("hi", method="draft")
if args.quantize == "auto": pass
if opts.method != "auto": pass
'''
    assert branches(code) == [(2, "draft"), (3, "medusa"), (3, "eagle"), (4, "draft"), (5, "eagle+pld"), (9, "auto")]


def test_every_method_is_declared_once_and_builds():
    assert len(NAMES) == len(set(NAMES)) and NAMES[0] == "none"
    for m in REGISTRY.values():
        assert m.about and m.about[0].islower() and "\n" not in m.about
        assert set(m.shapes) <= {"chain", "tree"}
        assert m.needs in (methods.NOTHING, methods.DRAFT_MODEL, methods.HEADS)
        assert m.options <= set(GenerationOptions.__dataclass_fields__), m.name
        k = m.k(Weights("int8", "int4"), GenerationOptions(method=m.name))
        assert (k == 0) == (not m.proposes or m.plans)  # auto's length is its children's, planned


def test_the_command_line_and_server_offer_the_registrys_methods():
    from speclm.cli import build_parser
    from speclm.serve.protocol import SpeculationSpec

    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    method = next(a for a in generate._actions if "--method" in a.option_strings)
    assert tuple(method.choices) == NAMES
    for name in NAMES:
        assert f"{name}: {REGISTRY[name].about}" in method.help
        assert SpeculationSpec(method=name).method == name


def test_the_docs_show_the_registrys_table():
    page = (ROOT / "docs" / "methods.md").read_text()
    assert methods.markdown_table() in page, "paste speclm.methods.markdown_table() into docs/methods.md"


def test_adding_a_method_names_the_files_it_touches():
    """docs/architecture.md's "Adding a method" names the registry, a proposer and the tests."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("## Adding a method", 1)[1].split("\n## ", 1)[0]
    for part in ("speclm/methods.py", "speclm/proposers/", "tests/test_sampling_distribution.py",
                 "tests/test_methods.py"):
        assert part in section
    assert re.search(r"nothing\s+else", section, re.I)


def imports(path: Path) -> set[str]:
    """The speclm modules a file imports (at any depth of its code)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("speclm"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("speclm")}
    return found


# a floor never imports from the floors above it
FLOORS = {"forward": ("speclm.bench", "speclm.models.store", "speclm.engine", "speclm.round", "speclm.serve",
                      "speclm.heads", "speclm.methods"),
          "proposers": ("speclm.bench", "speclm.engine", "speclm.serve", "speclm.methods"),
          "heads": ("speclm.bench", "speclm.serve"),
          "quant": ("speclm.bench", "speclm.engine", "speclm.round", "speclm.forward", "speclm.serve")}


@pytest.mark.parametrize("floor", list(FLOORS))
def test_floors(floor):
    above = FLOORS[floor]
    for path in sorted((ROOT / "speclm" / floor).rglob("*.py")):
        bad = sorted(m for m in imports(path) if m.startswith(above))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
