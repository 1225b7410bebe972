"""kvforge build: the release wheel with the series overlaid, reproducible, refused when it cannot be
honest, and verified by installing it.

The overlay is tested on small wheels made here in the real format (a zip with dist-info, WHEEL
and RECORD, deflated members, a binary "extension") around files of the real vLLM 0.20.2 base;
the raw-copy writer on zips zipfile made (with and without data descriptors); the version scheme
against vllm-ascend's own `vllm_version_is`, taken from its real sdist. One slow test builds and
verifies a wheel of vLLM's real Python sources end to end through the CLI (Checks run with vllm
imported from the installed wheel); one overlays the real 244 MB release wheel twice (no tests).
"""

from __future__ import annotations

import ast
import csv
import errno
import hashlib
import io
import itertools
import json
import os
import stat
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import git, make_patch, write_series

from kvforge.wheels import changes as kchanges
from kvforge.wheels import choose as kchoose
from kvforge.wheels import download as kdownload
from kvforge.wheels import overlay as koverlay
from kvforge.wheels import prepare as kprepare
from kvforge.wheels import result as kresult
from kvforge.wheels import verify as kverify
from kvforge.core.cache import Cache, default_cache_dir
from kvforge.core.errors import KvforgeError
from kvforge.cli import main
from kvforge.core import wheel as kwheel
from kvforge.core.wheel import (RawZipWriter, WheelError, format_record, parse_record, read_member, read_members,
                           record_hash, safe_name)

UTILS = "vllm/v1/core/kv_cache_utils.py"
WHEEL_NAME = "vllm-0.20.2-cp38-abi3-linux_x86_64.whl"  # a name of its own: never the real wheel's
USER_DOWNLOADS = default_cache_dir() / "downloads"  # resolved before fixtures move $KVFORGE_CACHE
ASCEND_SDIST = "vllm_ascend-0.20.2rc1.tar.gz"
ASCEND_SHA256 = "8ebd5c5b2ef5009baae1c5ddee390a0fe2821ef31aa33312a0b491f5b5185797"

TARGET = """\
name = "t"
description = "test target on vLLM 0.20.2"

[[components]]
name = "vllm"
repo = "https://invalid.invalid/vllm.git"
ref = "v0.20.2"
series = "patches/t"
platforms = ["cpu", "cuda"]

[components.release]
package = "vllm"
version = "0.20.2"
sha256 = "58809377798c5335c6e2fe30092abda54d9200b5b8a717b3735a63f5daa0e383"

[components.wheel]
filename = "{filename}"
sha256 = "{sha}"

[components.tests]
cpu = ["tests/v1/core/test_kv_cache_utils.py"]
"""
NEW_TEST = '''\
from vllm.v1.core import kvforge_marker


def test_marker():
    assert kvforge_marker.MARKER == "patched"
'''
CHECK = "tests/v1/core/test_kvforge_marker.py::test_marker"


def make_wheel(path: Path, files: dict[str, bytes], dist: str = "vllm-0.20.2", descriptors: bool = False) -> Path:
    """A wheel in the real format: members deflated, dist-info with METADATA, WHEEL and RECORD last."""
    info = f"{dist}.dist-info"
    name, version = dist.split("-")
    meta = {f"{info}/METADATA": f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\n".encode(),
            f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: setuptools (80.10.2)\nRoot-Is-Purelib: false\n"
                             b"Tag: cp38-abi3-linux_x86_64\n\n",
            f"{info}/top_level.txt": b"vllm\n"}
    members = {**files, **meta}
    rows = "".join(f"{n},{record_hash(d)},{len(d)}\n" for n, d in members.items()) + f"{info}/RECORD,,\n"
    members[f"{info}/RECORD"] = rows.encode()
    buf = io.BytesIO()
    target = _Unseekable(buf) if descriptors else buf
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in members.items():
            zi = zipfile.ZipInfo(n, (2026, 5, 8, 20, 9, 8))
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = (stat.S_IFREG | (0o755 if n.endswith(".so") else 0o644)) << 16
            z.writestr(zi, d)
    path.write_bytes(buf.getvalue())
    return path


class _Unseekable(io.RawIOBase):
    """zipfile writes data descriptors (flag bit 3) when it cannot seek back."""

    def __init__(self, buf):
        self.buf = buf

    def writable(self):
        return True

    def write(self, b):
        return self.buf.write(b)

    def tell(self):
        return self.buf.tell()

    def flush(self):
        pass


def base_files(base) -> dict[str, bytes]:
    """A small vLLM: version, a minimal __init__, the real kv_cache_utils.py, a binary extension."""
    show = lambda p: git(base.repo, "show", f"{base.commit}:{p}").encode()  # noqa: E731
    return {"vllm/__init__.py": b"from vllm._version import __version__, __version_tuple__  # noqa: F401\n",
            "vllm/_version.py": show("vllm/_version.py"),
            "vllm/v1/__init__.py": b"", "vllm/v1/core/__init__.py": b"",
            UTILS: show(UTILS),
            "vllm/_C.abi3.so": hashlib.sha256(b"x").digest() * 40000}


def pin_wheel(project: Path, cache: Cache, wheel: Path) -> None:
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (project / "targets" / "t.toml").write_text(TARGET.format(filename=wheel.name, sha=sha))
    dest = cache.downloads / wheel.name
    dest.write_bytes(wheel.read_bytes())


def marker_series(project: Path, base, extra_edits: dict | None = None) -> None:
    d = project / "patches" / "t"
    edits = {UTILS: ("class FreeKVCacheBlockQueue:", "class FreeKVCacheBlockQueue:  # kvforge"),
             "vllm/v1/core/kvforge_marker.py": ("", 'MARKER = "patched"\n'),
             "tests/v1/core/test_kvforge_marker.py": ("", NEW_TEST), **(extra_edits or {})}
    make_patch(base.repo, base.commit, edits, "[Core] mark the queue", "mark-queue", d / "0001-mark-queue.patch",
               kind="fix", extra=f"Checks: {CHECK}\n")
    write_series(project, "0001-mark-queue.patch")


def overlay_once(project, cache, out: Path):
    """The overlay half of build_target (no verification): (path, BuildResult-like info)."""
    from kvforge.git.context import Context
    from kvforge.git.trees import open_stack

    ctx = Context.load(cache, "t")
    stack = open_stack(ctx)
    patched = stack.commits[-1]
    upstream = kdownload.download_wheel(ctx.component, cache, print)
    changes = kchanges.diff_paths(stack.base.repo, stack.base.commit, patched)
    kchanges.classify(changes, {m.name for m in read_members(upstream)}, lambda *_: None)
    res = kresult.BuildResult("t", "vllm", "overlay", "0.20.2")
    res.build_tag = koverlay.build_tag_for(ctx.component.wheel.filename, stack.digest)
    res.local_version = koverlay.local_version("0.20.2", "t", stack.digest)
    res.filename = koverlay.output_filename(ctx.component.wheel.filename, res.build_tag, res.local_version)
    built, _ = kprepare.write_overlay(ctx, stack, upstream, out, changes, {"base": stack.base.commit,
                                                                        "patched": patched}, res)
    return built, stack, changes, res


# ---------------------------------------------------------------- the zip writer

@pytest.mark.parametrize("descriptors", [False, True])
def test_raw_copy_keeps_every_member_and_zipfile_reads_the_result(tmp_path, descriptors):
    src = make_wheel(tmp_path / "a.whl", {"vllm/a.py": b"a = 1\n" * 500, "vllm/b.so": os.urandom(70000),
                                          "vllm/c.txt": b""}, descriptors=descriptors)
    members = read_members(src)
    assert bool(members[0].flags & 0x8) == descriptors
    out = tmp_path / "b.whl"
    with open(src, "rb") as s, open(out, "wb") as o:
        w = RawZipWriter(o)
        for m in reversed(members):  # a different order: offsets must be rewritten
            w.copy(s, m, src.name)
        w.add("vllm/new.py", "ünï = 1\n".encode(), (2026, 1, 2, 3, 4, 6), 0o644)
        w.close()
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(out) as b:
        assert b.testzip() is None
        for info in a.infolist():
            assert b.read(info.filename) == a.read(info.filename)
            assert b.getinfo(info.filename).compress_size == info.compress_size  # not recompressed
            assert b.getinfo(info.filename).external_attr == info.external_attr
        new = b.getinfo("vllm/new.py")
        assert new.compress_type == zipfile.ZIP_STORED and new.date_time == (2026, 1, 2, 3, 4, 6)
        assert [i.filename for i in b.infolist()][-1] == "vllm/new.py"


@pytest.mark.parametrize("name, attr, why", [
    ("../evil.py", 0o644, "'..'"), ("/etc/evil", 0o644, "absolute"), ("vllm\\evil.py", 0o644, "backslash"),
    ("C:/evil", 0o644, "absolute"), ("vllm/./x.py", 0o644, "'.'"), ("vllm/link", stat.S_IFLNK | 0o777, "symbolic link"),
])
def test_unsafe_member_names_are_refused(tmp_path, name, attr, why):
    p = tmp_path / "bad.whl"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("vllm/ok.py", b"")
        zi = zipfile.ZipInfo("placeholder")
        zi.filename = name  # ZipInfo would normalise some names; write them as given
        zi.external_attr = (attr if attr & 0o170000 else stat.S_IFREG | attr) << 16
        z.writestr(zi, b"target")
    with pytest.raises(WheelError, match=why):
        read_members(p)


def test_duplicate_and_zip64_and_truncated_archives_are_refused(tmp_path):
    p = tmp_path / "dup.whl"
    with pytest.warns(UserWarning), zipfile.ZipFile(p, "w") as z:
        z.writestr("vllm/a.py", b"1")
        z.writestr("vllm/a.py", b"2")
    with pytest.raises(WheelError, match="twice"):
        read_members(p)
    big = tmp_path / "z64.whl"
    data = bytearray(make_wheel(tmp_path / "small.whl", {"vllm/a.py": b"a"}).read_bytes())
    data[-12:-10] = b"\xff\xff"  # the EOCD's entry count: 0xFFFF means "see the zip64 record"
    big.write_bytes(bytes(data))
    with pytest.raises(WheelError, match="zip64"):
        read_members(big)
    cut = tmp_path / "cut.whl"
    cut.write_bytes(make_wheel(tmp_path / "ok.whl", {"vllm/a.py": b"a"}).read_bytes()[:-30])
    with pytest.raises(WheelError, match="not a zip"):
        read_members(cut)


def test_local_headers_are_checked_against_the_central_directory(tmp_path):
    """wheel.local_spans (what the overlay copies, checked ahead): a local header naming another file, or data
    running past the end of the file, is refused."""
    ok = make_wheel(tmp_path / "ok.whl", {"vllm/a.py": b"a = 1\n" * 100})
    members = read_members(ok)
    spans = kwheel.local_spans(ok, members)
    assert spans[members[0].name] == (0, 30 + len(members[0].raw_name) + members[0].compress_size)
    data = bytearray(ok.read_bytes())
    data[30:30 + len(b"vllm/a.py")] = b"vllm/b.py"  # the first local header's name
    (tmp_path / "renamed.whl").write_bytes(bytes(data))
    with pytest.raises(WheelError, match="names another file"):
        kwheel.local_spans(tmp_path / "renamed.whl", members)
    short = kwheel.Member(**{**{f: getattr(members[0], f) for f in members[0].__dataclass_fields__},
                             "compress_size": len(data)})
    with pytest.raises(WheelError, match="disagree|past the end"):
        kwheel.local_spans(ok, [short])


def test_record_paths_are_checked(tmp_path):
    with pytest.raises(WheelError, match="'..'"):
        parse_record("vllm/a.py,sha256=x,1\nvllm/../../x,sha256=y,2\n", "w")
    assert parse_record("../../bin/vllm,sha256=x,1\n", "installed")  # pip's scripts outside the site


def test_the_fast_paths_agree_with_the_full_checks():
    """safe_name's fast path, and RECORD read and written without the csv module where nothing is quoted, give
    what the full rules give: every name of up to 6 characters over the characters that matter."""
    def full(name: str) -> bool:
        parts = name.rstrip("/").split("/")
        return bool(name) and "\x00" not in name and "\\" not in name and not name.startswith("/") and \
            not (len(name) > 1 and name[1] == ":") and not any(p in ("", ".", "..") for p in parts)

    for n in range(7):
        for chars in itertools.product(["a", ".", "/", "\\", ":", "\x00", "\n"], repeat=n):
            name = "".join(chars)
            assert (safe_name(name) is None) == full(name), repr(name)

    def by_csv(rows) -> bytes:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        for row in rows:
            w.writerow(row)
        return buf.getvalue().encode()

    rows = [("vllm/a.py", "sha256=x", "1"), ("vllm/E=8,N=14336.json", "sha256=y", "2"), ('vllm/q"uote.py', "", ""),
            ("vllm/n\nl.py", "h", "3"), ("vllm/cr\r.py", "h", "4"), ("vllm/é.py", " ", "5"), ("vllm-1.dist-info/RECORD", "", "")]
    for some in [rows, rows[:1] + rows[-1:], [rows[0]]]:
        assert format_record(some) == by_csv(some)
        readable = [r for r in some if "\r" not in r[0]]  # csv.writer leaves a CR unquoted: csv cannot read it
        assert parse_record(by_csv(readable).decode(), "w") == {p: (h, n) for p, h, n in readable}
    assert parse_record("vllm/a.py,h,1\n\nvllm/b.py,h,2", "w") == {"vllm/a.py": ("h", "1"), "vllm/b.py": ("h", "2")}
    with pytest.raises(WheelError, match="3 fields"):
        parse_record("vllm/a.py,h\n", "w")


def test_a_copy_that_fails_is_raised_and_the_writer_lets_go_of_its_source(tmp_path, monkeypatch):
    """A kernel copy that fails (a full disk) raises out of the writer, also from the thread that copies the
    big ranges; a `with` block that fails stops that thread and closes the source's mmap."""
    src = make_wheel(tmp_path / "a.whl", {"vllm/a.py": b"a = 1\n" * 500,
                                          "vllm/b.so": os.urandom(RawZipWriter.BIG + 1)})
    members = read_members(src)
    with open(src, "rb") as s, open(tmp_path / "ok.whl", "wb") as o, RawZipWriter(o) as w:
        for m in reversed(members):  # the big .so alone is a range: copied by the thread
            w.copy(s, m, src.name)
        w.close()
        assert w.copier is not None and not w.copier.is_alive()
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(tmp_path / "ok.whl") as b:
        assert b.testzip() is None and all(b.read(i.filename) == a.read(i.filename) for i in a.infolist())

    def full_disk(*_a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kwheel, "_copy_range", full_disk)
    with open(src, "rb") as s, open(tmp_path / "b.whl", "wb") as o:
        w = RawZipWriter(o)
        for m in members:
            w.copy(s, m, src.name)  # one range: copied at close()
        with pytest.raises(OSError, match="No space"):
            w.close()
    assert not w.views and w.copier is not None and not w.copier.is_alive()
    monkeypatch.undo()
    with open(src, "rb") as s, open(tmp_path / "c.whl", "wb") as o:
        with pytest.raises(WheelError, match="written twice"), RawZipWriter(o) as w:
            w.copy(s, members[0], src.name)
            w.add("vllm/new.py", b"x", (2026, 1, 1, 0, 0, 0))
            w.add("vllm/new.py", b"x", (2026, 1, 1, 0, 0, 0))
    assert not w.views


# ---------------------------------------------------------------- the overlay

@pytest.fixture(scope="module")
def overlaid(base_v0202, tmp_path_factory):
    """A project with a one-patch series on the real 0.20.2 base, a small wheel pinned, overlaid once."""
    cache, base = base_v0202
    tmp = tmp_path_factory.mktemp("overlaid")
    root = tmp / "project"
    (root / "targets").mkdir(parents=True)
    (root / "patches" / "t").mkdir(parents=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFORGE_ROOT", str(root))
        mp.setenv("KVFORGE_CACHE", str(cache.root))
        mp.setenv("KVFORGE_OFFLINE", "1")
        src = make_wheel(tmp / WHEEL_NAME, base_files(base))
        pin_wheel(root, cache, src)
        marker_series(root, base)
        built, stack, changes, res = overlay_once(root, cache, tmp / "out")
        yield {"root": root, "cache": cache, "base": base, "src": src, "built": built, "stack": stack,
               "changes": changes, "tmp": tmp, "mp": mp}


def test_overlay_replaces_adds_keeps_the_rest_and_records_identity(overlaid):
    base, src, built, stack, changes = (overlaid[k] for k in ("base", "src", "built", "stack", "changes"))
    actions = {c.path: c.action for c in changes}
    assert actions == {UTILS: "replace", "vllm/v1/core/kvforge_marker.py": "add",
                       "tests/v1/core/test_kvforge_marker.py": "not packaged"}
    local = f"0.20.2+kvforge.t.{stack.digest}"
    assert built.name == f"vllm-{local}-1_kvforge_{stack.digest}-cp38-abi3-linux_x86_64.whl"
    from packaging.utils import parse_wheel_filename

    _name, version, build_tag, tags = parse_wheel_filename(built.name)
    assert (str(version), build_tag) == (local, (1, f"_kvforge_{stack.digest}"))  # the release + a local label
    assert {str(t) for t in tags} == {"cp38-abi3-linux_x86_64"}
    up, new = {m.name: m for m in read_members(src)}, {m.name: m for m in read_members(built)}
    info = f"vllm-{local}.dist-info"
    assert not any(n.startswith("vllm-0.20.2.dist-info/") for n in new)
    # Untouched members: the same stored bytes (the .so is not recompressed), same mode.
    for n in ("vllm/_C.abi3.so", "vllm/_version.py", "vllm/__init__.py"):
        assert (new[n].crc, new[n].compress_size, new[n].external_attr) == (up[n].crc, up[n].compress_size,
                                                                            up[n].external_attr)
    meta = read_member(built, new[f"{info}/METADATA"]).decode()
    assert f"Version: {local}\n" in meta and meta.replace(local, "0.20.2") == \
        read_member(src, up["vllm-0.20.2.dist-info/METADATA"]).decode()
    patched = git(base.repo, "show", f"{stack.commits[-1]}:{UTILS}").encode()
    assert read_member(built, new[UTILS]) == patched and "# kvforge" in patched.decode()
    assert read_member(built, new["vllm/v1/core/kvforge_marker.py"]) == b'MARKER = "patched"\n'
    wheel_txt = read_member(built, new[f"{info}/WHEEL"]).decode()
    assert f"Build: 1_kvforge_{stack.digest}" in wheel_txt and "Tag: cp38-abi3-linux_x86_64" in wheel_txt
    ident = json.loads(read_member(built, new[f"{info}/kvforge.json"]))
    assert ident["target"] == "t" and ident["version"] == "0.20.2" and ident["fix_ids"] == ["mark-queue"]
    assert ident["local_version"] == local
    assert ident["base"]["commit"] == base.commit and ident["series"]["digest"] == stack.digest
    assert ident["files"] == {"replace": [UTILS], "add": ["vllm/v1/core/kvforge_marker.py"], "remove": []}
    # RECORD: every file, with its sha256 and size; sorted, dist-info last, RECORD last.
    names = [m.name for m in read_members(built)]
    assert names[-1] == f"{info}/RECORD" and names[:-1] == sorted(names[:-1], key=lambda n: (n.startswith(info), n))
    record = parse_record(read_member(built, new[f"{info}/RECORD"]).decode(), "built")
    assert set(record) == set(names)
    for n in names[:-1]:
        data = read_member(built, new[n])
        assert record[n] == (record_hash(data), str(len(data)))
    with zipfile.ZipFile(built) as z:
        assert z.testzip() is None


def test_the_same_base_and_series_give_the_same_bytes(overlaid):
    """Built again from nothing (the stack re-applied, later, another output directory): the same bytes."""
    cache, base, built = overlaid["cache"], overlaid["base"], overlaid["built"]
    refs = git(base.repo, "for-each-ref", "--format=%(refname)", "refs/kvforge/stacks/t").split()
    for ref in refs:
        git(base.repo, "update-ref", "-d", ref)
    overlaid["mp"].setenv("TZ", "Asia/Kathmandu")
    again, stack, *_ = overlay_once(overlaid["root"], cache, overlaid["tmp"] / "out-again")
    assert stack.built and again.read_bytes() == built.read_bytes()


def test_pip_installs_it_and_record_and_modules_check_out(overlaid):
    built, stack, changes, tmp = (overlaid[k] for k in ("built", "stack", "changes", "tmp"))
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(site), str(built)], check=True)
    rev = {"base": stack.base.commit, "patched": stack.commits[-1]}
    rec = kverify.check_record(built, site)
    assert rec["problems"] == [] and rec["checked"] == rec["files"] - 1  # all but RECORD itself
    mods = kverify.check_modules(stack, site, changes, rev)
    assert mods["problems"] == [] and sorted(mods["equal"]) == [UTILS, "vllm/v1/core/kvforge_marker.py"]
    # A file changed after install is caught by both checks.
    (site / UTILS).write_text("tampered\n")
    assert any(UTILS in p for p in kverify.check_record(built, site)["problems"])
    assert any(UTILS in p for p in kverify.check_modules(stack, site, changes, rev)["problems"])


def test_a_downloaded_wheel_is_stamped_so_the_first_build_does_not_hash_it_again(tmp_path, monkeypatch):
    """download_pinned checks the sha256 while it downloads; the stamp it leaves lets the build's Hasher take
    the digest without reading the file; a file rewritten since (new ctime) is hashed again."""
    from kvforge.project.targets import WheelPin

    (tmp_path / "src").mkdir()
    src = make_wheel(tmp_path / "src" / WHEEL_NAME, {"vllm/a.py": b"a = 1\n"})
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    cache = Cache(tmp_path / "cache")
    entry = {"filename": WHEEL_NAME, "url": src.as_uri(), "digests": {"sha256": sha}, "size": src.stat().st_size}
    monkeypatch.setattr(kdownload, "release_files", lambda *_a: ("https://pypi.invalid/simple/", [entry]))
    comp = type("C", (), {"release": type("R", (), {"package": "vllm", "version": "0.20.2"})(), "wheel": None})()
    path = kdownload.download_wheel(comp, cache, lambda _m: None, WheelPin(WHEEL_NAME, sha))
    assert path.read_bytes() == src.read_bytes()
    hasher = kdownload.Hasher(path)
    hasher.run()
    assert (hasher.stamped, hasher.digest) == (True, sha)
    path.write_bytes(path.read_bytes())  # same bytes, rewritten: the stamp no longer vouches for it
    again = kdownload.Hasher(path)
    again.run()
    assert (again.stamped, again.digest) == (False, sha)


def test_the_changed_files_are_read_by_blob_id_as_by_path(overlaid):
    """changed_files (one git diff --raw, one cat-file by blob id, in build_target's thread) gives the changes
    diff_paths gives and, for the package's files and pyproject.toml, the bytes read_blobs reads by path."""
    stack = overlaid["stack"]
    rev = {"base": stack.base.commit, "patched": stack.commits[-1]}
    changes, blobs = kchanges.changed_files(stack.base.repo, rev, kchanges.VLLM_RULES)
    assert [(c.path, c.status) for c in changes] == \
        [(c.path, c.status) for c in kchanges.diff_paths(stack.base.repo, rev["base"], rev["patched"])]
    specs = [f"{rev[w]}:{c.path}" for c in changes for w in ("base", "patched") if c.path.startswith("vllm/")]
    assert blobs == kchanges.read_blobs(stack.base.repo, specs)
    assert blobs[f"{rev['base']}:vllm/v1/core/kvforge_marker.py"] is None  # added: no base side
    assert not any(":tests/" in spec for spec in blobs)  # outside the package: not read


def test_a_wheel_whose_record_disagrees_is_refused_and_leaves_no_stage(overlaid):
    """RECORD is checked against the archive (prepare_wheel does it while git reads the changed files): a
    refusal leaves nothing in --out."""
    base, tmp = overlaid["base"], overlaid["tmp"]
    (tmp / "norec").mkdir()
    bad = make_wheel(tmp / "norec" / WHEEL_NAME, base_files(base))
    with zipfile.ZipFile(bad) as z:
        items = [(i, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(bad, "w") as z:
        for info, data in items:
            z.writestr(info, data.replace(b"vllm/_version.py,", b"vllm/_not_there.py,") if
                       info.filename.endswith("RECORD") else data)
    from kvforge.git.context import Context

    ctx = Context.load(overlaid["cache"], "t")
    stack, changes = overlaid["stack"], overlaid["changes"]
    res = kresult.BuildResult("t", "vllm", "overlay", "0.20.2", build_tag="1_kvforge_x", filename=WHEEL_NAME)
    with pytest.raises(WheelError, match="RECORD and the archive disagree"):
        kprepare.write_overlay(ctx, stack, bad, tmp / "out-norec", changes,
                             {"base": stack.base.commit, "patched": stack.commits[-1]}, res)
    assert list((tmp / "out-norec").iterdir()) == []


def test_a_wheel_not_built_from_this_base_is_refused(overlaid):
    base, tmp = overlaid["base"], overlaid["tmp"]
    files = base_files(base)
    files[UTILS] = files[UTILS].replace(b"class FreeKVCacheBlockQueue:", b"class FreeKVCacheBlockQueue:  # other")
    (tmp / "other").mkdir()
    other = make_wheel(tmp / "other" / WHEEL_NAME, files)
    from kvforge.git.context import Context

    ctx = Context.load(overlaid["cache"], "t")
    stack, changes = overlaid["stack"], overlaid["changes"]
    res = kresult.BuildResult("t", "vllm", "overlay", "0.20.2", build_tag="1_kvforge_x", filename=WHEEL_NAME)
    with pytest.raises(KvforgeError, match="not built from this base"):
        kprepare.write_overlay(ctx, stack, other, tmp / "out-other", changes,
                             {"base": stack.base.commit, "patched": stack.commits[-1]}, res)
    assert not (tmp / "out-other").exists()


@pytest.mark.parametrize("path, status, action, why", [
    ("csrc/attention/kernel.cu", "M", "refused", "compile"), ("cmake/utils.cmake", "M", "refused", "compile"),
    ("CMakeLists.txt", "M", "refused", "compile"), ("setup.py", "M", "refused", "packaging"),
    ("requirements/common.txt", "M", "refused", "packaging"), ("requirements/cuda.txt", "M", "refused", "packaging"),
    ("requirements/build/cuda.txt", "M", "refused", "packaging"), ("vllm/_version.py", "M", "refused", "packaging"),
    ("vllm/model_executor/configs/new.json", "A", "refused", "packaging"),
    ("vllm/v1/core/new.py", "A", "add", ""), ("vllm/v1/core/block_pool.py", "M", "replace", ""),
    ("vllm/v1/core/old.py", "D", "remove", ""), ("tests/v1/core/test_x.py", "A", "not packaged", "outside vllm/"),
    ("docs/x.md", "M", "not packaged", "outside vllm/"),
])
def test_what_the_overlay_does_with_each_changed_path(path, status, action, why):
    c = kresult.Change(path, status)
    kchanges.classify([c], {"vllm/v1/core/block_pool.py", "vllm/v1/core/old.py"}, lambda *_: None)
    assert (c.action, c.why) == (action, why)


def test_pyproject_changes_are_refused_only_when_they_touch_the_build():
    base = b'[build-system]\nrequires = ["torch == 2.11.0"]\n[tool.ruff]\nline-length = 80\n'
    tool = base.replace(b"80", b"120")
    build = base.replace(b"2.11.0", b"2.12.0")
    for after, action in ((tool, "not packaged"), (build, "refused")):
        c = kresult.Change("pyproject.toml", "M")
        kchanges.classify([c], set(), lambda which, _p, after=after: base if which == "base" else after)
        assert c.action == action


def test_compiled_inputs_are_refused_and_mode_source_prints_vllms_build(project, base_v0202, tmp_path):
    cache, base = base_v0202
    pin_wheel(project, cache, make_wheel(tmp_path / WHEEL_NAME, base_files(base)))
    marker_series(project, base, {"csrc/kvforge_kernel.cu": ("", "// kvforge\n"),
                                  "setup.py": ("import", "import  ")})
    res = CliRunner().invoke(main, ["build", "--target", "t", "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 2, res.output
    doc = json.loads(res.stdout)
    assert "csrc/kvforge_kernel.cu" in doc["error"] and "a compiled input" in doc["error"]
    assert "and 1 more: setup.py" in doc["error"] and "--mode source" in doc["error"]
    # precompiled .so files would not contain a csrc/ change: a full compile, with the release's exact version
    assert "VLLM_VERSION_OVERRIDE=0.20.2" in doc["command"] and "VLLM_USE_PRECOMPILED" not in doc["command"]
    assert not (tmp_path / "out").exists()  # the stage of the early copies, and the --out made for it, are gone
    (tmp_path / "kept").mkdir()
    res = CliRunner().invoke(main, ["build", "--target", "t", "--out", str(tmp_path / "kept")])
    assert res.exit_code == 2 and list((tmp_path / "kept").iterdir()) == [], res.output  # a user's --out stays
    src = CliRunner().invoke(main, ["build", "--target", "t", "--mode", "source", "--out", str(tmp_path / "o")])
    assert src.exit_code == 7, src.output
    assert "kvforge apply --target t --into vllm-t && cd vllm-t" in src.stdout and "pip wheel" in src.stdout
    assert "not run" in src.stderr and "csrc/ changes, compiles" in src.stderr
    # A packaging-only change: vLLM's precompiled build with the release wheel.
    (project / "patches" / "t" / "0001-mark-queue.patch").unlink()
    marker_series(project, base, {"setup.py": ("import", "import  ")})
    src = CliRunner().invoke(main, ["build", "--target", "t", "--mode", "source", "--json"])
    cmd = json.loads(src.stdout)["command"]
    assert "VLLM_USE_PRECOMPILED=1" in cmd and f"VLLM_PRECOMPILED_WHEEL_LOCATION={cache.root}/downloads/{WHEEL_NAME}" in cmd


def test_target_without_a_wheel_pin_and_bad_pins(project, tmp_path, monkeypatch):
    # no pin: the index's choice (choose_wheels, as for a target an older `rebase --as` wrote); none there: exit 2
    asked = []
    monkeypatch.setattr(kchoose, "choose_wheels",
                        lambda package, version, upload=None: asked.append((package, version)) or {})
    res = CliRunner().invoke(main, ["build", "--target", "t", "--json"])
    assert res.exit_code == 2 and "release wheel and the index has none" in json.loads(res.stdout)["error"]
    assert asked == [("vllm", "0.20.2")]
    bad = TARGET.format(filename="vllm-0.20.1-cp38-abi3-linux_x86_64.whl", sha="0" * 64)
    (project / "targets" / "t.toml").write_text(bad)
    res = CliRunner().invoke(main, ["build", "--target", "t"])
    assert res.exit_code == 2 and "is not a wheel of vllm==0.20.2" in res.stderr
    (project / "targets" / "t.toml").write_text(TARGET.format(filename="../x.whl", sha="0" * 64))
    res = CliRunner().invoke(main, ["build", "--target", "t"])
    assert res.exit_code == 2 and "not a wheel file name" in res.stderr


# ---------------------------------------------------------------- the version vllm-ascend checks

@pytest.fixture(scope="session")
def ascend_version_is(tmp_path_factory):
    """vllm_version_is, as vllm-ascend 0.20.2rc1 defines it (vllm_ascend/utils.py), from the real sdist."""
    path = USER_DOWNLOADS / ASCEND_SDIST
    if not path.is_file():
        index = "https://pypi.org/pypi/vllm-ascend/json"
        meta = json.load(urllib.request.urlopen(index, timeout=60))
        url = next(f["url"] for f in meta["releases"]["0.20.2rc1"] if f["filename"] == ASCEND_SDIST)
        data = urllib.request.urlopen(urllib.parse.urljoin(index, url), timeout=300).read()
        assert hashlib.sha256(data).hexdigest() == ASCEND_SHA256
        USER_DOWNLOADS.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{ASCEND_SDIST}.{os.getpid()}.part")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ASCEND_SHA256
    with tarfile.open(path) as tar:
        source = tar.extractfile("vllm_ascend-0.20.2rc1/vllm_ascend/utils.py").read().decode()
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "vllm_version_is")
    return ast.get_source_segment(source, fn)  # without its @functools.cache decorator


CALL_ASCEND = """
import sys, types
from packaging.version import InvalidVersion, Version
envs_ascend = types.SimpleNamespace(VLLM_VERSION=None)
exec(sys.argv[1])
import vllm
print(vllm.__file__)
print(vllm_version_is("0.20.2"))
"""


def test_the_built_wheel_passes_vllm_ascends_own_version_check(overlaid, tmp_path, ascend_version_is):
    assert "Version(vllm_version) == Version(target_vllm_version)" in ascend_version_is
    built = overlaid["built"]
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(site), str(built)], check=True)
    out = subprocess.run([sys.executable, "-c", CALL_ASCEND, ascend_version_is], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path, check=True).stdout.split()
    assert out == [str(site / "vllm" / "__init__.py"), "True"]
    # Why vllm.__version__ (vllm/_version.py, a package file) keeps the release's version while the
    # distribution's metadata carries kvforge's local label: vllm-ascend's check fails for a local version.
    (site / "vllm" / "_version.py").write_text("__version__ = '0.20.2+kvforge.abc'\n__version_tuple__ = ()\n")
    out = subprocess.run([sys.executable, "-c", CALL_ASCEND, ascend_version_is], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path, check=True).stdout.split()
    assert out[-1] == "False"


def test_an_installed_patched_wheel_shows_its_series_in_pip_freeze_pip_show_and_metadata(overlaid, tmp_path):
    """Provenance that survives install: pip freeze, pip show and importlib.metadata name kvforge, the target
    and the series digest (a build tag alone shows nowhere: `vllm==0.20.2`); vllm.__version__ stays the
    release's, so vllm-ascend's exact check holds without its VLLM_VERSION override."""
    built, stack = overlaid["built"], overlaid["stack"]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    local = f"0.20.2+kvforge.t.{stack.digest}"
    # From an index (here a directory as one: --find-links), as a deployment installs it
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--find-links", str(built.parent), "--target", str(site), f"vllm=={local}"], check=True)
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--path", str(site)], capture_output=True,
                            text=True, check=True).stdout.split()
    assert f"vllm=={local}" in freeze
    show = subprocess.run([sys.executable, "-m", "pip", "show", "vllm"], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path).stdout
    assert f"Version: {local}" in show.splitlines()
    code = ("import importlib.metadata as md, json, vllm; d = md.distribution('vllm'); "
            "print(d.version, vllm.__version__, json.loads(d.read_text('kvforge.json'))['series']['digest'])")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout.split()
    assert out == [local, "0.20.2", stack.digest]


# ---------------------------------------------------------------- end to end (slow)

TEST_ENVS_DIR = Path(os.environ.get("KVFORGE_TEST_ENVS") or default_cache_dir() / "envs")


@pytest.mark.slow
def test_build_cli_verifies_a_wheel_of_vllms_real_python(project, base_v0202, tmp_path, monkeypatch):
    """The whole command on a wheel of the base's real vllm/**/*.py: Checks run with vllm from site-packages."""
    cache, base = base_v0202
    TEST_ENVS_DIR.mkdir(parents=True, exist_ok=True)
    if not (cache.root / "envs").exists():
        (cache.root / "envs").symlink_to(TEST_ENVS_DIR, target_is_directory=True)
    monkeypatch.delenv("KVFORGE_TEST_PYTHON", raising=False)
    names = git(base.repo, "ls-tree", "-r", "--name-only", base.commit, "vllm").split()
    from kvforge.wheels.changes import read_blobs

    blobs = read_blobs(base.repo, [f"{base.commit}:{n}" for n in names if n.endswith(".py")])
    files = {k.split(":", 1)[1]: v for k, v in blobs.items()}
    files["vllm/_C.abi3.so"] = b"\x7fELF not really" * 1000
    pin_wheel(project, cache, make_wheel(tmp_path / WHEEL_NAME, files))
    marker_series(project, base)
    out = tmp_path / "dist"
    res = CliRunner().invoke(main, ["build", "--target", "t", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    v = doc["verification"]
    assert doc["ok"] and v["ok"] and v["problems"] == []
    assert v["probe"]["vllm_file"].endswith("/site/vllm/__init__.py") and v["probe"]["version_is_release"]
    assert v["probe"]["identity"]["series"]["digest"] == doc["series"]
    assert v["tests"]["passed"] == 1 and v["tests"]["selected"] == [CHECK]
    assert v["tests"]["vllm_modules_loaded"] > 10 and v["tests"]["vllm_modules_elsewhere"] == []
    assert [p.name for p in out.iterdir()] == [doc["filename"]]
    assert hashlib.sha256((out / doc["filename"]).read_bytes()).hexdigest() == doc["sha256"]
    # The same wheel, verified again on its own (what a GPU runner does with --platform cuda).
    again = CliRunner().invoke(main, ["build", "--target", "t", "--wheel", str(out), "--json"])
    assert again.exit_code == 0, again.output
    # A failing Check: the wheel is not left in --out.
    (project / "patches" / "t" / "0001-mark-queue.patch").unlink()
    marker_series(project, base, {"vllm/v1/core/kvforge_marker.py": ("", 'MARKER = "wrong"\n')})
    bad = CliRunner().invoke(main, ["build", "--target", "t", "--out", str(tmp_path / "dist2"), "--json"])
    assert bad.exit_code == 4, bad.output
    assert "1 failed" in json.loads(bad.stdout)["error"]
    assert list((tmp_path / "dist2").iterdir()) == []


REAL = "vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl"


@pytest.mark.slow
def test_real_release_wheel_overlay_is_reproducible_and_installs(tmp_path, monkeypatch):
    """vLLM's 244 MB wheel (downloaded once into the user cache): two overlays, equal bytes, RECORD checks."""
    monkeypatch.delenv("KVFORGE_OFFLINE", raising=False)  # the module's `overlaid` fixture sets it
    from kvforge.project.targets import load_target

    from conftest import REPO_ROOT

    comp = load_target("v0.20.2rc", REPO_ROOT).component()
    upstream = kdownload.download_wheel(comp, Cache(default_cache_dir()), print)
    assert hashlib.sha256(upstream.read_bytes()).hexdigest() == comp.wheel.sha256
    members = {m.name: m for m in read_members(upstream)}
    path = "vllm/v1/core/block_pool.py"
    new = read_member(upstream, members[path]) + b"# kvforge overlay test\n"
    outs = []
    for i in (1, 2):
        out = tmp_path / f"{i}" / REAL
        out.parent.mkdir()
        koverlay.overlay(upstream, out, {path: new}, {}, set(), {"test": i // 3}, "1_kvforge_test")
        outs.append(out)
    digests = {hashlib.sha256(o.read_bytes()).hexdigest() for o in outs}
    assert len(digests) == 1
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(site), str(outs[0])], check=True)
    rec = kverify.check_record(outs[0], site)
    assert rec["problems"] == [] and rec["checked"] == len(members) + 1 - 1  # + kvforge.json, - RECORD
    assert (site / path).read_bytes() == new
    assert (site / "vllm" / "_C.abi3.so").stat().st_size == members["vllm/_C.abi3.so"].file_size


def test_cuda_verification_without_a_gpu_is_not_run(project, base_v0202, tmp_path):
    cache, base = base_v0202
    src = make_wheel(tmp_path / WHEEL_NAME, base_files(base))
    pin_wheel(project, cache, src)
    res = CliRunner().invoke(main, ["build", "--target", "t", "--wheel", str(src), "--platform", "cuda", "--json"])
    assert res.exit_code == 2 and "--python" in json.loads(res.stdout)["error"]
    res = CliRunner().invoke(main, ["build", "--target", "t", "--wheel", str(src), "--platform", "cuda",
                                    "--python", sys.executable, "--json"])
    assert res.exit_code == 7, res.output  # this python has no CUDA torch: nothing ran, nothing passed
    assert "not run" in json.loads(res.stdout)["error"]


def test_build_out_on_a_full_disk_is_exit_5_with_one_line(project, base_v0202, tmp_path):
    """--out on a file system that cannot take the wheel (here: the file size limit the kernel enforces,
    EFBIG, as a full disk gives ENOSPC): exit 5, one line naming --out, nothing left in --out."""
    import resource

    from kvforge.git.context import Context
    from kvforge.git.trees import open_stack

    cache, base = base_v0202
    files = base_files(base)
    block, big = b"kvforge", []
    for _ in range(3 * 1024 * 1024 // 32):  # 3 MB that do not compress
        block = hashlib.sha256(block).digest()
        big.append(block)
    files["vllm/_C.abi3.so"] = b"".join(big)
    pin_wheel(project, cache, make_wheel(tmp_path / WHEEL_NAME, files))
    marker_series(project, base)
    open_stack(Context.load(cache, "t"))  # the stack is built before the limit applies: only --out is limited
    out = tmp_path / "dist"
    limit = 1024 * 1024

    def small_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    res = subprocess.run([sys.executable, "-c", "from kvforge.cli import main; main()", "build", "--target", "t",
                          "--out", str(out)], capture_output=True, text=True, preexec_fn=small_disk, timeout=600)
    assert res.returncode == 5, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith(f"kvforge: error: --out {out}: cannot write the wheel there (File too large)"), lines
    assert "Traceback" not in res.stderr
    assert not out.exists()  # made by this build for its stage: removed with it


@pytest.mark.slow
def test_choose_wheels_takes_each_architecture_and_the_highest_build_from_pypis_list(monkeypatch):
    """PyPI's real file lists: vLLM 0.20.2 (manylinux_2_35), 0.21.0 (manylinux_2_24, re-released as build 1 from another commit: the first upload is chosen
    beside the first upload) and 0.22.0 (manylinux_2_28): one pin per architecture, never by the previous
    release's file name."""
    monkeypatch.delenv("KVFORGE_OFFLINE", raising=False)  # the module's `overlaid` fixture sets it
    got = {v: kchoose.choose_wheels("vllm", v) for v in ("0.20.2", "0.21.0", "0.22.0")}
    assert {v: sorted(p) for v, p in got.items()} == {v: ["aarch64", "x86_64"] for v in got}
    assert got["0.20.2"]["x86_64"].filename == "vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl"
    assert got["0.20.2"]["x86_64"].sha256 == "22a7dd06eb03371298e13d6100f3dedbf307352342aaf08e87c929c60aae9b4d"
    assert got["0.20.2"]["aarch64"].filename == "vllm-0.20.2-cp38-abi3-manylinux_2_35_aarch64.whl"
    assert got["0.21.0"]["x86_64"].filename == "vllm-0.21.0-cp38-abi3-manylinux_2_24_x86_64.whl"
    assert got["0.21.0"]["aarch64"].filename == "vllm-0.21.0-cp38-abi3-manylinux_2_24_aarch64.whl"
    assert all("manylinux_2_28" in p.filename for p in got["0.22.0"].values())
    assert all(len(p.sha256) == 64 for v in got.values() for p in v.values())


def _version_wheel(path: Path, commit: str | None) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/__init__.py", "")
        if commit is not None:
            z.writestr("vllm/_version.py", f"__version__ = '0.21.0'\n__commit_id__ = commit_id = 'g{commit}'\n")
    return path


@pytest.mark.parametrize("wheel_commit, base_commit, refused", [
    ("ad7125a43", "9da56fd18", True),  # 0.21.0-1's wheel on 0.21.0's sdist: another commit
    ("9da56fd18", "9da56fd18", False),
    ("9da56fd18", "9da56fd18c0ffee0000000000000000000000000", False),  # a git base: its full commit
    (None, "9da56fd18", False),  # a wheel that records no commit: nothing to compare
    ("9da56fd18", None, False),  # a base of unknown commit
])
def test_an_overlay_never_sits_on_a_wheel_of_another_commit(tmp_path, wheel_commit, base_commit, refused):
    from kvforge.git.bases import Base
    from kvforge.core.errors import KvforgeError
    from kvforge.project.targets import WheelPin
    from kvforge.core.wheel import read_members

    wheel = _version_wheel(tmp_path / "vllm-0.21.0-1-cp38-abi3-manylinux_2_24_x86_64.whl", wheel_commit)
    base = Base("vllm", "sdist", tmp_path, "v0.21.0", "0" * 40, "vllm-0.21.0.tar.gz", upstream_commit=base_commit)
    pin = WheelPin(wheel.name, "0" * 64)
    if not refused:
        kdownload.check_same_commit(wheel, read_members(wheel), "vllm", base, pin)
        return
    with pytest.raises(KvforgeError) as info:
        kdownload.check_same_commit(wheel, read_members(wheel), "vllm", base, pin)
    assert info.value.exit_code == 2
    assert "built from upstream commit ad7125a43, the base v0.21.0 from 9da56fd18" in str(info.value)
