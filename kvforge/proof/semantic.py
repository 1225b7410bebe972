"""What a change does to one Python file's program, from its text before and after: a list of `Change`s.

The comparison reads both versions with the standard library's `ast`, not libcst: what it compares is
the program (definitions, decorators, signatures, module-level statements), which the abstract tree
gives exactly, while comments and layout (what a concrete tree adds) are the one thing that must *not*
count as a change; `ast` also ships with every interpreter kvforge runs on, parses a file of vLLM's in
milliseconds and parses every grammar the interpreter does. Its cost: the file must parse under the
running interpreter (a file that does not is reported as such, never guessed at).

Invariants: a function of the two texts alone (no git, no file system); definitions are named by
dotted qualified names (`Class.method`, `outer.inner`), the first of several same-named definitions
keeps the plain name and the later ones get `@2`, `@3`; every Change carries the line of the patched
file it is about (of the base file for what the patch removes). Deciding what is risky (which needs
the rest of the tree) is audit.py's.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import asdict, dataclass, field

# Kinds, as the audit lists them and a patch's Acknowledges: trailer names them.
DEF_KINDS = ("added", "removed", "renamed", "moved", "body")
DECORATOR_KINDS = ("decorator-added", "decorator-removed", "decorator-moved")
STATEMENT_KINDS = ("import-added", "import-removed", "import-changed", "assignment-added", "assignment-removed",
                   "assignment-changed", "call-added", "call-removed", "statement-added", "statement-removed")
KINDS = (*DEF_KINDS, *DECORATOR_KINDS, "signature", "bases", *STATEMENT_KINDS)


@dataclass(frozen=True)
class Change:
    """One thing a patch changes in a file's program.

    `name` is what an acknowledgement names: the definition's qualified name (for a rename or a move,
    and for a decorator that moves, the definition it leaves), or a module-level statement's key (an
    import's names, an assignment's targets, a call's callee). `other` is the definition at the other
    end (the new name of a rename or move; where a decorator went)."""

    kind: str
    name: str
    line: int
    detail: str
    other: str = ""
    other_line: int = 0
    public: bool = True
    nested: bool = False  # a definition inside a function: nothing outside it can name it

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Definition:
    qualname: str
    kind: str  # def | class
    node: ast.AST
    line: int  # the `def` / `class` line
    parent: str  # qualified name of the enclosing definition ("" at module level)
    in_function: bool  # nested inside a function (not reachable from outside it)
    decorators: list[tuple[str, int]] = field(default_factory=list)  # (source, line)
    text: str = ""  # the source lines of its body: equal text means an equal body (the fast path)

    @property
    def short(self) -> str:
        return self.qualname.rsplit(".", 1)[-1].split("@", 1)[0]


def public(qualname: str) -> bool:
    """No component is private (`_x`); dunders (`__init__`) are public."""
    return not any(p.startswith("_") and not (p.startswith("__") and p.endswith("__"))
                   for p in qualname.split("@", 1)[0].split("."))


def _sub_bodies(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists of a compound statement that run in the same scope (if, try, with, for, while, match)."""
    out: list[list[ast.stmt]] = []
    for name in ("body", "orelse", "finalbody"):
        part = getattr(stmt, name, None)
        if isinstance(part, list) and part and isinstance(part[0], ast.stmt):
            out.append(part)
    for handler in getattr(stmt, "handlers", []) or []:
        out.append(handler.body)
    for case in getattr(stmt, "cases", []) or []:
        out.append(case.body)
    return out


DEF_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _lines(node: ast.AST, lines: list[str], first: int | None = None) -> str:
    start = first if first is not None else getattr(node, "lineno", 1)
    return "\n".join(lines[start - 1:getattr(node, "end_lineno", None) or start])


def definitions(tree: ast.Module, lines: list[str] | None = None) -> dict[str, Definition]:
    """Every function, method, class and nested definition, by qualified name, in source order."""
    out: dict[str, Definition] = {}
    lines = lines or []

    def walk(body: list[ast.stmt], prefix: str, in_function: bool) -> None:
        for stmt in body:
            if isinstance(stmt, DEF_NODES):
                qual = f"{prefix}.{stmt.name}" if prefix else stmt.name
                k = 2
                base = qual
                while qual in out:
                    qual, k = f"{base}@{k}", k + 1
                out[qual] = Definition(qual, "class" if isinstance(stmt, ast.ClassDef) else "def", stmt,
                                       stmt.lineno, prefix, in_function,
                                       [(ast.unparse(d), d.lineno) for d in stmt.decorator_list],
                                       _lines(stmt, lines, stmt.body[0].lineno))
                walk(stmt.body, qual, in_function or not isinstance(stmt, ast.ClassDef))
            else:
                for sub in _sub_bodies(stmt):
                    walk(sub, prefix, in_function)

    walk(tree.body, "", False)
    return out


def _body_key(d: Definition) -> str:
    """The definition's body (and, for a class, its bases), positions left out: equal for a rename or a move."""
    node = d.node
    assert isinstance(node, DEF_NODES)
    extra = ast.dump(ast.Tuple(elts=list(node.bases), ctx=ast.Load())) if isinstance(node, ast.ClassDef) else ""
    return extra + ast.dump(ast.Module(body=node.body, type_ignores=[]))


def _own_body_key(d: Definition) -> str:
    """A class's own statements (attributes, docstring), its methods left out: they are compared on their own."""
    node = d.node
    assert isinstance(node, ast.ClassDef)
    return ast.dump(ast.Module(body=[s for s in node.body if not isinstance(s, DEF_NODES)], type_ignores=[]))


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, str, str | None]]:
    """(name, kind, default source) per parameter, in order; kind: positional-only, positional, *args,
    keyword-only, **kwargs."""
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out: list[tuple[str, str, str | None]] = []
    for i, p in enumerate(positional):
        d = defaults[i]
        out.append((p.arg, "positional-only" if i < len(a.posonlyargs) else "positional",
                    ast.unparse(d) if d is not None else None))
    if a.vararg:
        out.append((a.vararg.arg, "*args", None))
    for p, kd in zip(a.kwonlyargs, a.kw_defaults):
        out.append((p.arg, "keyword-only", ast.unparse(kd) if kd is not None else None))
    if a.kwarg:
        out.append((a.kwarg.arg, "**kwargs", None))
    return out


def signature_changes(old: ast.FunctionDef | ast.AsyncFunctionDef,
                      new: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """What differs in the signature: parameters added or removed, their kind, defaults, order; the
    return annotation. [] when callers see the same signature."""
    before, after = _params(old), _params(new)
    b, a = {p[0]: p for p in before}, {p[0]: p for p in after}
    out: list[str] = []
    for name, kind, default in after:
        if name not in b:
            out.append(f"parameter `{name}` added ({kind}" + (f", default {default})" if default is not None
                                                               else ", required)"))
    for name, kind, _ in before:
        if name not in a:
            out.append(f"parameter `{name}` removed")
    for name, kind, default in after:
        if name in b:
            _, okind, odefault = b[name]
            if okind != kind:
                out.append(f"`{name}` {okind} -> {kind}")
            if odefault != default:
                out.append(f"default of `{name}`: {odefault if odefault is not None else '(none)'} -> "
                           f"{default if default is not None else '(none)'}")
    common_b = [p[0] for p in before if p[0] in a and p[1] in ("positional", "positional-only")]
    common_a = [p[0] for p in after if p[0] in b and p[1] in ("positional", "positional-only")]
    if common_b != common_a and sorted(common_b) == sorted(common_a):
        out.append(f"positional order {', '.join(common_b)} -> {', '.join(common_a)}")
    ob = ast.unparse(old.returns) if old.returns is not None else None
    nb = ast.unparse(new.returns) if new.returns is not None else None
    if ob != nb:
        out.append(f"return annotation {ob or '(none)'} -> {nb or '(none)'}")
    if isinstance(old, ast.AsyncFunctionDef) != isinstance(new, ast.AsyncFunctionDef):
        out.append("async def -> def" if isinstance(old, ast.AsyncFunctionDef) else "def -> async def")
    return out


# ---------------------------------------------------------------- module-level statements

@dataclass
class Statement:
    kind: str  # import | assignment | call | statement
    key: str  # what an acknowledgement names: imported names, targets, callee
    node: ast.stmt
    source: str  # its source lines: equal source means an equal statement (the fast path)
    line: int
    _dump: str = ""

    @property
    def text(self) -> str:
        """One line of source, for the listing."""
        if self.kind == "statement" and self.key == "docstring":
            value = self.node.value.value if isinstance(self.node, ast.Expr) and \
                isinstance(self.node.value, ast.Constant) else ""
            return _short(repr(value))
        return _short(ast.unparse(self.node))

    @property
    def dump(self) -> str:
        if not self._dump:
            self._dump = ast.dump(self.node)
        return self._dump


def _short(text: str, width: int = 90) -> str:
    one = " ".join(text.split())
    return one if len(one) <= width else one[:width - 3] + "..."


def module_statements(tree: ast.Module, lines: list[str] | None = None) -> list[Statement]:
    """The statements that run at import (definitions aside), those inside module-level if/try/with
    blocks included, in source order."""
    out: list[Statement] = []

    def walk(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, DEF_NODES):
                continue
            subs = _sub_bodies(stmt)
            if subs:
                for sub in subs:
                    walk(sub)
                continue
            out.append(_statement(stmt, _lines(stmt, lines or [])))

    walk(tree.body)
    return out


def _statement(stmt: ast.stmt, source: str) -> Statement:
    def make(kind: str, key: str) -> Statement:
        return Statement(kind, key, stmt, source, stmt.lineno)

    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return make("import", ", ".join(a.asname or a.name for a in stmt.names))
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return make("assignment", ", ".join(ast.unparse(t) for t in targets))
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, (ast.Call, ast.Await)):
        call = stmt.value.value if isinstance(stmt.value, ast.Await) else stmt.value
        return make("call", ast.unparse(call.func) if isinstance(call, ast.Call) else ast.unparse(call))
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
        return make("statement", "docstring")
    return make("statement", type(stmt).__name__.lower())


def _statement_changes(old: list[Statement], new: list[Statement]) -> list[Change]:
    """Statements added and removed (difflib over their source, then their trees: a statement whose
    source differs only in comments or layout, or that only moved, is neither); an import or
    assignment of the same key on both sides is one change of it."""
    sm = difflib.SequenceMatcher(a=[s.source for s in old], b=[s.source for s in new], autojunk=False)
    removed: list[Statement] = []
    added: list[Statement] = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag in ("delete", "replace"):
            removed += old[i1:i2]
        if tag in ("insert", "replace"):
            added += new[j1:j2]
    for s in list(added):  # reordered, not changed
        twin = next((r for r in removed if r.dump == s.dump), None)
        if twin is not None:
            added.remove(s)
            removed.remove(twin)
    out: list[Change] = []
    for s in added:
        twin = next((r for r in removed if r.kind == s.kind and r.key == s.key and s.kind in ("import", "assignment")),
                    None)
        if twin is not None:
            removed.remove(twin)
            out.append(Change(f"{s.kind}-changed", s.key, s.line, f"{twin.text}  ->  {s.text}", public=public(s.key)))
        else:
            out.append(Change(f"{s.kind}-added", s.key, s.line, s.text, public=public(s.key)))
    for s in removed:
        out.append(Change(f"{s.kind}-removed", s.key, s.line, s.text, public=public(s.key)))
    return out


# ---------------------------------------------------------------- the comparison

class Unparsable(Exception):
    """One side does not parse: the message says which and where."""


def parse(text: str | None, side: str) -> ast.Module:
    if text is None:
        return ast.Module(body=[], type_ignores=[])
    try:
        return ast.parse(text)
    except SyntaxError as exc:
        raise Unparsable(f"the {side} file does not parse: {exc.msg} (line {exc.lineno})") from None


def compare(old_text: str | None, new_text: str | None) -> list[Change]:
    """The changes from `old_text` to `new_text` (None: the file does not exist on that side), in the
    order of the patched file's lines. Raises Unparsable when a side is not Python this interpreter reads."""
    old_tree, new_tree = parse(old_text, "base"), parse(new_text, "patched")
    old_lines, new_lines = (old_text or "").split("\n"), (new_text or "").split("\n")
    old_defs, new_defs = definitions(old_tree, old_lines), definitions(new_tree, new_lines)
    changes: list[Change] = []
    gone = [d for q, d in old_defs.items() if q not in new_defs]
    fresh = [d for q, d in new_defs.items() if q not in old_defs]
    # Renames and moves: a definition gone and one new with the same kind and body, one to one.
    pairs: dict[str, Definition] = {}  # old qualname -> new definition
    by_body: dict[tuple[str, str], list[Definition]] = {}
    for d in fresh if gone else []:
        by_body.setdefault((d.kind, _body_key(d)), []).append(d)
    gone_keys = [(d.kind, _body_key(d)) for d in gone] if fresh else []
    for d, key in zip(gone, gone_keys):
        match = by_body.get(key, [])
        if len(match) == 1 and gone_keys.count(key) == 1 and _substantial(d):
            pairs[d.qualname] = match[0]
    paired_new = {d.qualname for d in pairs.values()}
    gone_names = {d.qualname for d in gone}
    for d in gone:
        if d.parent in gone_names:
            continue  # inside a definition removed, renamed or moved: that change says it
        new = pairs.get(d.qualname)
        if new is None:
            changes.append(Change("removed", d.qualname, d.line, f"{d.kind} {d.qualname} removed (base line {d.line})",
                                  public=public(d.qualname), nested=d.in_function))
        elif new.parent == d.parent:
            changes.append(Change("renamed", d.qualname, new.line, f"{d.qualname} renamed to {new.qualname}",
                                  new.qualname, new.line, public(d.qualname), d.in_function))
        else:
            changes.append(Change("moved", d.qualname, new.line, f"{d.qualname} moved to {new.qualname}",
                                  new.qualname, new.line, public(d.qualname), d.in_function))
    fresh_names = {d.qualname for d in fresh}
    for d in fresh:
        if d.qualname in paired_new or d.parent in fresh_names:
            continue  # a rename's far end, or inside a new (or renamed) definition
        changes.append(Change("added", d.qualname, d.line, f"{d.kind} {d.qualname} added", public=public(d.qualname)))
    # Definitions on both sides (and the two ends of a rename or move): decorators, signature, bases, body.
    both = [(old_defs[q], new_defs[q]) for q in old_defs if q in new_defs]
    both += [(old_defs[q], n) for q, n in pairs.items()]
    lost: list[tuple[str, Definition, int]] = []  # (decorator, from definition, its base line)
    gained: list[tuple[str, Definition, int]] = []
    for o, n in both:
        od, nd = [s for s, _ in o.decorators], [s for s, _ in n.decorators]
        for src, line in o.decorators:
            if od.count(src) > nd.count(src):
                lost.append((src, o, line))
        for src, line in n.decorators:
            if nd.count(src) > od.count(src):
                gained.append((src, n, line))
        on, nn = o.node, n.node
        if o.text == n.text and o.qualname == n.qualname and _head(o) == _head(n):
            continue  # the same source: nothing in it changed
        if isinstance(on, (ast.FunctionDef, ast.AsyncFunctionDef)) and isinstance(nn, (ast.FunctionDef,
                                                                                       ast.AsyncFunctionDef)):
            sig = signature_changes(on, nn)
            if sig:
                changes.append(Change("signature", o.qualname, n.line, f"signature of {o.qualname}: " + "; ".join(sig),
                                      public=public(o.qualname), nested=o.in_function))
            if o.qualname == n.qualname and ast.dump(ast.Module(body=on.body, type_ignores=[])) != \
                    ast.dump(ast.Module(body=nn.body, type_ignores=[])):
                changes.append(Change("body", o.qualname, n.line, "body changed", public=public(o.qualname)))
        elif isinstance(on, ast.ClassDef) and isinstance(nn, ast.ClassDef):
            ob, nb = [ast.unparse(b) for b in on.bases + on.keywords], [ast.unparse(b) for b in nn.bases + nn.keywords]
            if ob != nb:
                changes.append(Change("bases", o.qualname, n.line, f"({', '.join(ob)}) -> ({', '.join(nb)})",
                                      public=public(o.qualname)))
            if o.qualname == n.qualname and _own_body_key(o) != _own_body_key(n):
                changes.append(Change("body", o.qualname, n.line, "class attributes changed",
                                      public=public(o.qualname)))
        elif o.kind != n.kind:
            changes.append(Change("body", o.qualname, n.line, f"{o.kind} -> {n.kind}", public=public(o.qualname)))
    # New definitions' own decorators count as gained: a decorator that left one definition for a new one moved.
    for d in fresh:
        if d.qualname not in paired_new:
            gained += [(src, d, line) for src, line in d.decorators]
    for src, o, oline in lost:
        to = next((g for g in gained if g[0] == src), None)
        if to is not None:
            gained.remove(to)
            changes.append(Change("decorator-moved", o.qualname, to[2],
                                  f"@{src} moved from {o.qualname} (base line {oline}) to {to[1].qualname}",
                                  to[1].qualname, to[2], public(o.qualname)))
        else:
            line = new_defs[o.qualname].line if o.qualname in new_defs else pairs[o.qualname].line
            changes.append(Change("decorator-removed", o.qualname, line, f"@{src} removed from {o.qualname}",
                                  public=public(o.qualname)))
    fresh_unpaired = {d.qualname for d in fresh} - paired_new
    for src, d, line in gained:
        if d.qualname not in fresh_unpaired:  # a new definition's decorators are part of it
            changes.append(Change("decorator-added", d.qualname, line, f"@{src} added to {d.qualname}",
                                  public=public(d.qualname)))
    changes += _statement_changes(module_statements(old_tree, old_lines), module_statements(new_tree, new_lines))
    return sorted(changes, key=lambda c: (c.line, KINDS.index(c.kind) if c.kind in KINDS else 99))


def _head(d: Definition) -> str:
    """A definition's own line(s) before its body: name, parameters, bases, return annotation."""
    node = d.node
    assert isinstance(node, DEF_NODES)
    if isinstance(node, ast.ClassDef):
        return ast.dump(ast.Tuple(elts=[*node.bases, *[k.value for k in node.keywords]], ctx=ast.Load())) + \
            ",".join(k.arg or "" for k in node.keywords)
    return ast.dump(node.args) + (ast.dump(node.returns) if node.returns else "") + type(node).__name__


def _substantial(d: Definition) -> bool:
    """A body worth pairing on: more than a `pass`, `...` or a docstring alone."""
    node = d.node
    assert isinstance(node, DEF_NODES)
    body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return bool(body) and not all(isinstance(s, ast.Pass) for s in body)
