"""The bad-input and fault corpus of the newest verbs (issue 37): pick, target add, watch, init, report,
build --arch/--device, lint --selections, pr --open and import, run as a careless or unlucky user would.

Each case is an argv, a small setup, the exit code README's table documents, and a substring of the ONE line kvforge
prints on stderr; every case checks that stderr is that one line (no "internal error", no traceback) and that
nothing was written: the project directory (a copy of this repository's targets/ and patches/) and, where a case
uses one, the user's repository are snapshotted before and after, byte for byte. Each case gets its own copy of
a prepared template, a cache of its own, $KVFORGE_OFFLINE=1 unless the case serves a package index itself (a real
local HTTP server: malformed JSON, or nothing at all).

Cases another branch fixes are written with the fixed behaviour and marked xfail(strict=True) naming that branch:
the lead flips them when merging it.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import IDENT, git

from kvforge.cli import main
from kvforge.core.cache import Cache, default_cache_dir
from kvforge.flow.pickstate import state_path
from kvforge.git.bases import Base, ensure_base
from kvforge.project.targets import load_target

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
DEAD_INDEX = "http://127.0.0.1:9"  # nothing listens there


@dataclass
class World:
    """One case's world: the project copy, the user's places, the environment kvforge runs with."""

    root: Path  # the project (targets/, patches/)
    tmp: Path  # the case's scratch directory (the user's files live here)
    env: dict[str, str]
    index: "Index"
    base: Base  # target v0.20.1's vLLM base in the shared cache (the real 0.20.1 sdist, imported once)
    watched: list[Path] = field(default_factory=list)  # the user's places checked for "nothing written"

    @property
    def user(self) -> Path:
        """The user's git repository: one commit on a tiny tree (made on first use), watched."""
        repo = self.tmp / "user-repo"
        if not repo.exists():
            repo.mkdir()
            (repo / "vllm" / "v1" / "core").mkdir(parents=True)
            (repo / "vllm" / "v1" / "core" / "block_pool.py").write_text("class BlockPool:\n    pass\n")
            git(repo, "init", "-q", "-b", "main")
            git(repo, "add", "-A")
            git(repo, "commit", "-qm", "base")
            (repo / "vllm" / "v1" / "core" / "block_pool.py").write_text("class BlockPool:\n    size = 1\n")
            git(repo, "commit", "-qam", "[Core] a change\n\nSigned-off-by: " + IDENT)
            self.watched.append(repo)
        return repo

    def with_base(self) -> None:
        """The case's cache holds v0.20.1's base: a bare repository borrowing the shared cache's objects, its tag
        set (what kvforge.git.bases finds cached), so a case reaches the checks made after the base."""
        repo = Path(self.env["KVFORGE_CACHE"]) / "repos" / self.base.repo.name
        repo.mkdir(parents=True)
        git(repo, "init", "-q", "--bare")
        (repo / "objects" / "info" / "alternates").write_text(f"{self.base.repo / 'objects'}\n")
        git(repo, "update-ref", f"refs/tags/{self.base.ref}", self.base.commit)

    def patch_file(self) -> Path:
        """A format-patch file of the user's change (as `kvforge pick FILE` takes)."""
        out = self.tmp / "change.patch"
        if not out.exists():
            out.write_text(git(self.user, "format-patch", "-1", "--stdout", "HEAD"))
        return out

    def fake_gh(self) -> None:
        """A FAKE `gh` on PATH (never run by these cases: they fail before it), so --open gets past find_gh."""
        bindir = self.tmp / "bin"
        bindir.mkdir(exist_ok=True)
        gh = bindir / "gh"
        gh.write_text(f"#!{sys.executable}\nraise SystemExit('FAKE gh: not to be run by the corpus')\n")
        gh.chmod(0o755)
        self.env["PATH"] = f"{bindir}{os.pathsep}{os.environ['PATH']}"


class Index:
    """A real local package index (HTTP on 127.0.0.1) answering /pypi/<package>/json with `docs[package]` (404
    for a package it lacks); `requests` records every path asked."""

    def __init__(self) -> None:
        self.docs: dict[str, object] = {}
        self.requests: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                index.requests.append(self.path)
                parts = self.path.strip("/").split("/")
                doc = index.docs.get(parts[1]) if len(parts) == 3 and parts[0] == "pypi" else None
                body = json.dumps(doc).encode() if doc is not None else b"not found"
                self.send_response(200 if doc is not None else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# Releases whose file entries have the wrong types (`digests` a string, `filename` a number, `url` and `size` numbers
# or words), next to the sdist's right name.
def _bad_files(version: str) -> list[dict]:
    return [{"filename": f"vllm-{version}.tar.gz", "digests": "sha256", "url": 3, "packagetype": "sdist",
             "size": "big"},
            {"filename": 7, "digests": {"sha256": 5}, "url": None, "packagetype": "bdist_wheel", "size": -1}]


MALFORMED = {"info": {"version": "0.34.0"}, "releases": {v: _bad_files(v) for v in ("0.20.2", "0.34.0")}}


def serve(*packages: str, doc: object = MALFORMED) -> Callable[[World], None]:
    def setup(w: World) -> None:
        for p in packages:
            w.index.docs[p] = doc
        w.env["KVFORGE_PYPI_URL"] = w.index.url
        w.env.pop("KVFORGE_OFFLINE", None)
    return setup


def online_dead(w: World) -> None:
    w.env["KVFORGE_PYPI_URL"] = DEAD_INDEX
    w.env.pop("KVFORGE_OFFLINE", None)


def series_lists_missing(w: World) -> None:
    (w.root / "patches" / "v0.20.1" / "series").open("a").write("0099-not-there.patch\n")


def bad_evidence(w: World) -> None:
    d = Path(w.env["KVFORGE_CACHE"]) / "results" / "v0.20.1" / "vllm" / "0123456789abcdef"
    d.mkdir(parents=True)
    (d / "verify.json").write_text(json.dumps({"schema": 1, "kind": "verify", "data": [], "created": 1,
                                               "key": {"target": "v0.20.1", "component": "vllm", "base": "b",
                                                       "series": "0123456789abcdef"}}))


def outside_state(w: World) -> None:
    """A directory outside the project holding an unreadable state.json (what --abort --as PATH would delete)."""
    d = w.tmp / "outside"
    d.mkdir()
    (d / "state.json").write_text("{ not json")
    w.watched.append(d)


def corrupt_pick_journal(w: World) -> None:
    """A stopped pick's state file that is not JSON (a disk that filled, an editor): watched, never removed by a
    dry run."""
    path = state_path(Cache(Path(w.env["KVFORGE_CACHE"])), w.root)
    path.parent.mkdir(parents=True)
    path.write_text('{"fix_id": 5, "rows": "x", "targets": null}')
    w.watched.append(path.parent)


def no_wheel_pins(w: World) -> None:
    """v0.20.1 without its [[components.wheels]] pins (a target written by hand)."""
    path = w.root / "targets" / "v0.20.1.toml"
    text = path.read_text()
    start, end = text.index("[[components.wheels]]"), text.index("[components.tests]")
    path.write_text(text[:start] + text[end:])


def plain_dir(w: World) -> None:
    d = w.tmp / "plain"
    d.mkdir()
    (d / "README").write_text("not a clone\n")
    w.watched.append(d)


def patch_dir(w: World, files: dict[str, str]) -> None:
    d = w.tmp / "series-in"
    d.mkdir()
    for name, text in files.items():
        (d / name).write_text(text)
    w.watched.append(d)


def with_(*steps: Callable[[World], object]) -> Callable[[World], None]:
    def setup(w: World) -> None:
        for s in steps:
            s(w)
    return setup


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # {root}, {tmp}, {user}, {patch} are filled in
    code: int
    line: str  # a substring of the one stderr line
    setup: Callable[[World], object] | None = None
    fixed_on: str | None = None  # another branch fixes it: xfail(strict) until the lead merges that branch


def C(id: str, argv: str | tuple[str, ...], code: int, line: str, setup=None, fixed_on: str | None = None) -> Case:
    return Case(id, tuple(argv.split()) if isinstance(argv, str) else argv, code, line, setup, fixed_on)


USER = lambda w: w.user  # noqa: E731
PATCH = lambda w: (w.with_base(), w.patch_file())  # noqa: E731
GH = lambda w: w.fake_gh()  # noqa: E731
LONG = "a" * 150

CASES = [
    # ---------------------------------------------------------------- pick
    C("pick-missing-file", "pick {tmp}/nope.patch", 2, "nope.patch"),
    C("pick-not-a-patch", "pick {tmp}/notes.txt", 2, "notes.txt",
      lambda w: (w.tmp / "notes.txt").write_text("just some notes\n")),
    C("pick-empty-file", "pick {tmp}/empty.patch", 2, "empty.patch", lambda w: (w.tmp / "empty.patch").write_text("")),
    C("pick-binary-file", "pick {tmp}/blob.patch", 2, "blob.patch",
      lambda w: (w.tmp / "blob.patch").write_bytes(bytes(range(256)) * 4)),
    C("pick-unknown-target", "pick {patch} -t nosuch", 2, "nosuch", PATCH),
    C("pick-target-name-too-long", ("pick", "{patch}", "-t", LONG), 2, "150 characters", PATCH),
    C("pick-after-unknown-fix", "pick {patch} -t v0.20.1 --after no-such-fix", 2, "no-such-fix", PATCH),
    C("pick-bad-fix-id", ("pick", "{patch}", "-t", "v0.20.1", "--fix-id", "bad id!"), 2, "--fix-id", PATCH),
    C("pick-empty-fix-id", ("pick", "{patch}", "-t", "v0.20.1", "--fix-id", ""), 2, "--fix-id", PATCH),
    C("pick-exclude-typo", "pick {patch} --exclude v0.20.l", 2, "v0.20.l", PATCH),
    C("pick-bad-signoff", ("pick", "{patch}", "-t", "v0.20.1", "--signoff", "nobody"), 2, "--signoff", PATCH),
    C("pick-unknown-component", "pick {patch} -t v0.20.1 --component nosuch", 2, "nosuch", PATCH),
    C("pick-repo-not-a-clone", "pick --repo {tmp}/plain HEAD -t v0.20.1", 2, "plain", plain_dir),
    C("pick-repo-missing", "pick --repo {tmp}/gone HEAD -t v0.20.1", 2, "gone"),
    C("pick-repo-unknown-rev", "pick --repo {user} no-such-rev -t v0.20.1", 2, "no-such-rev", USER),
    C("pick-continue-nothing-stopped", "pick --continue", 2, "pick"),
    C("pick-abort-dry-run-nothing-stopped", "pick --abort --dry-run", 2, "pick"),
    C("pick-continue-corrupt-journal", "pick --continue", 2, "state.json", corrupt_pick_journal),
    C("pick-abort-dry-run-corrupt-journal", "pick --abort --dry-run", 0, "would forget the pick state",
      corrupt_pick_journal),  # --abort forgets an unusable state; the dry run only says so
    C("pick-blocked-by-corrupt-journal", "pick {patch} -t v0.20.1", 2, "state.json",
      with_(corrupt_pick_journal, PATCH)),
    C("pick-bad-source", "pick {patch} --source nowhere", 2, "--source", PATCH),
    C("pick-dry-run-unknown-target", "pick {patch} -t nosuch --dry-run", 2, "nosuch", PATCH),
    # ---------------------------------------------------------------- target add
    C("target-add-not-a-version", "target add banana", 2, "banana"),
    C("target-add-existing", "target add 0.20.1 --as v0.20.1", 2, "v0.20.1"),
    C("target-add-bad-name", ("target", "add", "0.34.0", "--as", "bad name!"), 2, "bad name!"),
    C("target-add-name-too-long", ("target", "add", "0.34.0", "--as", LONG), 2, "150 characters"),
    C("target-add-unknown-from-target", "target add 0.34.0 --from-target nosuch", 2, "nosuch"),
    C("target-add-continue-nothing", "target add --continue", 2, "target add"),
    C("target-add-skip-nothing", "target add --skip", 2, "target add"),
    C("target-add-abort-as-relative-path", "target add --abort --as ../../work/outside", 2, "--as", outside_state),
    C("target-add-abort-as-absolute-path", "target add --abort --as {tmp}/outside", 2, "--as", outside_state),
    C("target-add-continue-as-path", "target add --continue --as {tmp}/outside", 2, "--as", outside_state),
    C("target-add-offline", "target add 0.34.0", 6, "$KVFORGE_OFFLINE is set"),
    C("target-add-index-down", "target add 0.34.0", 6, "127.0.0.1:9", online_dead),
    C("target-add-index-malformed", "target add 0.34.0", 6, "package index", serve("vllm", "vllm-ascend",
                                                                                     "vllm_ascend")),
    # ---------------------------------------------------------------- watch
    C("watch-since-not-a-version", "watch --since banana", 2, "banana"),
    C("watch-unknown-target", "watch -t nosuch", 2, "nosuch"),
    C("watch-bad-format", "watch --format yaml", 2, "--format"),
    C("watch-index-down", "watch", 6, "127.0.0.1:9", online_dead),
    C("watch-index-malformed", "watch", 6, "package index", serve("vllm", "vllm-ascend", "vllm_ascend")),
    C("watch-offline-asks-nothing", "watch", 6, "offline"),
    # ---------------------------------------------------------------- init
    C("init-name-too-long", ("init", "{tmp}/team", "--release", "0.20.2", "--as", LONG), 2, "150 characters long"),
    C("init-bad-name", ("init", "{tmp}/team", "--release", "0.20.2", "--as", "bad name!"), 2, "--as"),
    C("init-dir-name-too-long", ("init", "{tmp}/" + "d" * 300), 2, "300 bytes long"),
    C("init-into-a-file", "init {tmp}/afile", 2, "not a directory", lambda w: (w.tmp / "afile").write_text("mine\n")),
    C("init-into-a-used-dir", "init {tmp}/used", 2, "not empty",
      lambda w: ((w.tmp / "used").mkdir(), (w.tmp / "used" / "mine.txt").write_text("mine\n"))),
    C("init-parent-missing", "init {tmp}/no/such/team", 2, "no such directory"),
    C("init-bad-upstream", "init {tmp}/team --upstream vllm-cpu", 2, "--upstream"),
    C("init-release-not-a-version", "init {tmp}/team --release banana", 2, "banana"),
    C("init-install-with-quotes", ("init", "{tmp}/team", "--install", 'kvforge"; rm -rf /'), 2, "--install"),
    C("init-release-offline-no-sdist", "init {tmp}/team --release 0.20.2 --install kvforge==0.1", 6, "offline"),
    C("init-release-index-down", "init {tmp}/team --release 0.20.2 --install kvforge==0.1", 6, "127.0.0.1:9",
      online_dead),
    C("init-release-index-malformed", "init {tmp}/team --release 0.20.2 --install kvforge==0.1", 6,
      "package index", serve("vllm")),  # init's own read: scaffold.sdist_pin, see the report
    # ---------------------------------------------------------------- report
    C("report-unknown-target", "report -t nosuch", 2, "nosuch"),
    C("report-bad-format", "report --format csv", 2, "--format"),
    C("report-series-lists-a-missing-patch", "report", 2, "0099-not-there.patch does not exist",
      series_lists_missing),
    C("report-malformed-evidence", "report", 2, "verify.json: not a kvforge evidence record", bad_evidence),
    # ---------------------------------------------------------------- build --arch / --device
    C("build-unknown-target", "build -t nosuch --arch x86_64", 2, "nosuch"),
    C("build-bad-arch", "build -t v0.20.1 --arch riscv64", 2, "--arch"),
    C("build-bad-device", "build -t v0.20.1 --device cuda", 2, "--device"),
    C("build-arch-and-device", "build -t v0.20.1 --arch x86_64 --device empty", 2, "--device"),
    C("build-device-vllm-ascend", "build -t v0.20.2rc --component vllm-ascend --device empty", 2, "--device"),
    C("build-bad-shard", "build -t v0.20.1 --shard 3/2", 2, "--shard"),
    C("build-wheel-missing", "build -t v0.20.1 --wheel {tmp}/nope.whl", 2, "nope.whl"),
    C("build-arch-offline-no-wheel-pin", "build -t v0.20.1 --arch aarch64", 6, "offline", no_wheel_pins),
    C("build-unknown-component", "build -t v0.20.1 --component nosuch --arch x86_64", 2, "nosuch"),
    # ---------------------------------------------------------------- lint --selections
    C("lint-unknown-target", "lint -t nosuch", 2, "nosuch"),
    C("lint-selections-unknown-target", "lint --selections -t nosuch", 2, "nosuch"),
    C("lint-selections-unknown-component", "lint --selections -t v0.20.1 --component nosuch", 2, "nosuch"),
    C("lint-selections-offline-no-sdist", "lint --selections -t v0.20.1", 6, "offline"),
    # ---------------------------------------------------------------- pr --open
    C("pr-unknown-fix", "pr -t v0.20.1 --fix no-such-fix", 2, "no-such-fix"),
    C("pr-open-repo-not-a-clone", "pr -t main --fix kv-events-token-ids --repo {tmp}/plain --push-to fork --open", 2,
      "not a git clone", with_(plain_dir, GH)),
    C("pr-open-repo-missing", "pr -t main --fix kv-events-token-ids --repo {tmp}/gone --push-to fork --open", 2,
      "--repo CLONE", GH),
    C("pr-open-without-repo", "pr -t main --fix kv-events-token-ids --push-to fork --open", 2, "--repo CLONE", GH),
    C("pr-open-without-push-to", "pr -t main --fix kv-events-token-ids --repo {user} --open", 2, "--push-to",
      with_(USER, GH)),
    C("pr-open-without-gh", "pr -t main --fix kv-events-token-ids --repo {user} --push-to fork --open", 5, "`gh`",
      with_(USER, lambda w: w.env.update(PATH=str(Path(shutil.which("git") or "git").parent)))),
    # ---------------------------------------------------------------- import
    C("import-source-missing", "import -t v0.20.1 {tmp}/nope", 2, "nope"),
    C("import-unknown-target", "import -t nosuch {tmp}/series-in", 2, "nosuch",
      lambda w: patch_dir(w, {"0001-a.patch": "x\n"})),
    C("import-empty-dir", "import -t v0.20.1 {tmp}/series-in", 2, "series-in", lambda w: patch_dir(w, {})),
    C("import-not-patches", "import -t v0.20.1 {tmp}/series-in", 2, "notes.patch",
      lambda w: patch_dir(w, {"notes.patch": "just some notes\n"})),
    C("import-order-missing", "import -t v0.20.1 {tmp}/series-in --order {tmp}/order.txt", 2, "order.txt",
      lambda w: patch_dir(w, {"0001-a.patch": "x\n"})),
    C("import-repo-not-a-clone", "import -t v0.20.1 --repo {tmp}/plain main..topic", 2, "plain", plain_dir),
    C("import-repo-bad-range", "import -t v0.20.1 --repo {user} nothing-here", 2, "nothing-here", USER),
    C("import-garbage-mbox", "import -t v0.20.1 {tmp}/mail.mbox", 2, "mail.mbox",
      lambda w: (w.tmp / "mail.mbox").write_bytes(b"From nobody\n\x00\x01\x02 garbage\n")),
]


def snapshot(paths: list[Path]) -> dict[str, str]:
    """Every file, link and directory under `paths` (the .git directories included): path -> kind and sha256."""
    out: dict[str, str] = {}
    for top in paths:
        for d, dirs, files in os.walk(top):
            for name in dirs + files:
                p = Path(d) / name
                if p.is_symlink():
                    out[str(p)] = "link " + os.readlink(p)
                elif p.is_dir():
                    out[str(p)] = "dir"
                else:
                    out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
        if not top.exists():
            out[str(top)] = "missing"
    return out


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """The shipped targets/ and patches/, copied once: each case copies this."""
    t = tmp_path_factory.mktemp("corpus-template") / "project"
    for d in ("targets", "patches"):
        shutil.copytree(REPO_ROOT / d, t / d)
    return t


@pytest.fixture(scope="module")
def shared_base() -> Base:
    """v0.20.1's vLLM base, imported into the shared cache once (from the sdist there, downloaded when missing)."""
    return ensure_base(load_target("v0.20.1", REPO_ROOT).component("vllm"), Cache(default_cache_dir()), "sdist")


@pytest.fixture(scope="module")
def index() -> Iterator[Index]:
    idx = Index()
    yield idx
    idx.close()


def params() -> list:
    out = []
    for c in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=f"fixed on branch h/{c.fixed_on}")] if c.fixed_on else []
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


def test_the_corpus_is_large_and_its_ids_unique():
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)
    verbs = {c.argv[0] if c.argv[0] != "target" else "target add" for c in CASES}
    assert verbs >= {"pick", "target add", "watch", "init", "report", "build", "lint", "pr", "import"}


@pytest.mark.parametrize("case", params())
def test_fault_case(case: Case, template: Path, index: Index, shared_base: Base, tmp_path: Path, monkeypatch):
    root = tmp_path / "project"
    shutil.copytree(template, root, symlinks=True)
    work = tmp_path / "work"
    work.mkdir()
    index.docs.clear()
    index.requests.clear()
    env = {"KVFORGE_ROOT": str(root), "KVFORGE_CACHE": str(tmp_path / "cache"), "KVFORGE_OFFLINE": "1",
           "KVFORGE_PYPI_URL": DEAD_INDEX, "HOME": str(tmp_path / "home")}
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[user]\n\tname = A User\n\temail = user@example.org\n")
    w = World(root, work, env, index, shared_base)
    if case.setup is not None:
        case.setup(w)
    for name in ("KVFORGE_VLLM_REPO", "KVFORGE_VLLM_ASCEND_REPO", "KVFORGE_OFFLINE", "KVFORGE_PYPI_URL"):
        monkeypatch.delenv(name, raising=False)
    for k, v in w.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(work)
    fill = {"root": str(root), "tmp": str(work), "user": str(work / "user-repo"),
            "patch": str(work / "change.patch")}
    argv = [a.format(**fill) for a in case.argv]
    watched = [root, *w.watched]
    before = snapshot(watched)
    res = CliRunner().invoke(main, argv)
    lines = res.stderr.strip().splitlines()
    assert "internal error" not in res.stderr and "Traceback" not in res.output + res.stderr, res.stderr
    assert res.exit_code == case.code, (argv, res.exit_code, res.stderr)
    errors = [ln for ln in lines if ln.startswith(("kvforge: error:", "Error:"))]
    if case.code == 0:  # a refusal that is not an error (a dry run saying what it would do): no error line
        assert not errors and any(case.line.lower() in ln.lower() for ln in lines), (argv, lines)
    else:
        assert len(errors) == 1 and case.line.lower() in errors[0].lower(), (argv, lines)
    assert snapshot(watched) == before, f"{argv}: something was written"
    if w.env.get("KVFORGE_OFFLINE"):
        assert index.requests == [], f"{argv}: offline, yet the package index was asked"
