"""One context per command: the target and component it works on, the cache, how the base is found,
where the series comes from (the series files, or a user's commits with --from) and how progress
is reported. The CLI builds it once; library functions take it instead of loose parameters.

Invariants: `component` is one of `target.components`; `base()` materialises the base at most
once per context; nothing here writes anything but the cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvforge.git.bases import Base, ensure_base
from kvforge.core.cache import Cache
from kvforge.project.series import Series, load_clean_series
from kvforge.project.targets import Component, Target, load_target

Progress = Callable[[str], None]


def quiet(_msg: str) -> None:
    pass


def branch_name(target: Target, component: Component) -> str:
    """The branch `apply` creates and `export` reads: kvforge/<target> for the target's first
    component (vLLM), kvforge/<target>-<component> for the others (v0.20.2rc's vllm-ascend)."""
    if component.name == target.components[0].name:
        return f"kvforge/{target.name}"
    return f"kvforge/{target.name}-{component.name}"


def base_tag_name(target: Target, component: Component) -> str:
    """The tag `apply` puts on the base in a user's tree, named like the branch."""
    return "kvforge/base/" + branch_name(target, component).removeprefix("kvforge/")


@dataclass
class Context:
    cache: Cache
    target: Target
    component: Component
    source: str = "auto"  # base source policy: auto | git | sdist
    repo_url: str | None = None  # --repo: a git remote or clone for the base
    progress: Progress = quiet
    from_rev: str | None = None  # --from: the commits base..REV are the series (see trees.resolve_from)
    python: Path | None = None  # --python / $KVFORGE_PYTHON: run tests with this interpreter
    torch_index: str | None = None  # --torch-index / $KVFORGE_TORCH_INDEX
    _base: Base | None = field(default=None, repr=False)

    @classmethod
    def load(cls, cache: Cache, target_name: str, component: str | None = None, **kw) -> "Context":
        target = load_target(target_name)
        python = kw.pop("python", None) or os.environ.get("KVFORGE_PYTHON") or None
        torch_index = kw.pop("torch_index", None) or os.environ.get("KVFORGE_TORCH_INDEX") or None
        return cls(cache, target, target.component(component), python=Path(python) if python else None,
                   torch_index=torch_index, **{k: v for k, v in kw.items() if v is not None})

    def for_component(self, name: str) -> "Context":
        """The same command's context for another component of the target: same cache, base source
        policy, interpreter and progress; --repo and --from stay with the component they were given for."""
        return Context(self.cache, self.target, self.target.component(name), source=self.source,
                       progress=self.progress, python=self.python, torch_index=self.torch_index)

    def say(self, msg: str) -> None:
        self.progress(msg)

    @property
    def branch(self) -> str:
        return branch_name(self.target, self.component)

    @property
    def label(self) -> str:
        """target/component, as reports name it."""
        return f"{self.target.name}/{self.component.name}"

    def base(self) -> Base:
        """The component's base (kvforge.git.bases.Base), materialised into the cache on first use."""
        if self._base is None:
            self._base = ensure_base(self.component, self.cache, self.source, self.repo_url, self.progress)
        return self._base

    def series(self) -> Series:
        """The component's series files, parsed; any lint problem is an error (kvforge.project.series.Series)."""
        return load_clean_series(self.component)
