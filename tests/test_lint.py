"""`kvforge lint` and the patch parser: every defect is named with file and line."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from kvforge.cli import main
from kvforge.project.series import parse_patch, read_series

GOOD_DIFF = """\
---
 a.txt | 2 +-
 1 file changed, 1 insertion(+), 1 deletion(-)

diff --git a/a.txt b/a.txt
index 0000000000000000000000000000000000000001..0000000000000000000000000000000000000002 100644
--- a/a.txt
+++ b/a.txt
@@ -1,3 +1,3 @@
 one
-two
+TWO
 three
"""


def patch_text(trailer_block: str, diff: str = GOOD_DIFF, subject: str = "[Core] do a thing") -> str:
    return (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: kvforge <kvforge@users.noreply.github.com>\n"
        "Date: Sun, 22 Nov 2026 12:00:00 +0000\n"
        f"Subject: [PATCH] {subject}\n\nBody paragraph.\n\n{trailer_block}{diff}"
    )


GOOD_TRAILERS = (
    "Fix-Id: good-fix\n"
    "Kind: fix\n"
    "Upstream-Status: Backport [https://github.com/vllm-project/vllm/pull/1]\n"
    "Upstream-PR: https://github.com/vllm-project/vllm/pull/1\n"
    "Upstream-Commit: 588db1836\n"
    "Why: because\n continued.\n"
    "Drop-When: base-contains 588db1836\n"
    "Checks: tests/v1/core/test_x.py::test_y\n"
    "Signed-off-by: kvforge <kvforge@users.noreply.github.com>\n"
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def messages(patch) -> list[str]:
    return [str(p) for p in patch.problems]


def test_good_patch_parses_with_all_fields(tmp_path):
    p = parse_patch(write(tmp_path, "0001-good.patch", patch_text(GOOD_TRAILERS)))
    assert p.problems == []
    assert p.fix_id == "good-fix"
    assert p.subject == "[Core] do a thing"
    assert p.value("Why") == "because continued."
    assert p.checks == ["tests/v1/core/test_x.py::test_y"]
    assert p.touched_paths == ["a.txt"]
    assert p.hunk_at("a.txt", 1) == 1


def test_malformed_header_is_named_with_line(tmp_path):
    bad = GOOD_TRAILERS.replace("Upstream-Status: Backport [https://github.com/vllm-project/vllm/pull/1]",
                                "Upstream-Status: Backport").replace("Kind: fix", "Kind: hotfix")
    path = write(tmp_path, "0001-bad.patch", patch_text(bad))
    msgs = messages(parse_patch(path))
    assert any(m.startswith(f"{path}:10: Upstream-Status Backport needs [the upstream PR or commit]") for m in msgs), msgs
    assert any(f"{path}:9: Kind 'hotfix'" in m for m in msgs), msgs


def test_missing_required_and_bad_values(tmp_path):
    block = ("Fix-Id: Not_A_Slug\nKind: fix\nUpstream-Status: Maybe\nUpstream-Commit: xyz\n"
             "Drop-When: someday\nSigned-off-by: nobody\n")
    msgs = "\n".join(messages(parse_patch(write(tmp_path, "0001-x.patch", patch_text(block)))))
    for expected in ("missing required header 'Why:'", "Fix-Id 'Not_A_Slug'", "Upstream-Status 'Maybe'",
                     "Upstream-Commit 'xyz'", "Drop-When 'someday'", "Signed-off-by 'nobody'",
                     "Kind fix needs at least one 'Checks:'"):
        assert expected in msgs


def test_path_traversal_and_absolute_paths_are_refused(tmp_path):
    evil = GOOD_DIFF.replace("a/a.txt b/a.txt", "a/../../etc/passwd b/../../etc/passwd") \
                    .replace("--- a/a.txt", "--- a/../../etc/passwd").replace("+++ b/a.txt", "+++ b/../../etc/passwd")
    msgs = messages(parse_patch(write(tmp_path, "0001-evil.patch", patch_text(GOOD_TRAILERS, evil))))
    assert any("escapes the tree" in m and "etc/passwd" in m for m in msgs), msgs
    absolute = GOOD_DIFF.replace("+++ b/a.txt", "+++ /tmp/a.txt")
    msgs = messages(parse_patch(write(tmp_path, "0002-abs.patch", patch_text(GOOD_TRAILERS, absolute))))
    assert any("'/tmp/a.txt' escapes the tree" in m for m in msgs), msgs


def test_symlink_creation_is_refused(tmp_path):
    link = ("---\n\ndiff --git a/l b/l\nnew file mode 120000\nindex 0000000..1111111\n--- /dev/null\n+++ b/l\n"
            "@@ -0,0 +1 @@\n+/etc\n\\ No newline at end of file\n")
    msgs = messages(parse_patch(write(tmp_path, "0001-link.patch", patch_text(GOOD_TRAILERS, link))))
    assert any("symbolic link" in m for m in msgs), msgs


def test_unparseable_diff_is_reported(tmp_path):
    broken = GOOD_DIFF.replace("@@ -1,3 +1,3 @@", "@@ -1,3 +1,9 @@")
    msgs = messages(parse_patch(write(tmp_path, "0001-broken.patch", patch_text(GOOD_TRAILERS, broken))))
    assert any("diff does not parse" in m for m in msgs), msgs


def test_series_file_problems(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    write(d, "0001-a.patch", patch_text(GOOD_TRAILERS))
    write(d, "0002-b.patch", patch_text(GOOD_TRAILERS + "Depends-On: later-fix\n"))  # same Fix-Id, bad dep
    write(d, "0003-unlisted.patch", patch_text(GOOD_TRAILERS))
    (d / "series").write_text("0001-a.patch\n# comment\n0002-b.patch\n0001-a.patch\nmissing.patch\n")
    s = read_series(d)
    msgs = "\n".join(str(p) for p in s.all_problems())
    assert "series:4: 0001-a.patch is listed twice (first on line 1)" in msgs
    assert "series:5: missing.patch does not exist" in msgs
    assert "0003-unlisted.patch: patch file is not listed" in msgs
    assert "Fix-Id 'good-fix' already used by 0001-a.patch" in msgs
    assert "Depends-On 'later-fix' is not an earlier patch" in msgs


def test_lint_cli_exit_codes(project):
    runner = CliRunner()
    res = runner.invoke(main, ["lint"])
    assert res.exit_code == 0, res.output
    write(project / "patches" / "t", "0001-bad.patch", patch_text(GOOD_TRAILERS.replace("Fix-Id: good-fix\n", "")))
    (project / "patches" / "t" / "series").write_text("0001-bad.patch\n")
    res = runner.invoke(main, ["lint", "--json"])
    assert res.exit_code == 1
    assert "missing required header 'Fix-Id:'" in res.output


def test_the_project_series_lint_clean():
    """The series we ship must lint clean (CI would fail the same way)."""
    from kvforge.project.targets import load_all, project_root

    for t in load_all(project_root()):
        for c in t.components:
            problems = read_series(c.series_dir).all_problems()
            assert problems == [], "\n".join(map(str, problems))


def test_crlf_patch_is_one_clear_problem(tmp_path):
    path = tmp_path / "0001-crlf.patch"
    path.write_bytes(patch_text(GOOD_TRAILERS).replace("\n", "\r\n").encode())
    msgs = messages(parse_patch(path))
    assert len(msgs) == 1, msgs
    assert "CRLF line endings (git format-patch writes LF)" in msgs[0]
    assert f"sed -i 's/\\r$//' {path}" in msgs[0]


def test_crlf_inside_diff_content_is_not_flagged(tmp_path):
    """A tree file with CRLF endings gives diff lines ending in CR: that is content, not a converted patch."""
    diff = GOOD_DIFF.replace(" one\n-two\n+TWO\n three\n", " one\r\n-two\r\n+TWO\r\n three\r\n")
    p = parse_patch(write(tmp_path, "0001-content.patch", patch_text(GOOD_TRAILERS, diff)))
    assert not any("CRLF" in m for m in messages(p)), messages(p)


def test_crlf_series_through_the_cli_is_one_line_per_patch(project):
    d = project / "patches" / "t"
    (d / "0001-crlf.patch").write_bytes(patch_text(GOOD_TRAILERS).replace("\n", "\r\n").encode())
    (d / "series").write_bytes(b"0001-crlf.patch\r\n")
    res = CliRunner().invoke(main, ["lint"])
    assert res.exit_code == 1
    lines = [ln for ln in res.output.splitlines() if ln.strip() and "patches in" not in ln]
    assert len(lines) == 1 and "CRLF" in lines[0], res.output


def test_bom_at_the_start_of_series_is_tolerated(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    write(d, "0001-a.patch", patch_text(GOOD_TRAILERS))
    (d / "series").write_bytes(b"\xef\xbb\xbf0001-a.patch\n")
    s = read_series(d)
    assert s.all_problems() == []
    assert [p.name for p in s.patches] == ["0001-a.patch"]


def test_bom_at_the_start_of_a_patch_is_named(tmp_path):
    path = tmp_path / "0001-bom.patch"
    path.write_bytes(b"\xef\xbb\xbf" + patch_text(GOOD_TRAILERS).encode())
    msgs = messages(parse_patch(path))
    assert len(msgs) == 1 and "byte-order mark" in msgs[0], msgs


def test_series_that_is_not_utf8_is_a_problem_not_a_crash(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    (d / "series").write_bytes(b"0001-\xff.patch\n")
    msgs = [str(p) for p in read_series(d).all_problems()]
    assert len(msgs) == 1 and "series" in msgs[0] and "not UTF-8" in msgs[0], msgs


def test_unreadable_patch_is_a_problem_not_a_crash(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    (d / "0001-a.patch").mkdir()  # a directory where a patch should be
    (d / "series").write_text("0001-a.patch\n")
    msgs = [str(p) for p in read_series(d).all_problems()]
    assert len(msgs) == 1 and "0001-a.patch" in msgs[0], msgs


def test_author_without_a_sign_off_of_their_own_is_a_problem(tmp_path, fake):
    """DCO: the From: author signs off (a carrier's sign-off is added to theirs, never instead)."""
    text = patch_text(GOOD_TRAILERS).replace("From: kvforge <kvforge@users.noreply.github.com>", "From: k <k@x>")
    path = write(tmp_path, "0001-k.patch", text)
    assert any(":17: the author 'k <k@x>' has no Signed-off-by of their own" in m
               for m in messages(parse_patch(path))), messages(parse_patch(path))
    both = text.replace("Signed-off-by: kvforge", "Signed-off-by: k <K@X>\nSigned-off-by: kvforge")
    assert messages(parse_patch(write(tmp_path, "0002-k.patch", both))) == []
    # Through the CLI: exit 1, naming the patch and line.
    series_dir = fake.root / "patches" / "fake"
    (series_dir / "0001-k.patch").write_text(text)
    (series_dir / "series").write_text("0001-k.patch\n")
    res = CliRunner().invoke(main, ["lint"])
    assert res.exit_code == 1 and "0001-k.patch:17: the author 'k <k@x>'" in res.output


# ---------------------------------------------------------------- Acknowledges: (the audit's risky changes a patch means)

def test_acknowledges_trailers_parse_with_kind_name_file_and_reason(tmp_path):
    block = GOOD_TRAILERS.replace(
        "Signed-off-by:",
        "Acknowledges: signature BlockPool.cache_full_blocks: block_mask is optional, every caller keeps working\n"
        "Acknowledges: decorator-moved vllm/v1/worker/gpu_model_runner.py::GPUModelRunner.execute_model\n"
        "Acknowledges: call-added logger.debug: a log line at import\n"
        " that wraps onto a continuation line\n"
        "Signed-off-by:")
    patch = parse_patch(write(tmp_path, "0001-x.patch", patch_text(block)))
    assert messages(patch) == []
    acks = patch.acknowledgements
    assert [(a.kind, a.path, a.name) for a in acks] == [
        ("signature", "", "BlockPool.cache_full_blocks"),
        ("decorator-moved", "vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner.execute_model"),
        ("call-added", "", "logger.debug")]
    assert acks[0].reason == "block_mask is optional, every caller keeps working"
    assert acks[2].reason == "a log line at import that wraps onto a continuation line"
    assert acks[1].reason == "" and acks[0].line == 17
    assert acks[1].matches("decorator-moved", ("GPUModelRunner.execute_model",), "vllm/v1/worker/gpu_model_runner.py")
    assert not acks[1].matches("decorator-moved", ("GPUModelRunner.execute_model",), "vllm/other.py")
    assert acks[0].matches("signature", ("BlockPool.cache_full_blocks",), "vllm/v1/core/block_pool.py")


def test_acknowledges_lint_names_a_bad_kind_a_bad_shape_and_a_duplicate(tmp_path):
    block = GOOD_TRAILERS.replace(
        "Signed-off-by:",
        "Acknowledges: added Foo.bar: new methods are never flagged\n"
        "Acknowledges: signature\n"
        "Acknowledges: removed old_helper: callers moved to new_helper\n"
        "Acknowledges: removed old_helper: again\n"
        "Signed-off-by:")
    patch = parse_patch(write(tmp_path, "0001-x.patch", patch_text(block)))
    got = messages(patch)
    assert len(got) == 3, got
    assert "0001-x.patch:17: Acknowledges 'added Foo.bar: new methods are never flagged': 'added' is not a kind to " \
           "acknowledge (decorator-moved, decorator-removed, removed, renamed, signature, call-added)" in got[0]
    assert "0001-x.patch:18: Acknowledges 'signature' must be '<kind> [<file>::]<qualified name>[: <reason>]'" in got[1]
    assert "0001-x.patch:20: Acknowledges removed old_helper given twice (first on line 19)" in got[2]
    assert [str(a) for a in patch.acknowledgements] == ["removed old_helper: callers moved to new_helper",
                                                        "removed old_helper: again"]


def test_bug_checks_name_the_checks_that_show_the_bug(tmp_path):
    """Bug-Checks picks some of the patch's Checks (default: every Check); one that is not a Check is named."""
    two = GOOD_TRAILERS.replace("Checks: tests/v1/core/test_x.py::test_y\n",
                                "Checks: tests/v1/core/test_x.py::test_y\nChecks: tests/v1/core/test_x.py::test_knob\n")
    p = parse_patch(write(tmp_path, "0001-two.patch", patch_text(two)))
    assert p.problems == [] and p.bug_checks == p.checks and len(p.checks) == 2
    one = two.replace("Signed-off-by:", "Bug-Checks: tests/v1/core/test_x.py::test_y\nSigned-off-by:")
    p = parse_patch(write(tmp_path, "0002-one.patch", patch_text(one)))
    assert p.problems == [] and p.bug_checks == ["tests/v1/core/test_x.py::test_y"]
    stray = two.replace("Signed-off-by:", "Bug-Checks: tests/v1/core/test_x.py::test_z\nSigned-off-by:")
    path = write(tmp_path, "0003-stray.patch", patch_text(stray))
    msgs = messages(parse_patch(path))
    assert any(m.startswith(f"{path}:") and "Bug-Checks 'tests/v1/core/test_x.py::test_z' is not one of the "
               "patch's 'Checks:'" in m for m in msgs), msgs
