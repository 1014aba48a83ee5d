"""benchmarks/ holds current references only, and benchmarks/README.md indexes them.

Every run folder and record under a machine's folder is cited by a claim (README.md, docs/ or
speclm/defaults.py) and by the index; every citation of benchmarks/ anywhere in the repository
(pages, code, tests, scripts) points at something that is there (`<commit>:benchmarks/...` cites
git's history and is left alone); every script is named by the index, a record or a page; and the tree
stays within its limits. A record is a section of its machine's records.md."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MACHINES = ("epyc", "amx", "avx2", "intel")
HELPERS = {"gemm_shapes.py", "timing.py"}  # imported by the scripts
MAX_ENTRIES = 30  # run folders and records files (a machine's records.md holds its records), all machines together
MAX_INDEX_BYTES = 8 * 1024
MAX_DOCS_PAGE_BYTES = 20_000  # 20 KB
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
# benchmarks/<machine>/<entry>[/<file>][#<section>], not after "<commit>:" (a path in git's history);
# "../benchmarks/..." and the index's own "epyc/..." links are read the same way
CITE = re.compile(r"(?<![\w:])(?:benchmarks/|\.\./|(?<=\]\())(" + "|".join(MACHINES) +
                  r")/([\w.\-]+)((?:/[\w.\-]+)*)(?:#([\w\-]+))?")


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(records: Path) -> set[str]:
    """The anchors of a records.md's sections (its outputs are fenced: their lines are no headings)."""
    text = FENCE.sub("", records.read_text())
    return {_slug(line[3:]) for line in text.splitlines() if line.startswith("## ")}


def entries(root: Path) -> set[str]:
    """'machine/folder' for each run folder, 'machine/records.md#section' for each record."""
    found = set()
    for machine in MACHINES:
        for path in sorted((root / "benchmarks" / machine).iterdir()):
            if path.name == "records.md":
                found |= {f"{machine}/records.md#{s}" for s in sections(path)}
            else:
                found.add(f"{machine}/{path.name}")
    return found


def entry_count(root: Path) -> int:
    return sum(1 for machine in MACHINES for _ in (root / "benchmarks" / machine).iterdir())


def citations(text: str) -> set[str]:
    """What a text cites, as entries(): a folder (whatever file in it), or a record's section."""
    cited = set()
    for machine, name, _, anchor in CITE.findall(text):
        cited.add(f"{machine}/{name}#{anchor}" if name == "records.md" and anchor else f"{machine}/{name}")
    return cited


def claim_pages(root: Path) -> dict[str, str]:
    pages = {"README.md": root / "README.md", "speclm/defaults.py": root / "speclm" / "defaults.py"}
    pages |= {f"docs/{p.name}": p for p in sorted((root / "docs").glob("*.md"))}
    return {name: path.read_text() for name, path in pages.items()}


def citing_files(root: Path) -> dict[str, str]:
    """Every file that may cite benchmarks/: pages, the index, code, tests and scripts."""
    files = [root / "README.md", root / "benchmarks" / "README.md", *(root / "docs").glob("*.md"),
             *(root / "speclm").rglob("*.py"), *(root / "tests").glob("*.py"), *(root / "benchmarks").glob("*.py")]
    return {str(p.relative_to(root)): p.read_text() for p in files if p.name != Path(__file__).name}  # its plants


def problems(root: Path) -> list[str]:
    found = []
    bench = root / "benchmarks"
    for path in sorted(bench.iterdir()):
        if path.is_dir() and path.name not in MACHINES and path.name != "__pycache__":
            found.append(f"benchmarks/{path.name}/: not a machine's folder ({', '.join(MACHINES)})")
        elif path.is_file() and path.suffix != ".py" and path.name != "README.md":
            found.append(f"benchmarks/{path.name}: a record belongs in a machine's records.md")
    count = entry_count(root)
    if count > MAX_ENTRIES:
        found.append(f"{count} run folders and records files, more than {MAX_ENTRIES}")
    have = entries(root)
    claims = set().union(*map(citations, claim_pages(root).values()))
    index = citations((bench / "README.md").read_text())
    found += [f"benchmarks/{e}: cited by no claim (README.md, docs/, speclm/defaults.py)" for e in sorted(have - claims)]
    found += [f"benchmarks/{e}: missing from the index, benchmarks/README.md" for e in sorted(have - index)]
    for name, text in citing_files(root).items():
        for machine, entry, rest, anchor in CITE.findall(text):
            target = bench / machine / entry / rest.lstrip("/")
            if not target.exists():
                found.append(f"{name}: cites benchmarks/{machine}/{entry}{rest}, which is not there")
            elif entry == "records.md" and anchor and anchor not in sections(target):
                found.append(f"{name}: cites benchmarks/{machine}/records.md#{anchor}, no such record")
    named = "\n".join([(bench / "README.md").read_text(), *(p.read_text() for p in bench.glob("*/records.md")),
                       *claim_pages(root).values()])
    found += [f"benchmarks/{p.name}: neither the index, a record nor a page names it" for p in sorted(bench.glob("*.py"))
              if p.name not in HELPERS and p.name not in named]
    if len((bench / "README.md").read_bytes()) > MAX_INDEX_BYTES:
        found.append(f"benchmarks/README.md: over {MAX_INDEX_BYTES} bytes")
    found += [f"docs/{p.name}: over {MAX_DOCS_PAGE_BYTES} bytes" for p in sorted((root / "docs").glob("*.md"))
              if len(p.read_bytes()) > MAX_DOCS_PAGE_BYTES]
    return found


def test_benchmarks_hold_only_cited_runs_and_every_citation_resolves():
    assert problems(ROOT) == []


@pytest.fixture
def copy(tmp_path) -> Path:
    """The pages, code, tests and benchmarks/ (about 11 MB) in a folder of their own."""
    for name in ("README.md", "docs", "speclm", "tests"):
        src = ROOT / name
        (shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
         if src.is_dir() else shutil.copy(src, tmp_path / name))
    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    assert problems(tmp_path) == []
    return tmp_path


def test_an_uncited_run_fails(copy):
    (copy / "benchmarks" / "epyc" / "methods-int8-qwen1.5b-12-old").mkdir()
    # (with the index at MAX_ENTRIES the count is over too: that check has its own test)
    assert [p for p in problems(copy) if "run folders and records files" not in p] == [
        "benchmarks/epyc/methods-int8-qwen1.5b-12-old: cited by no claim (README.md, docs/, speclm/defaults.py)",
        "benchmarks/epyc/methods-int8-qwen1.5b-12-old: missing from the index, benchmarks/README.md"]


def test_a_record_cited_only_by_the_index_fails(copy):
    records = copy / "benchmarks" / "amx" / "records.md"
    records.write_text(records.read_text() + "\n## an-old-ab\n\n~~~text\n| rows | ms |\n~~~\n")
    index = copy / "benchmarks" / "README.md"
    text = index.read_text()
    machines = text[text.index("\n## "):]  # the intro left out: room for the row within the index's size
    index.write_text("# Benchmarks\n" + machines + "\n[old](amx/records.md#an-old-ab)\n")
    assert problems(copy) == ["benchmarks/amx/records.md#an-old-ab: cited by no claim (README.md, docs/, "
                              "speclm/defaults.py)"]


def test_a_citation_of_nothing_fails(copy):
    page = copy / "docs" / "defaults.md"
    page.write_text(page.read_text() + "\nSee [a run](../benchmarks/avx2/trees-int8-qwen1.5b-60/report.md), "
                    "benchmarks/epyc/records.md#no-such-record, and 44a4c5c:benchmarks/avx2/trees-int8-qwen1.5b-60.\n")
    code = copy / "speclm" / "engine.py"
    code.write_text(code.read_text() + "# measured in benchmarks/intel/gone.txt\n")
    assert problems(copy) == [
        "docs/defaults.md: cites benchmarks/avx2/trees-int8-qwen1.5b-60/report.md, which is not there",
        "docs/defaults.md: cites benchmarks/epyc/records.md#no-such-record, no such record",
        "speclm/engine.py: cites benchmarks/intel/gone.txt, which is not there"]


def test_loose_records_unnamed_scripts_and_the_limits_fail(copy):
    (copy / "benchmarks" / "prompt-lengths.txt").write_text("| kind | prompts |\n")
    (copy / "benchmarks" / "old_ab.py").write_text("print('an A/B nobody cites')\n")
    index = copy / "benchmarks" / "README.md"
    index.write_text(index.read_text() + "x" * MAX_INDEX_BYTES)
    page = copy / "docs" / "serving.md"
    page.write_text(page.read_text() + "y" * MAX_DOCS_PAGE_BYTES)
    for i in range(MAX_ENTRIES + 1 - entry_count(copy)):
        (copy / "benchmarks" / "intel" / f"run-{i}").mkdir()
    found = problems(copy)
    assert found[:2] == ["benchmarks/prompt-lengths.txt: a record belongs in a machine's records.md",
                         f"{MAX_ENTRIES + 1} run folders and records files, more than {MAX_ENTRIES}"]
    assert {"benchmarks/old_ab.py: neither the index, a record nor a page names it", "benchmarks/README.md: over 8192 bytes",
            f"docs/serving.md: over {MAX_DOCS_PAGE_BYTES} bytes"} <= set(found)
