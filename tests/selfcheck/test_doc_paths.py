"""Every repository path the docs and the code comments name exists, and the code names no
tracker numbers. Standard library only: no network, no process, no fixture (it runs with
`--noconftest` too); it reads about 300 files in well under a second.

What is checked, in which files:

- Markdown: README.md, CONTRIBUTING.md, CHANGELOG.md, docs/*.md and every README.md below the
  top level (envoy/, envoy/istio/, envoy/mesh/, deploy/, demo/, tests/, bench/peer/). Every line,
  fenced blocks included (the commands there name files too).
  CHANGELOG.md is checked: nothing has been released, so every entry describes the tree as it is
  and a path it names must still be there. bench/RESULTS.md is not: it is a report of past runs
  (the work tree and the build a run measured), written by `make bench`, and may keep its history.
- Code comments: `//` comments of Rust, protobuf and JavaScript files; `#` comments and the
  docstrings (a string that is a statement of its own) of Python files; `#` comments of shell
  scripts (and .ci/run), the Makefile, YAML, TOML, Dockerfiles, redis.conf and the fuzz
  dictionaries; `--` comments of Lua scripts. Under src/, idemstore/, protocol/, store/, fuzz/,
  tests/, bench/, demo/, envoy/, deploy/, .ci/, and the root Makefile and Cargo.toml.

What a path is:

- a token (in backticks or in plain text) starting with a top-level entry of the repository
  (`TOP_DIRS`, `TOP_FILES`), for instance `src/request/keep.rs`, `tests/contract/` or
  `Makefile`: resolved against the repository root, or, in a code comment, against the crate
  root of the file too (in idemstore's comments a path under `src/` may mean idemstore's own);
  `store/` is idem-store's crate, so the filter's `src/store/` is named with its `src/`;
- the target of a Markdown link `[text](target)` that is not a URL or a bare anchor: resolved
  against the Markdown file's folder, its `#anchor` stripped;
- any other file name in backticks with a source file's extension, bare or under folders
  (`keep.rs`, `sim/request.rs`, `support/stack.py`, `backend/scripts/begin.lua`): it must be the
  name or the tail of some file of the repository (or resolve against the naming file's folder),
  unless it is one of `NOT_OURS` (named on purpose, not a file of this repository).

Skipped: a token with a placeholder or a glob (`<`, `*`, `{`), the generated or ignored paths
of `GENERATED` (a fresh clone does not have them, whatever a local run left behind), and
`deploy/<name>` on a kubectl or istioctl command line (a Kubernetes Deployment).

The second check (`test_no_tracker_numbers_in_code`): no file under the code folders (`CODE_DIRS`,
and the Makefile) says "issue" followed by a number, in a comment, a string or anywhere else. The
code says what a thing is; the tracker's numbers belong to commits and the tracker.
References to other projects' trackers (`envoyproxy/envoy#11931`) are citations and stay.
bench/RESULTS.md may keep its history and is not checked.
"""

from __future__ import annotations

import io
import os
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The repository's top-level entries a path may start with.
TOP_DIRS = ("src", "idemstore", "protocol", "store", "tests", "docs", "envoy", "deploy", "bench", "demo", "fuzz", ".ci")
TOP_FILES = ("Makefile", "README.md", "CONTRIBUTING.md", "CHANGELOG.md", "Cargo.toml")

# Paths that are named on purpose but are not in a fresh clone: each is made by a run and
# git-ignored (see .gitignore). A named path equal to one of these or below it is skipped.
GENERATED = (
    "tests/.logs",     # each end-to-end run's process logs (conftest.py, IDEM_TEST_LOGDIR)
    "bench/.runs",     # each bench run's logs and raw figures (bench/benchlib.py)
    "fuzz/target",     # cargo-fuzz's build
    "fuzz/corpus",     # corpora grown by `make fuzz` (the seeds are fuzz/seeds/)
    "fuzz/artifacts",  # crashes cargo-fuzz found
    "fuzz/coverage",   # `cargo fuzz coverage` output
    "bench/peer/.runs",          # the peer comparison's logs (bench/peer/.gitignore)
    "bench/peer/node_modules",   # its npm packages (bench/peer/.gitignore)
    "bench/peer/RESULTS.md",     # written by `bench/peer/run.py --write` when asked, not kept
)

# Names that look like a file of this repository and are not one, on purpose.
NOT_OURS = {
    "rust-toolchain.toml",           # CONTRIBUTING.md: there is none
    "nodes.conf",                    # the file each Redis Cluster node writes for itself
    "specs/eventing/data-plane.md",  # in the knative/specs repository (docs/inbox.md)
}
# `deploy/<name>` on a kubectl or istioctl command line is a Kubernetes Deployment.
KUBE_COMMAND = re.compile(r"\b(?:kubectl|istioctl)\b")

# Folders (and the files of the root) whose code must not name tracker numbers.
CODE_DIRS = ("src", "idemstore", "protocol", "store", "fuzz", "tests", "bench", "demo", "envoy", "deploy")
CODE_ROOT_FILES = ("Makefile",)
HISTORY = ("bench/RESULTS.md",)  # a report of past runs, with their history: checked by neither test
TRACKER = re.compile(r"\bissues?[\s#-]*\d+", re.IGNORECASE)

# Never walked: builds, tools, run output.
SKIP_DIRS = {".git", "target", ".tools", "node_modules", "__pycache__", ".pytest_cache",
             ".logs", ".runs", "corpus", "artifacts", "coverage"}

_TOP = "|".join([re.escape(d) + "/" for d in TOP_DIRS] + [re.escape(f) + r"(?![\w.-])" for f in TOP_FILES])
# A token starting with a top-level entry, not inside a longer path or word (`idemstore/tests/`
# is one token, not `tests/` too), with the characters a placeholder or glob may bring so that
# those can be told apart and skipped.
PATH = re.compile(r"(?<![\w./~$@:-])(?:" + _TOP + r")[\w./<>*{}-]*")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
BACKTICK = re.compile(r"`([^`\n]+)`")
SOURCE_EXT = ("rs", "py", "md", "yaml", "yml", "lua", "sh", "toml", "proto", "js", "json", "dict", "conf")
PARTIAL = re.compile(r"[\w.-]+(?:/[\w.-]+)*\.(?:" + "|".join(SOURCE_EXT) + r")")


@dataclass(frozen=True)
class Missing:
    file: str   # the file that names the path, relative to the root
    line: int
    path: str   # as it was written
    kind: str   # "path", "link" or "partial"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.kind} `{self.path}` does not exist"


# --- the files and the text of theirs that is checked ----------------------------------------

def walk(root: Path):
    """Every file below root, relative paths (as strings with `/`), builds and run output left out."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            yield (Path(dirpath) / name).relative_to(root).as_posix()


def markdown_files(files: list[str]) -> list[str]:
    chosen = []
    for f in files:
        if not f.endswith(".md") or f in HISTORY:
            continue
        if "/" not in f or (f.startswith("docs/") and f.count("/") == 1) or f.endswith("/README.md"):
            chosen.append(f)
    return chosen


def comment_style(rel: str) -> str | None:
    """How comments are written in this file ("slash", "hash", "dash", "python"), or None."""
    name = rel.rsplit("/", 1)[-1]
    top = rel.split("/", 1)[0] if "/" in rel else ""
    if "/" not in rel:
        return "hash" if name in ("Makefile", "Cargo.toml") else None
    if top not in CODE_DIRS and top != ".ci":
        return None
    if rel.startswith("fuzz/seeds/"):
        return None
    if name.endswith((".rs", ".proto", ".js")):
        return "slash"
    if name.endswith(".py"):
        return "python"
    if name.endswith(".lua"):
        return "dash"
    if (name.endswith((".sh", ".yaml", ".yml", ".toml", ".conf", ".dict")) or name == "Makefile"
            or name.startswith("Dockerfile") or rel == ".ci/run"):
        return "hash"
    return None


def _outside_quotes(line: str, i: int, quotes: str) -> bool:
    """Whether position i of line is outside quoted text (an even count of each quote before it)."""
    before = line[:i].replace("\\\\", "").replace('\\"', "").replace("\\'", "")
    return all(before.count(q) % 2 == 0 for q in quotes)


def line_comments(text: str, style: str) -> list[tuple[int, str]]:
    """(line number, comment text) of every comment of a file written in this comment style."""
    out = []
    marker = {"slash": "//", "dash": "--", "hash": "#"}[style]
    quotes = '"' if style == "slash" else "\"'"
    for n, line in enumerate(text.splitlines(), 1):
        start = 0
        while True:
            i = line.find(marker, start)
            if i < 0:
                break
            start = i + 1
            if style == "slash" and i > 0 and line[i - 1] == ":":
                continue  # a URL's `://`
            if style == "hash" and i > 0 and line[i - 1] not in " \t":
                continue  # `$#`, `${#x}`, `a#b`: not a comment
            if _outside_quotes(line, i, quotes):
                out.append((n, line[i + len(marker):]))
                break
    return out


def python_comments(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every `#` comment and every line of every docstring."""
    out = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return line_comments(text, "hash")
    starts = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
    significant = [t for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL)]
    for t in tokens:
        if t.type == tokenize.COMMENT:
            out.append((t.start[0], t.string[1:]))
    for k, t in enumerate(significant):
        if t.type != tokenize.STRING:
            continue
        first = k == 0 or significant[k - 1].type in starts
        alone = k + 1 < len(significant) and significant[k + 1].type in (tokenize.NEWLINE, tokenize.ENDMARKER)
        if first and alone:
            for j, part in enumerate(t.string.split("\n")):
                out.append((t.start[0] + j, part))
    return out


def crate_root(rel: str, root: Path = ROOT) -> str:
    """The folder of the nearest Cargo.toml above rel ("" for the root's)."""
    parts = rel.split("/")[:-1]
    while parts:
        if (root / "/".join(parts) / "Cargo.toml").is_file():
            return "/".join(parts)
        parts.pop()
    return ""


# --- the check -------------------------------------------------------------------------------

def _skipped(path: str) -> bool:
    if any(c in path for c in "<*{}>"):
        return True
    bare = path.rstrip("/")
    return any(bare == g or bare.startswith(g + "/") for g in GENERATED)


def _exists(root: Path, base: str, path: str) -> bool:
    target = root / base / path if base else root / path
    return target.exists() and (not path.endswith("/") or target.is_dir())


def check_text(rel: str, lines: list[tuple[int, str]], *, markdown: bool, root: Path = ROOT,
               files: list[str] | None = None) -> list[Missing]:
    """The paths named in lines (line number, text) of the file rel that do not exist.

    markdown: the text is Markdown (links are resolved against its folder); else it is the
    comments of a code file (top-level paths are resolved against its crate root too).
    files: every file of the repository (relative), for partial paths; walked when not given.
    """
    if files is None:
        files = list(walk(root))
    folder = rel.rsplit("/", 1)[0] if "/" in rel else ""
    bases = [""] if markdown else sorted({"", crate_root(rel, root)})
    missing: list[Missing] = []
    seen: set[tuple[int, str, str]] = set()

    def report(n: int, path: str, kind: str) -> None:
        if (n, path, kind) not in seen:
            seen.add((n, path, kind))
            missing.append(Missing(rel, n, path, kind))

    for n, text in lines:
        for m in PATH.finditer(text):
            path = m.group(0).rstrip(".,:;")
            if _skipped(path) or (path.startswith("deploy/") and KUBE_COMMAND.search(text)):
                continue
            if not any(_exists(root, b, path) for b in bases):
                report(n, path, "path")
        if markdown:
            for m in LINK.finditer(text):
                target = m.group(1)
                if re.match(r"[a-zA-Z][\w+.-]*:", target) or target.startswith("#"):
                    continue  # a URL, mailto:, or an anchor of this page
                target = target.split("#", 1)[0]
                if _skipped(target):
                    continue
                resolved = os.path.normpath(os.path.join(folder, target)).replace(os.sep, "/")
                if resolved.startswith("..") or not (root / resolved).exists():
                    report(n, target, "link")
        for m in BACKTICK.finditer(text):
            token = m.group(1).strip()
            if not PARTIAL.fullmatch(token) or PATH.match(token) or token.startswith(("/", "./", "../")):
                continue
            if _skipped(token) or token in NOT_OURS or _exists(root, folder, token):
                continue
            if not any(f == token or f.endswith("/" + token) for f in files):
                report(n, token, "partial")
    return missing


def missing_paths(root: Path = ROOT) -> list[Missing]:
    files = list(walk(root))
    missing: list[Missing] = []
    for rel in markdown_files(files):
        text = (root / rel).read_text(encoding="utf-8")
        missing += check_text(rel, list(enumerate(text.splitlines(), 1)), markdown=True, root=root, files=files)
    for rel in files:
        style = comment_style(rel)
        if style is None:
            continue
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        lines = python_comments(text) if style == "python" else line_comments(text, style)
        missing += check_text(rel, lines, markdown=False, root=root, files=files)
    return missing


def tracker_numbers(root: Path = ROOT) -> list[str]:
    """`file:line: text` of every tracker number in the code folders."""
    found = []
    for rel in walk(root):
        top = rel.split("/", 1)[0]
        if not (top in CODE_DIRS and "/" in rel or rel in CODE_ROOT_FILES) or rel in HISTORY:
            continue
        if rel.startswith("fuzz/seeds/"):
            continue
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in TRACKER.finditer(line):
                found.append(f"{rel}:{n}: {m.group(0)!r} in: {line.strip()}")
    return found


# --- the tests -------------------------------------------------------------------------------

def test_every_named_path_exists():
    missing = missing_paths()
    for m in missing:
        print(m)
    assert not missing, f"{len(missing)} named path(s) missing:\n" + "\n".join(map(str, missing))


def test_no_tracker_numbers_in_code():
    found = tracker_numbers()
    for line in found:
        print(line)
    assert not found, f"{len(found)} tracker number(s) in code:\n" + "\n".join(found)


def test_the_checks_see_what_is_missing(tmp_path):
    """The checks run over a small made-up repository: every kind of stale reference is reported
    with its file and line, and what exists, is generated or is a placeholder is not."""
    (tmp_path / "src" / "sim" / "worker").mkdir(parents=True)
    (tmp_path / "src" / "sim" / "worker" / "mod.rs").write_text("//! The simulated worker.\n")
    (tmp_path / "src" / "lib.rs").write_text(
        "// See src/sim/worker/mod.rs and src/sim/worker.rs, and `sim/worker.rs`.\n"
        "let url = \"http://src/in_a_string.rs\"; // src/lib.rs\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n"
        "\n"
        "The worker is `src/sim/worker/mod.rs` (`worker/mod.rs`), not `src/does_not_exist.rs`.\n"
        "Logs in `tests/.logs/<run>/`, tests in `src/<module>/tests.rs`; see [B](b.md#top),\n"
        "[gone](../gone.md), [home](https://example.com/x.md) and [here](#a).\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        '"""Checks src/lib.rs and src/old.py."""\n'
        "\n"
        "X = 'src/only_in_a_string.rs'  # and src/gone/\n")
    files = list(walk(tmp_path))
    got = []
    for rel in files:
        text = (tmp_path / rel).read_text()
        if rel.endswith(".md"):
            got += check_text(rel, list(enumerate(text.splitlines(), 1)), markdown=True, root=tmp_path, files=files)
        else:
            lines = python_comments(text) if rel.endswith(".py") else line_comments(text, "slash")
            got += check_text(rel, lines, markdown=False, root=tmp_path, files=files)
    assert sorted(map(str, got)) == sorted([
        "docs/a.md:3: path `src/does_not_exist.rs` does not exist",
        "docs/a.md:5: link `../gone.md` does not exist",
        "docs/a.md:4: link `b.md` does not exist",
        "src/lib.rs:1: path `src/sim/worker.rs` does not exist",
        "src/lib.rs:1: partial `sim/worker.rs` does not exist",
        "tests/test_x.py:1: path `src/old.py` does not exist",
        "tests/test_x.py:3: path `src/gone/` does not exist",
    ])
    # The tracker check reads strings too.
    named = "Iss" + "ue #26"  # spelled in two, or this file would name it
    (tmp_path / "tests" / "test_y.py").write_text(f"X = 'see {named}'\n")
    assert tracker_numbers(tmp_path) == [f"tests/test_y.py:1: '{named}' in: X = 'see {named}'"]


def test_the_repository_checks_report_a_renamed_file(monkeypatch):
    """The real check over the real tree, with one file it names seen as gone: reported."""
    real = Path.exists
    gone = ROOT / "src" / "request" / "keep.rs"
    monkeypatch.setattr(Path, "exists", lambda p: p != gone and real(p))
    missing = [str(m) for m in missing_paths()]
    assert any(m.startswith("CONTRIBUTING.md:") and "`src/request/keep.rs`" in m for m in missing), missing
