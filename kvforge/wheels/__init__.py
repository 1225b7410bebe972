"""Patched release wheels: the release wheel's members copied raw, the series' files overlaid, RECORD
rewritten, identity recorded, verified by installing it.

Modules, from the top layer down: build (`kvforge build`: build_command, the CLI's one call, and
build_target, one wheel), device (--device: the package's own build of the patched tree), prepare (an
overlay up to its verification) and verify (install and check a wheel), then changes (what the series
changes, the refusals), choose (which release wheels; light, for rebase, target add and watch), download
(the release wheel in the cache, its sha256 and commit), overlay (the writer, names, version, identity)
and stage (--out's stage, placing a verified wheel, the build directory), and result (BuildResult and its
text) at the bottom.
"""
