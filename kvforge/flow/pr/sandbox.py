"""The one jinja2 environment every kvforge text is rendered in, its limits and its filters.

Invariants: templates render in a SandboxedEnvironment with StrictUndefined; the loader sees only
kvforge's templates (kvforge/data/templates) and the user's one --template file; `*`, `**` and the
rendered size are bounded (MAX_VALUE, MAX_OUTPUT). Any template problem is one KvforgeError line
`template FILE:LINE: message` (EXIT_USAGE) and nothing of a failed render is returned. This module
renders; what data a template gets is kvforge.flow.pr.text's.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Generator
from pathlib import Path
from typing import cast

from jinja2 import (BaseLoader, ChoiceLoader, FileSystemLoader, StrictUndefined, TemplateError, TemplateNotFound,
                    TemplateSyntaxError)
from jinja2.sandbox import SandboxedEnvironment, SecurityError

from kvforge import DATA
from kvforge.core.errors import EXIT_USAGE, KvforgeError

TEMPLATES = DATA / "templates"

# What a template may produce and build (the sandbox's limits): a PR body is a few KB; these stop a
# template that would exhaust memory or loop on output before it does.
MAX_OUTPUT = 1 << 20  # characters of rendered text
MAX_VALUE = 1 << 20  # items or characters of one value a `*` builds; digits of a `**` result


class LimitedSandbox(SandboxedEnvironment):
    """jinja2's sandbox with `*` and `**` checked before they run: `'x' * 10**10` and `10**10**10`
    fail as template errors instead of allocating gigabytes or spinning."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and not isinstance(times, bool):
                    if len(seq) * max(times, 0) > MAX_VALUE:
                        raise SecurityError(f"the result of * would have {len(seq) * times} items "
                                            f"(the sandbox allows {MAX_VALUE})")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            digits = right * math.log10(max(abs(left), 2))
            if digits > MAX_VALUE:
                raise SecurityError(f"the result of ** would have about {digits:.3g} digits "
                                    f"(the sandbox allows {MAX_VALUE})")
        return super().call_binop(context, operator, left, right)


def _env(user_template: Path | None = None) -> LimitedSandbox:
    """The one jinja2 environment: sandboxed (with size limits), StrictUndefined, loads only
    kvforge's templates (and the user's one file)."""

    class OneFile(BaseLoader):
        def __init__(self, path: Path, text: str):
            self.path, self.text = path, text

        def get_source(self, environment, template):
            if template != str(self.path):
                raise TemplateNotFound(template)
            return self.text, str(self.path), lambda: True

    loaders: list[BaseLoader] = [FileSystemLoader(str(TEMPLATES))]
    if user_template is not None:
        try:
            text = Path(user_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise KvforgeError(f"--template {user_template}: cannot read: {why}", EXIT_USAGE) from None
        loaders.insert(0, OneFile(Path(user_template), text))
    env = LimitedSandbox(loader=ChoiceLoader(loaders), undefined=StrictUndefined, autoescape=False,
                         trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(pct=pct, short=lambda c: (c or "")[:12], cell=md_cell, first_line=first_line)
    return env


def render_template(name: str, data: dict, user_template: Path | None = None) -> tuple[str, str | None]:
    """Render a template with `data`: (text, the title it sets with `{% set title = ... %}`, if any).

    Any template problem, at parse time or while rendering (an undefined name, `1/0`, `1+'a'`, a
    recursive macro, a value or an output over the sandbox's limits), is one line
    `template FILE:LINE: message` (EXIT_USAGE); nothing of a failed render is returned."""

    env = _env(user_template)
    label = str(user_template) if user_template is not None else name
    try:
        tmpl = env.get_template(str(user_template) if user_template is not None else name)
        context = tmpl.new_context(data)
        chunks: list[str] = []
        size = 0
        chunks_of = cast(Generator[str, None, None], tmpl.root_render_func(context))  # a generator function
        try:
            for chunk in chunks_of:
                size += len(chunk)
                if size > MAX_OUTPUT:  # thrown in at the template's own line, so the error names it
                    chunks_of.throw(SecurityError(f"the rendered text is over {MAX_OUTPUT} characters "
                                                  "(the sandbox's limit)"))
                chunks.append(chunk)
        except Exception:
            env.handle_exception()  # re-raises with the traceback mapped to template lines
        text = "".join(chunks)
        title = context.get_exported().get("title")
    except TemplateSyntaxError as exc:
        where = f"{exc.filename or exc.name or label}:{exc.lineno}"
        raise KvforgeError(f"template {where}: {exc.message}", EXIT_USAGE) from None
    except TemplateNotFound as exc:
        raise KvforgeError(f"template {_where(exc, label)}: no template {exc.name!r} (a template can include or "
                           "import only kvforge's own templates)", EXIT_USAGE) from None
    except TemplateError as exc:
        what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise KvforgeError(f"template {_where(exc, label)}: {what}", EXIT_USAGE) from None
    except RecursionError as exc:
        raise KvforgeError(f"template {_where(exc, label)}: recursion too deep (a macro or include that calls "
                           "itself without end)", EXIT_USAGE) from None
    except (ArithmeticError, TypeError, ValueError, LookupError, AttributeError, MemoryError) as exc:
        # A Python error raised by an expression of the template (1/0, 1 + 'a', int('x'), ...).
        what = str(exc).splitlines()[0] if str(exc) else ""
        raise KvforgeError(f"template {_where(exc, label)}: {type(exc).__name__}"
                           + (f": {what}" if what else ""), EXIT_USAGE) from None
    return text, (str(title) if title is not None else None)


def _where(exc: BaseException, label: str) -> str:
    """file:line of the innermost template frame of a rendering error (jinja2 maps frames to templates)."""
    templates = str(TEMPLATES)
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename == label or frame.filename.startswith(templates) or frame.filename.endswith(".j2"):
            return f"{frame.filename}:{frame.lineno}"
    return label


def pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x * 100:.{digits}f}%"


def md_cell(text: object) -> str:
    """Text fit for one markdown table cell: one line, pipes escaped."""
    return " ".join(str(text or "").split()).replace("|", "\\|")


def first_line(text: object, limit: int = 120) -> str:
    line = next((ln.strip() for ln in str(text or "").splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."
