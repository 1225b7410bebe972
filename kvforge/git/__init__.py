"""Git plumbing: the one git runner, patch bytes both ways (git am, format-patch), temporary indexes,
bases (a release as a commit in the cache), the Context a command builds, and stacks (a series
applied in the cache, one state per patch).
"""
