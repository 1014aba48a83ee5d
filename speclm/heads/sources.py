"""Training prompts for the draft heads (speclm.heads.data), made only from text on this machine
under permissive licences, each with its provenance and licence.

Sources:
- the Python standard library's source (PSF-2.0): functions and classes with docstrings
  (read with `ast`, huge ones skipped) become code tasks of several styles (write, complete,
  explain, type hints, docstring, tests, find the bug, refactor, port, complexity, review,
  JSON extraction); module and long docstrings become text tasks (summarize, answer questions
  about, retrieval-augmented QA), their sentences translation tasks;
- the installed distributions whose licence (read from their metadata with importlib.metadata:
  License-Expression, else the License classifiers, else the License field) is MIT, BSD, Apache,
  PSF or an equally permissive one (ISC, Zlib, CC0, BSL; `is_permissive`), the same way (their
  tests and vendored code left out);
- prompts the builder writes itself (source "speclm-templates", speclm's own Apache-2.0):
  math word problems with random numbers, reasoning puzzles; writing, role-play and advice
  instructions combine its templates with a docstring's summary (and carry that docstring's
  source and licence).

The kinds follow Spec-Bench's (multi-turn conversation -> "conversation", translation,
summarization, question answering, math reasoning, retrieval-augmented QA), with code weighted
highest (KIND_WEIGHTS), as the default target is a code model.

`stream(seed)` yields the prompts lazily in a fixed order (files are read only as prompts need
them), so the first n prompts of a seed do not depend on how many are asked for: a bigger
--prompts extends a build. The order depends on the seed and on the files on the machine (the
Python version, the installed packages). A prompt's id is the sha1 of its text.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import platform
import random
import re
import sysconfig
import textwrap
import warnings
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Callable, Iterator

GENERATED = "speclm-templates"  # prompts the builder writes itself
GENERATED_LICENCE = "Apache-2.0"  # speclm's own licence

# the share of each kind among the prompts (Spec-Bench's kinds, code weighted highest)
KIND_WEIGHTS = {
    "code": 0.40,
    "conversation": 0.12,
    "qa": 0.10,
    "summarization": 0.10,
    "math": 0.10,
    "translation": 0.09,
    "rag": 0.09,
}
STDLIB_SHARE = 0.4  # of the prompts read from sources, those from the standard library; the packages share the rest
MAX_POOL = 20_000  # prompts a stream yields at most
MAX_CODE_CHARS = 1800  # a function's or class's source, at most (longer ones are skipped)
MAX_CODE_LINES = 60
MAX_DOC_CHARS = 1500  # a document (docstring) is clipped to this
MAX_FILE_CHARS = 500_000  # larger source files are not read

# SPDX ids counted as permissive (lowercase)
PERMISSIVE = frozenset({
    "mit", "mit-0", "mit-cmu", "bsd", "bsd-2-clause", "bsd-3-clause", "0bsd", "apache-2.0", "psf-2.0",
    "python-2.0", "isc", "zlib", "cc0-1.0", "bsl-1.0", "unlicense",
})
_CLASSIFIERS = {
    "MIT License": "MIT", "MIT No Attribution License (MIT-0)": "MIT-0", "BSD License": "BSD",
    "Apache Software License": "Apache-2.0", "Python Software Foundation License": "PSF-2.0",
    "ISC License (ISCL)": "ISC", "zlib/libpng License": "Zlib", "The Unlicense (Unlicense)": "Unlicense",
}
# folders whose files are not read: tests, vendored third-party code (other licences), demos
_SKIP_DIRS = frozenset({
    "test", "tests", "testing", "_testing", "_vendor", "vendor", "vendored", "third_party", "thirdparty",
    "examples", "example", "benchmarks", "__pycache__", "site-packages", "dist-packages", "idlelib",
    "lib2to3", "turtledemo", "ensurepip", "_distutils_hack",
})
_EXCLUDED_DISTS = frozenset({"speclm"})  # the project itself


@dataclass(frozen=True)
class Prompt:
    id: str  # sha1 of the text
    kind: str  # a KIND_WEIGHTS key
    source: str  # "<source> <version>:<file>:<name>" or GENERATED
    licence: str  # SPDX expression of the source's licence
    text: str

    @classmethod
    def of(cls, kind: str, source: str, licence: str, text: str) -> "Prompt":
        return cls(hashlib.sha1(text.encode("utf-8")).hexdigest(), kind, source, licence, text)

    def to_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "source": self.source, "licence": self.licence, "text": self.text}


# ---------------------------------------------------------------- licences
def is_permissive(expression: str | None) -> bool:
    """Whether an SPDX licence expression allows the text's use without conditions beyond
    attribution: every term of an AND, some term of an OR, is in PERMISSIVE ("WITH" exceptions
    only relax a licence). None, an empty or unparsable expression: False."""
    if not expression or not expression.strip():
        return False
    tokens = re.findall(r"\(|\)|[^\s()]+", expression)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def either() -> bool:
        nonlocal pos
        ok = both()
        while peek() is not None and peek().upper() == "OR":
            pos += 1
            ok = both() or ok
        return ok

    def both() -> bool:
        nonlocal pos
        ok = atom()
        while peek() is not None and peek().upper() == "AND":
            pos += 1
            ok = atom() and ok
        return ok

    def atom() -> bool:
        nonlocal pos
        token = peek()
        if token is None or token == ")":
            raise ValueError("expected a licence")
        pos += 1
        if token == "(":
            ok = either()
            if peek() != ")":
                raise ValueError("unbalanced parentheses")
            pos += 1
            return ok
        if peek() is not None and peek().upper() == "WITH":
            pos += 2
        return token.rstrip("+").lower() in PERMISSIVE

    try:
        ok = either()
    except ValueError:
        return False
    return ok and pos == len(tokens)


def _licence_from_text(text: str) -> str | None:
    """An SPDX id for a licence's name or first line ("Apache 2.0", "3-Clause BSD License", ...)."""
    low = text.lower()
    if re.search(r"\b(a|l)?gpl|\bgnu\b", low):
        return "LicenseRef-GPL"
    if "mozilla" in low or re.search(r"\bmpl\b", low):
        return "MPL-2.0"
    if "apache" in low:
        return "Apache-2.0"
    if "python software foundation" in low or re.search(r"\bpsf\b", low):
        return "PSF-2.0"
    if re.search(r"\bbsd\b", low):
        if re.search(r"3[- ]clause|bsd[- ]3|new|modified|revised", low):
            return "BSD-3-Clause"
        if re.search(r"2[- ]clause|bsd[- ]2|simplified", low):
            return "BSD-2-Clause"
        return "BSD"
    if re.search(r"\bmit\b", low):
        return "MIT"
    if re.search(r"\bisc\b", low):
        return "ISC"
    return None


def licence_of(metadata) -> str | None:
    """A distribution's licence as an SPDX expression, from its metadata (an email.message-like
    object, as importlib.metadata gives): License-Expression; else its License classifiers (several
    are alternatives: OR); else the first line of its License field. None where none says."""
    expression = (metadata.get("License-Expression") or "").strip()
    if expression:
        return expression
    found: list[str] = []
    for classifier in metadata.get_all("Classifier") or []:
        parts = [p.strip() for p in classifier.split("::")]
        if parts[0] != "License" or parts[-1] == "OSI Approved" or len(parts) < 2:
            continue
        found.append(_CLASSIFIERS.get(parts[-1]) or _licence_from_text(parts[-1]) or "LicenseRef-other")
    if found:
        return " OR ".join(dict.fromkeys(found))
    text = (metadata.get("License") or "").strip()
    return _licence_from_text(text.splitlines()[0]) if text else None


# ---------------------------------------------------------------- sources
@dataclass
class Source:
    name: str  # "python-stdlib 3.11.7", "numpy 2.4.6"
    licence: str  # SPDX expression
    weight: float  # its share of the prompts read from sources
    files: Callable[[], list[tuple[Path, str]]]  # (path, name inside the source), listed when first read

    @property
    def package(self) -> str:
        return self.name.split(" ")[0]


def _skipped(parts: tuple[str, ...]) -> bool:
    """A path inside a source whose file is not read: in a test, vendored or demo folder, or a test file."""
    folders, name = parts[:-1], parts[-1]
    return (any(p in _SKIP_DIRS or p.startswith(("test_", "config-")) for p in folders)
            or name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py")


def _stdlib_files(root: Path) -> list[tuple[Path, str]]:
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not _skipped(rel.parts) and rel.name not in ("this.py", "antigravity.py", "__phello__.foo.py"):
            out.append((path, rel.as_posix()))
    return sorted(out, key=lambda f: f[1])


def _dist_files(dist) -> list[tuple[Path, str]]:
    out = []
    for f in dist.files or []:
        rel = f.as_posix() if hasattr(f, "as_posix") else str(f)
        parts = tuple(rel.split("/"))
        if rel.endswith(".py") and not rel.startswith("..") and not _skipped(parts):
            out.append((Path(dist.locate_file(f)), rel))
    return sorted(out, key=lambda f: f[1])


def find_sources(packages: bool = True) -> list[Source]:
    """The standard library and (packages=True) every distribution in the environment's
    site-packages with a permissive licence (`licence_of`, `is_permissive`), by name; their files
    are listed when first read."""
    root = Path(sysconfig.get_paths()["stdlib"])
    stdlib = Source(f"python-stdlib {platform.python_version()}", "PSF-2.0", STDLIB_SHARE,
                    lambda: _stdlib_files(root))
    dists: dict[str, Source] = {}
    if packages:
        # the environment's own site-packages, not sys.path (which imports extend: setuptools adds
        # its vendored packages), so that the sources do not depend on what was imported
        paths = list(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
        for dist in importlib.metadata.distributions(path=paths):
            raw = dist.metadata.get("Name") or ""
            name = re.sub(r"[-_.]+", "-", raw).lower()
            if not name or name in _EXCLUDED_DISTS or name in dists:
                continue
            licence = licence_of(dist.metadata)
            if is_permissive(licence):
                dists[name] = Source(f"{name} {dist.version}", licence, 0.0, lambda d=dist: _dist_files(d))
    others = [dists[n] for n in sorted(dists)]
    for s in others:
        s.weight = (1 - STDLIB_SHARE) / len(others)
    if not others:
        stdlib.weight = 1.0
    return [stdlib] + others


# ---------------------------------------------------------------- units: what prompts are made of
@dataclass
class _Unit:
    source: Source
    where: str  # "json/decoder.py:JSONDecoder.decode"
    title: str  # dotted name: "json.decoder.JSONDecoder.decode", or the module's
    text: str  # a docstring (clipped), a summary or a sentence
    code: str = ""  # func: the function's or class's source
    signature: str = ""  # func: "name(args) -> returns" (a class: its name)
    is_class: bool = False
    stub: str = ""  # func: the header and docstring, the body left out
    bare: str = ""  # func: the source without its docstring ("" where the docstring is all of the body)
    methods: list[str] = field(default_factory=list)  # func, a class: its public methods


def _module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _summary(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def _clip(text: str, limit: int) -> str:
    """text, cut at a paragraph's (else a sentence's) end before `limit` characters where longer."""
    text = text.strip()
    if len(text) <= limit:
        return text
    head = text[:limit]
    for mark in ("\n\n", ". ", "\n"):
        at = head.rfind(mark)
        if at > limit // 3:
            return head[: at + (1 if mark == ". " else 0)].rstrip()
    return head.rstrip()


_PROSE = re.compile(r"^[A-Z][A-Za-z0-9 ,;'\-()]+[.!?]$")


def _sentences(doc: str) -> list[str]:
    """Plain prose sentences of 6-35 words from a docstring (no markup, code or symbols)."""
    out = []
    for para in doc.strip().split("\n\n"):
        para = " ".join(para.split())
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", para):
            if 6 <= len(s.split()) <= 35 and _PROSE.match(s) and "e.g" not in s and "i.e" not in s:
                out.append(s)
    return out


def _defs(tree: ast.Module):
    """(node, qualified name) of the module's functions and classes and its classes' methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node, node.name
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        yield sub, f"{node.name}.{sub.name}"


def _extract(source: Source, path: Path, rel: str) -> list[tuple[str, _Unit]]:
    """The units of one source file: (type, unit), type "func" (a function or class with a
    docstring, its source short enough), "doc" (a docstring of >= 40 words), "topic" (a docstring's
    first paragraph, 4-40 words), "sentence" (`_sentences`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    if len(text) > MAX_FILE_CHARS:
        return []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.splitlines()
    module = _module_name(rel)
    out: list[tuple[str, _Unit]] = []

    def texts(doc: str, where: str, title: str) -> None:
        summary = _summary(doc)
        if 4 <= len(summary.split()) <= 40 and summary[:1].isalpha():
            out.append(("topic", _Unit(source, where, title, summary)))
        if len(doc.split()) >= 40:
            out.append(("doc", _Unit(source, where, title, _clip(doc, MAX_DOC_CHARS))))
        for s in _sentences(doc)[:2]:
            out.append(("sentence", _Unit(source, where, title, s)))

    doc = ast.get_docstring(tree)
    if doc:
        texts(doc, rel, module)
    for node, qual in _defs(tree):
        doc = ast.get_docstring(node)
        if not doc or any(part.startswith("_") or part.startswith("test") for part in qual.split(".")):
            continue
        where, title = f"{rel}:{qual}", f"{module}.{qual}" if module else qual
        texts(doc, where, title)
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        code = textwrap.dedent("\n".join(lines[start - 1: node.end_lineno]))
        n_lines = code.count("\n") + 1
        is_class = isinstance(node, ast.ClassDef)
        body = node.body[1:]  # past the docstring
        trivial = not body or (len(body) == 1 and isinstance(body[0], (ast.Pass, ast.Raise, ast.Expr, ast.Return))
                               and not is_class)
        if trivial or not (5 <= n_lines <= MAX_CODE_LINES and len(code) <= MAX_CODE_CHARS):
            continue
        if is_class:
            signature = node.name
        else:
            signature = f"{node.name}({ast.unparse(node.args)})"
            if node.returns is not None:
                signature += f" -> {ast.unparse(node.returns)}"
        docstring = node.body[0]
        stub = textwrap.dedent("\n".join(lines[start - 1: docstring.end_lineno]))
        indent = " " * (len(lines[docstring.lineno - 1]) - len(lines[docstring.lineno - 1].lstrip()))
        bare = ""
        if len(node.body) > 1:
            kept = lines[start - 1: docstring.lineno - 1] + lines[docstring.end_lineno: node.end_lineno]
            bare = textwrap.dedent("\n".join(kept))
        methods = [m.name for m in node.body if is_class and isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and not m.name.startswith("_")]
        stub_indent = indent[len(lines[start - 1]) - len(lines[start - 1].lstrip()):]
        out.append(("func", _Unit(source, where, title, doc, code, signature, is_class,
                                  stub + "\n" + stub_indent + "...", bare, methods)))
    return out


class _Pool:
    """One source's units, read file by file (in an order its own generator shuffles) as asked for."""

    def __init__(self, source: Source, seed: int):
        self.source = source
        self.rng = random.Random(f"{seed}/{source.name}")
        self.files: list[tuple[Path, str]] | None = None
        self.next = 0
        self.queues: dict[str, deque] = {t: deque() for t in ("func", "doc", "topic", "sentence")}
        self.exhausted: set[str] = set()

    def take(self, unit: str, n: int = 1) -> list[_Unit] | None:
        queue = self.queues[unit]
        while len(queue) < n:
            if not self._read_next():
                self.exhausted.add(unit)
                return None
        return [queue.popleft() for _ in range(n)]

    def _read_next(self) -> bool:
        if self.files is None:
            self.files = self.source.files()
            self.rng.shuffle(self.files)
        if self.next >= len(self.files):
            return False
        path, rel = self.files[self.next]
        self.next += 1
        units = _extract(self.source, path, rel)
        self.rng.shuffle(units)
        for kind, unit in units:
            self.queues[kind].append(unit)
        return True


class _Taker:
    """Units of a type from a source chosen by weight (all n from one source)."""

    def __init__(self, pools: list[_Pool], rng: random.Random):
        self.pools, self.rng = pools, rng

    def __call__(self, unit: str, n: int = 1) -> list[_Unit] | None:
        while True:
            live = [p for p in self.pools if unit not in p.exhausted]
            if not live:
                return None
            pool = self.rng.choices(live, [p.source.weight for p in live])[0]
            got = pool.take(unit, n)
            if got is not None:
                return got


# ---------------------------------------------------------------- prompt makers
def _from(unit: _Unit, kind: str, text: str) -> Prompt:
    return Prompt.of(kind, f"{unit.source.name}:{unit.where}", unit.source.licence, text)


def _generated(kind: str, text: str) -> Prompt:
    return Prompt.of(kind, GENERATED, GENERATED_LICENCE, text)


def _fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def _where_in(unit: _Unit) -> str:
    return "the Python standard library" if unit.source.package == "python-stdlib" else f"the {unit.source.package} package"


_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
          ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
          ast.Add: ast.Sub, ast.Sub: ast.Add, ast.And: ast.Or, ast.Or: ast.And}


def _with_bug(code: str, rng: random.Random) -> str | None:
    """code with one small planted bug (a comparison, an operator, a boolean or an integer
    changed), or None where it has none of them."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    spots = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            spots += [(node.ops, i) for i, op in enumerate(node.ops) if type(op) in _SWAPS]
        elif isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in _SWAPS:
            spots.append((node, "op"))
        elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 100:
            spots.append((node, "value"))
    if not spots:
        return None
    spot, at = rng.choice(spots)
    if at == "op":
        spot.op = _SWAPS[type(spot.op)]()
    elif at == "value":
        spot.value = spot.value + 1
    else:
        spot[at] = _SWAPS[type(spot[at])]()
    return ast.unparse(tree)


_LANGUAGES = ("JavaScript", "TypeScript", "Go", "Rust", "C++", "Java", "C#")


def _code(rng: random.Random, take: _Taker) -> Prompt | None:
    got = take("func")
    if got is None:
        return None
    u = got[0]
    what = "class" if u.is_class else "function"
    style = rng.choices(
        ["write", "complete", "explain", "types", "docstring", "tests", "bug", "refactor", "port", "complexity",
         "review", "json"],
        [16, 10, 14, 6, 6, 9, 9, 7, 7, 5, 6, 5])[0]
    if style == "complete" and u.is_class:
        style = "write"
    if style == "docstring" and not u.bare:
        style = "explain"
    code = u.code
    if style == "write":
        spec = _clip(u.text, 700)
        if u.is_class:
            methods = f"\n\nIt should provide the methods: {', '.join(u.methods)}." if u.methods else ""
            text = f"Implement a Python class `{u.signature}`.\n\n{spec}{methods}"
        else:
            text = rng.choice([
                f"Write a Python function `{u.signature}` that does the following:\n\n{spec}",
                f"Implement `{u.signature}` in Python. Specification:\n\n{spec}",
                f"Write a Python function with the signature `{u.signature}`. Include a docstring and handle edge cases.\n\n{spec}",
            ])
    elif style == "complete":
        text = rng.choice(["Complete the implementation of this Python function:",
                           "Fill in the body of the following function so that it does what its docstring says:"])
        text += "\n" + _fenced(u.stub)
    elif style == "explain":
        text = rng.choice(["Explain what this code does:", "Explain step by step what the following Python code does:",
                           f"Describe the purpose, inputs and outputs of this {what} from {_where_in(u)}:"])
        text += "\n" + _fenced(code)
    elif style == "types":
        text = f"Add type hints to this Python {what} and return the complete annotated code.\n" + _fenced(code)
    elif style == "docstring":
        text = rng.choice([f"Write a Google-style docstring for this Python {what}:",
                           f"Add a clear docstring to the following {what}:"]) + "\n" + _fenced(u.bare)
    elif style == "tests":
        text = rng.choice([f"Write pytest unit tests for the following Python {what}:",
                           f"Write a few unit tests that cover the edge cases of this {what}:"]) + "\n" + _fenced(code)
    elif style == "bug":
        buggy = _with_bug(code, rng)
        if buggy is None:
            text = f"Find possible bugs in this Python {what} and suggest fixes:\n" + _fenced(code)
        else:
            text = (f"The following Python {what} contains a bug. Find it, explain it and give the fixed code.\n"
                    + _fenced(buggy))
    elif style == "refactor":
        text = (f"Refactor this Python {what} to make it more readable and idiomatic without changing its "
                "behaviour:\n" + _fenced(code))
    elif style == "port":
        text = f"Rewrite this Python {what} in {rng.choice(_LANGUAGES)}:\n" + _fenced(code)
    elif style == "complexity":
        text = f"What is the time and space complexity of this {what}? Explain your reasoning.\n" + _fenced(code)
    elif style == "review":
        text = ("Review this code as a senior Python developer: list possible bugs, unhandled edge cases and "
                "improvements.\n" + _fenced(code))
    else:
        text = ('Extract the name, the parameters (with their default values) and a one-line description of '
                f'the following {what} as JSON with the keys "name", "parameters" and "description".\n'
                + _fenced(code))
    return _from(u, "code", text)


def _summarization(rng: random.Random, take: _Taker) -> Prompt | None:
    got = take("doc")
    if got is None:
        return None
    u = got[0]
    text = rng.choice([
        "Summarize the following documentation in two or three sentences:\n\n{}",
        "Summarize: {}",
        "Write a short summary of this text for a busy developer:\n\n{}",
        "Summarize the key points of the following text as a bulleted list:\n\n{}",
        "Give the following documentation a one-line title and a one-paragraph summary:\n\n{}",
    ]).format(u.text)
    return _from(u, "summarization", text)


_DOC_QUESTIONS = (
    "What is the main purpose of what this text describes?",
    "Which parameters or options does the text mention, and what does each one do?",
    "What happens in the default case, according to the text?",
    "What limitations, caveats or errors does the text mention?",
    "Give a short example of how the described functionality would be used.",
    "Explain this text to someone who has never programmed.",
)


def _qa(rng: random.Random, take: _Taker) -> Prompt | None:
    if rng.random() < 0.5:
        got = take("doc")
        if got is None:
            return None
        u = got[0]
        question = rng.choice(_DOC_QUESTIONS)
        text = rng.choice([f"Read the text and answer the question.\n\nText:\n{u.text}\n\nQuestion: {question}",
                           f"Answer this question about the text below: {question}\n\n{u.text}"])
        return _from(u, "qa", text)
    got = take("func")
    if got is None:
        return None
    u = got[0]
    text = rng.choice([
        f"What does `{u.title}` do in Python?",
        f"In {_where_in(u)}, what is `{u.title}` used for? Give a short example.",
        f"When would you use `{u.title}` from {_where_in(u)}? Answer briefly.",
        f"What are the parameters of `{u.title}` and what does it return?",
    ])
    return _from(u, "qa", text)


_TARGET_LANGUAGES = ("French", "German", "Spanish", "Chinese", "Japanese", "Italian", "Portuguese", "Russian", "Korean")


def _translation(rng: random.Random, take: _Taker) -> Prompt | None:
    got = take("sentence", rng.choice((1, 1, 1, 2)))
    if got is None:
        return None
    sentence, lang = " ".join(u.text for u in got), rng.choice(_TARGET_LANGUAGES)
    text = rng.choice([
        f"Translate into {lang}: {sentence}",
        f"Translate the following English text into {lang}:\n{sentence}",
        f'How would you say this in {lang}?\n"{sentence}"',
        f"Translate this from English to {lang}, keeping technical terms as they are: {sentence}",
    ])
    return _from(got[0], "translation", text)


def _rag(rng: random.Random, take: _Taker) -> Prompt | None:
    n = rng.choice((3, 4))
    got = take("doc", n)
    if got is None:
        return None
    u = got[rng.randrange(n)]
    docs = "\n\n".join(f"Document {i + 1} ({d.title}):\n{_clip(d.text, 400)}" for i, d in enumerate(got))
    question = rng.choice([
        f"What does `{u.title}` do, according to the documents?",
        f"Which document describes `{u.title}`, and what does it say about it?",
        f"Using only the documents, explain how `{u.title}` is meant to be used.",
    ])
    text = rng.choice([f"Answer the question using only the documents below.\n\n{docs}\n\nQuestion: {question}",
                       f"{docs}\n\nBased on the documents above, answer: {question}"])
    return _from(u, "rag", text)


_VERB = re.compile(r"^(return|get|set|create|compute|calculate|convert|check|build|add|remove|delete|read|write|"
                   r"parse|make|find|load|save|generate|apply|update|send|open|close|copy|encode|decode|format|"
                   r"test|run|start|stop|call|register|validate|initialize|construct|handle|process|wrap|split|"
                   r"join|merge|compare|sort|search|replace|raise|yield|print|emit|install|fetch|resolve|"
                   r"normalize|transform|list|count|iterate|reset|clear|determine|extract|insert|append)(s|es)?$")
_NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Niaj",
          "Olivia", "Peggy", "Rupert", "Sybil", "Trent", "Victor", "Wendy", "Yusuf", "Zoe", "Mei", "Ravi", "Lena")


def _conversation(rng: random.Random, take: _Taker) -> Prompt | None:
    if rng.random() < 0.3:
        return _generated("conversation", _reasoning(rng))
    got = take("topic")
    if got is None:
        return None
    u = got[0]
    summary = u.text.rstrip(".")
    first, _, rest = summary.partition(" ")
    verb = _VERB.match(first.lower())
    if verb and rest:
        clause = f"{verb.group(1)} {rest}"
        text = rng.choice([
            f"Imagine you are a senior software engineer mentoring a junior colleague. Explain in a friendly tone how you would {clause}.",
            f"Write a short story (under 200 words) about a developer who has to {clause}.",
            f"Act as a technical interviewer. Ask me one question about how to {clause}, and describe what a strong answer would include.",
            f"Give three advantages and three disadvantages of writing your own code to {clause} instead of using a library.",
            f"Plan how to {clause}. Think step by step and list the assumptions you make.",
            f"Write a product announcement of about 100 words for a new tool that can {clause}.",
            f"Draft a short, polite message to a teammate asking for help to {clause}.",
        ])
    else:
        text = rng.choice([
            f'Explain this idea to a beginner, with an everyday analogy: "{summary}."',
            f'Write a short dialogue between two developers discussing this: "{summary}."',
            f'Write a haiku inspired by this sentence: "{summary}."',
            f'You are a teacher. Write three quiz questions, with answers, that check whether students understood this: "{summary}."',
            f'Write a tweet (under 280 characters) that makes this sound exciting: "{summary}."',
        ])
    return _from(u, "conversation", text)


def _reasoning(rng: random.Random) -> str:
    style = rng.randrange(4)
    if style == 0:
        names = rng.sample(_NAMES, rng.choice((3, 4, 5)))
        more, least = rng.choice([("taller", "shortest"), ("older", "youngest"), ("faster", "slowest"),
                                  ("heavier", "lightest"), ("richer", "poorest")])
        facts = [f"{a} is {more} than {b}." for a, b in zip(names, names[1:])]
        rng.shuffle(facts)
        return f"{' '.join(facts)} Who is the {least}? Explain your reasoning."
    if style == 1:
        days = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
        return (f"If today is {rng.choice(days)}, what day of the week will it be in {rng.randint(10, 1000)} days? "
                "Explain how you worked it out.")
    if style == 2:
        groups = ("cats", "engineers", "musicians", "birds", "teachers", "robots", "gardeners", "painters", "runners")
        a, b, c = rng.sample(groups, 3)
        quantifier = rng.choice(("All", "Some", "No"))
        return (f"{quantifier} {a} are {b}. Some {b} are {c}. Can we conclude that some {a} are {c}? "
                "Answer yes or no and explain.")
    h, m = rng.randint(6, 20), rng.randrange(0, 60, 5)
    dh, dm = rng.randint(0, 4), rng.randrange(5, 60, 5)
    return (f"A meeting starts at {h}:{m:02d} and lasts {dh} hours and {dm} minutes. A second meeting starts "
            f"{rng.randint(5, 45)} minutes after the first one ends. At what time does the second meeting start?")


_ITEMS = ("pencils", "notebooks", "apples", "tickets", "mugs", "books", "cables", "plants", "pens", "batteries")


def _math(rng: random.Random, take: _Taker) -> Prompt:
    r = rng.randint
    style = rng.randrange(14)
    name = rng.choice(_NAMES)
    if style == 0:
        i1, i2 = rng.sample(_ITEMS, 2)
        a, b, p1, p2 = r(2, 9), r(2, 9), r(1, 12), r(2, 20)
        bill = next(x for x in (20, 50, 100, 200, 500) if x > a * p1 + b * p2)
        q = (f"{name} buys {a} {i1} at ${p1} each and {b} {i2} at ${p2} each, and pays with a ${bill} bill. "
             f"How much change does {name} get?")
    elif style == 1:
        t = r(2, 6)
        q = f"A train travels {t * r(40, 120)} km in {t} hours. At the same speed, how far does it travel in {r(2, 9)} hours?"
    elif style == 2:
        q = (f"A jacket costs ${r(20, 300)}. It is discounted by {rng.choice((10, 15, 20, 25, 30, 40))}% and then a "
             f"{rng.choice((5, 7, 8, 10))}% sales tax is added. What is the final price?")
    elif style == 3:
        a, x, b = r(2, 12), r(-20, 20), r(-50, 50)
        q = f"Solve for x: {a}x + {b} = {a * x + b}."
    elif style == 4:
        x, y = r(-9, 9), r(-9, 9)
        a, b, c, d = r(1, 9), r(1, 9), r(1, 9), r(1, 9)
        q = f"Solve the system of equations: {a}x + {b}y = {a * x + b * y} and {c}x - {d}y = {c * x - d * y}."
    elif style == 5:
        d = r(2, 12)
        q = f"Compute {r(11, 99)} * {r(11, 99)} - {d * r(2, 40)} / {d} + {r(1, 500)}. Show your steps."
    elif style == 6:
        n1, d1 = r(2, 12), r(2, 30)
        q = f"{n1} workers can build a wall in {d1} days. How many days would {r(2, 24)} workers need, working at the same rate?"
    elif style == 7:
        q = (f"{name} deposits ${r(1, 50) * 100} in an account that pays {rng.choice((2, 3, 4, 5, 6))}% interest per "
             f"year, compounded annually. How much is in the account after {r(2, 10)} years?")
    elif style == 8:
        w, k = r(2, 30), r(1, 15)
        q = f"A rectangle has a perimeter of {2 * (2 * w + k)} cm, and its length is {k} cm more than its width. What is its area?"
    elif style == 9:
        other = rng.choice([n for n in _NAMES if n != name])
        young, gap = r(5, 40), r(1, 20)
        q = f"The ages of {name} and {other} add up to {2 * young + gap}. {name} is {gap} years older than {other}. How old is each?"
    elif style == 10:
        red, green, blue = r(2, 9), r(1, 9), r(1, 9)
        q = (f"A bag holds {red} red, {green} green and {blue} blue marbles. Two marbles are drawn without "
             "replacement. What is the probability that both are red?")
    elif style == 11:
        a, d = r(-10, 20), r(2, 9)
        q = f"What is the sum of the first {r(10, 60)} terms of the arithmetic sequence {a}, {a + d}, {a + 2 * d}, ...?"
    elif style == 12:
        s = r(2, 8)
        q = f"A recipe needs {s * r(20, 90)} grams of flour for {s} servings. How much flour is needed for {r(3, 20)} servings?"
    else:
        g = r(2, 30)
        q = f"Find the greatest common divisor and the least common multiple of {g * r(2, 40)} and {g * r(2, 40)}."
    q += rng.choice(("", "", " Think step by step.", " Show your reasoning, then give the final answer on its own line."))
    return _generated("math", q)


_MAKERS = {"code": _code, "conversation": _conversation, "qa": _qa, "summarization": _summarization,
           "math": _math, "translation": _translation, "rag": _rag}


def stream(seed: int = 0, sources: list[Source] | None = None, limit: int = MAX_POOL) -> Iterator[Prompt]:
    """Prompts in a fixed order for `seed` (each kind drawn by KIND_WEIGHTS, each unit from a source
    drawn by its weight), none twice, at most `limit`. Ends early when every source is read."""
    rng = random.Random(f"speclm-heads-prompts/{seed}")
    pools = [_Pool(s, seed) for s in (find_sources() if sources is None else sources)]
    take = _Taker(pools, rng)
    kinds = dict(KIND_WEIGHTS)
    seen: set[str] = set()
    while len(seen) < limit and any(k != "math" for k in kinds):
        kind = rng.choices(list(kinds), list(kinds.values()))[0]
        prompt = _MAKERS[kind](rng, take)
        if prompt is None:  # no source has units of the kind left
            del kinds[kind]
            continue
        if prompt.id not in seen:
            seen.add(prompt.id)
            yield prompt


def sentences(seed: int = 0, sources: list[Source] | None = None) -> Iterator[Prompt]:
    """Plain English prose sentences from the sources (the units translation prompts are made of),
    each as a Prompt of kind "sentence" whose text is the sentence, in a fixed order for `seed`,
    none twice."""
    take = _Taker([_Pool(s, seed) for s in (find_sources() if sources is None else sources)],
                  random.Random(f"speclm-sentences/{seed}"))
    seen: set[str] = set()
    while (got := take("sentence")) is not None:
        prompt = _from(got[0], "sentence", got[0].text)
        if prompt.id not in seen:
            seen.add(prompt.id)
            yield prompt


def collect(n: int | None = None, seed: int = 0, sources: list[Source] | None = None) -> list[Prompt]:
    """The first n prompts of `stream(seed)` (None: all of them, up to MAX_POOL)."""
    return list(islice(stream(seed, sources), n))
