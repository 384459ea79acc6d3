"""Text programs (.stm): parsed with lark (stm.lark), compiled to the same IR as Python programs.

    {system}You are terse.{/system}
    {user}
    Question: {question}
    {/user}
    {assistant}{gen answer max_tokens=32 stop="\\n"}{/assistant}
    Is it right? {select verdict choices=["yes", "no"]}

- `{name}` appends a variable: a program argument, or a variable generated earlier.
- `{gen name option=value ...}`: options are SamplingParams fields; `max_tokens` is accepted for
  max_new_tokens. The name may be left out (`{gen max_tokens=8}`) to generate without storing.
- `{select name choices=[...] method="..."}`: see scoring.py for the methods.
- `{system}`, `{user}`, `{assistant}` open a turn and `{/system}` ... close it; these three names
  cannot be variables. One newline is dropped right after an opening or closing role tag and right
  before a closing one, so tags can stand on lines of their own.
- `{{` and `}}` are literal braces. Values are "strings" or 'strings', numbers, true/false/none,
  and [lists]. Backslash escapes (`\\n`, `\\t`, `\\\\`, ...) are read in text and strings alike, by
  the one rule of lang/escapes.py; a backslash before any other character stays as written.

`compile_text(source)` returns a TextFunction, run like any @stemma.function program, with the
variables as keyword arguments. Every error names the line and column.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypeAlias

from stemma.lang.errors import StmSyntaxError, UnknownVariable
from stemma.lang.escapes import unescape
from stemma.lang.function import RESERVED, Function
from stemma.lang.ir import ROLES, Gen, Node, RoleBegin, RoleEnd, Select, Text, VarRef, Where
from stemma.lang.options import RUN_KEYWORDS
from stemma.lang.primitives import gen, select
from stemma.lang.tracer import Placeholder

if TYPE_CHECKING:
    from lark import Tree

OptionValue: TypeAlias = "str | int | float | bool | list[OptionValue] | None"  # a literal in a hole

KEYWORDS = ("gen", "select", *ROLES)


@lru_cache(maxsize=1)
def _parser():
    from lark import Lark
    grammar = (Path(__file__).parent / "stm.lark").read_text()
    return Lark(grammar, parser="lalr", lexer="contextual", propagate_positions=True,
                maybe_placeholders=False)


# ---- parsing ----
def _context(source: str, line: int, column: int) -> str:
    lines = source.splitlines() or [""]
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    return f"    {text}\n    {' ' * (column - 1)}^"


def _open_hole(source: str, end: int) -> int | None:
    """Where the hole still open at offset `end` starts (its '{'), or None: the scan the lexer
    makes, skipping `{{`, `}}` and quoted strings inside holes."""
    i, start, quote = 0, None, None
    while i < end:
        char = source[i]
        if start is None:
            if source.startswith(("{{", "}}"), i):
                i += 2
                continue
            if char == "{":
                start = i
        elif quote is not None:
            if char == "\\":
                i += 1
            elif char == quote or char == "\n":
                quote = None
        elif char in "\"'":
            quote = char
        elif char == "}":
            start = None
        i += 1
    return start


def _where(source: str, offset: int, name: str) -> Where:
    line = source.count("\n", 0, offset) + 1
    return Where(line, offset - (source.rfind("\n", 0, offset) + 1) + 1, name)


def _syntax_error(exc: Exception, source: str, name: str) -> StmSyntaxError:
    from lark.exceptions import UnexpectedCharacters, UnexpectedToken
    if isinstance(exc, UnexpectedCharacters):
        char = source[exc.pos_in_stream] if exc.pos_in_stream < len(source) else ""
        hint = " (write }} for a literal brace)" if char == "}" else ""
        opened = _open_hole(source, exc.pos_in_stream) if char == "{" else None
        if opened is not None:
            hint = (f" inside the hole opened at {_where(source, opened, name)}, which is never "
                    f"closed (write {{{{ for a literal brace)")
        where = Where(exc.line, exc.column, name)
        return StmSyntaxError(f"unexpected character {char!r}{hint}", where,
                              _context(source, exc.line, exc.column))
    if isinstance(exc, UnexpectedToken) and exc.token.type != "$END":
        where = Where(exc.line, exc.column, name)
        value = exc.token.value.strip() or exc.token.value
        if "TEXT" in exc.expected:  # between holes: only a stray closing brace gets here
            message = f"unexpected {value!r} (write }}}} for a literal brace)"
        else:
            message = f"unexpected {value!r} in a hole"
            opened = _open_hole(source, exc.token.start_pos) if value.startswith("{") else None
            if opened is not None:
                message += (f" (the hole opened at {_where(source, opened, name)} is never closed; "
                            f"write {{{{ for a literal brace)")
        return StmSyntaxError(message, where, _context(source, exc.line, exc.column))
    opened = _open_hole(source, len(source))
    if opened is None:  # the lexer saw a hole the scan did not: say where the text ends
        lines = source.splitlines() or [""]
        return StmSyntaxError("the program ends inside a hole: a '{' is never closed "
                              "(write {{ for a literal brace)", Where(len(lines), len(lines[-1]) + 1, name))
    where = _where(source, opened, name)
    return StmSyntaxError("this '{' is never closed: the program ends inside its hole "
                          "(write {{ for a literal brace)", where,
                          _context(source, where.line, where.column))


def parse(source: str, name: str = "<text>"):
    from lark.exceptions import UnexpectedInput
    try:
        return _parser().parse(source)
    except UnexpectedInput as exc:
        raise _syntax_error(exc, source, name) from None


# ---- values ----
def _value(tree: Tree) -> OptionValue:
    kind = tree.data
    if kind == "list":
        return [_value(child) for child in tree.children]
    token = tree.children[0]
    if kind == "string":
        return unescape(token.value[1:-1])
    if kind == "number":
        text = token.value
        return float(text) if any(c in text for c in ".eE") else int(text)
    return {"true": True, "false": False}.get(token.value.lower())


# ---- compiling ----
@dataclass(frozen=True)
class _Hole:
    head: str
    flags: tuple[str, ...]
    options: Mapping[str, OptionValue]
    where: Where


def _hole(tree: Tree, name: str) -> _Hole:
    head_tree, *args = tree.children
    flags, options = [], {}
    where = Where(tree.meta.line, tree.meta.column, name)
    for arg in args:
        key = arg.children[0].value
        if arg.data == "flag":
            flags.append(key)
            continue
        if key in options:
            raise StmSyntaxError(f"option {key!r} is given twice", where)
        options[key] = _value(arg.children[1])
    return _Hole(head_tree.children[0].value, tuple(flags), options, where)


def _compile_hole(hole: _Hole) -> Node:
    head, where = hole.head, hole.where
    if head.startswith("/"):
        role = head[1:]
        if role not in ROLES:
            raise StmSyntaxError(f"{{{head}}} closes no block: blocks are {', '.join(ROLES)}", where)
        _no_args(hole, head)
        return RoleEnd(role)
    if head in ROLES:
        _no_args(hole, head)
        return RoleBegin(head)
    if head in ("gen", "select"):
        if len(hole.flags) > 1:
            raise StmSyntaxError(f"{head} takes one variable name, got {', '.join(hole.flags)}", where)
        var = hole.flags[0] if hole.flags else None
        if var in KEYWORDS:  # {user} opens a block: the variable could never be read back
            raise StmSyntaxError(f"{head}: {var!r} is a keyword ({{{var}}} "
                                 f"{'opens a block' if var in ROLES else 'is a hole'}), not a variable name", where)
        try:
            if head == "gen":
                return gen(var, **hole.options)  # gen takes max_tokens, and refuses it beside max_new_tokens
            return _select(var, hole.options)
        except (ValueError, TypeError) as exc:
            raise StmSyntaxError(f"{head}: {exc}", where) from None
    _no_args(hole, f"variable {{{head}}}")
    return VarRef(head, where)


def _select(var: str | None, options: Mapping[str, OptionValue]) -> Select:
    if var is None:
        raise ValueError("needs a variable name: {select name choices=[...]}")
    unknown = sorted(set(options) - {"choices", "method"})
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} (options: choices, method)")
    if "choices" not in options:
        raise ValueError("needs choices=[...]")
    return select(var, options["choices"], **({"method": options["method"]} if "method" in options else {}))


def _no_args(hole: _Hole, what: str) -> None:
    if hole.flags or hole.options:
        extra = [*hole.flags, *hole.options]
        raise StmSyntaxError(f"{what} takes no arguments, got {', '.join(extra)}", hole.where)


def _check_roles(nodes: Sequence[Node], wheres: Sequence[Where | None], name: str) -> None:
    open_role, opened_at = None, None
    for node, where in zip(nodes, wheres):
        if isinstance(node, RoleBegin):
            if open_role is not None:
                raise StmSyntaxError(f"{{{node.role}}} opens a block inside the {{{open_role}}} block "
                                     f"opened at {opened_at}; close that one first", where)
            open_role, opened_at = node.role, where
        elif isinstance(node, RoleEnd):
            if open_role != node.role:
                raise StmSyntaxError(f"{{/{node.role}}} closes no open {{{node.role}}} block "
                                     f"(open: {('{' + open_role + '}') if open_role else 'none'})", where)
            open_role = None
    if open_role is not None:
        raise StmSyntaxError(f"the {{{open_role}}} block is never closed", opened_at)


def _trim_newlines(nodes: list[Node]) -> list[Node]:
    """Drops one newline after a role tag and one before a closing tag."""
    out = list(nodes)
    for i, node in enumerate(out):
        if not isinstance(node, Text):
            continue
        value = node.value
        if i > 0 and isinstance(out[i - 1], (RoleBegin, RoleEnd)) and value.startswith("\n"):
            value = value[1:]
        if i + 1 < len(out) and isinstance(out[i + 1], RoleEnd) and value.endswith("\n"):
            value = value[:-1]
        out[i] = Text(value)
    return [n for n in out if not (isinstance(n, Text) and not n.value)]


def _unescape(text: str) -> str:
    """Literal braces, then the backslash escapes (lang.escapes: the rule of every typed text)."""
    return unescape(text.replace("{{", "{").replace("}}", "}"))


def compile_nodes(source: str, name: str = "<text>") -> tuple[Node, ...]:
    tree = parse(source, name)
    nodes: list[Node] = []
    wheres: list[Where | None] = []
    for item in tree.children:
        if item.data == "text":
            nodes.append(Text(_unescape(item.children[0].value)))
            wheres.append(None)
        else:
            hole = _hole(item, name)
            nodes.append(_compile_hole(hole))
            wheres.append(hole.where)
    _check_roles(nodes, wheres, name)
    return tuple(_trim_newlines(nodes))


def arguments(nodes: Sequence[Node]) -> dict[str, Where | None]:
    """The variables a program reads before generating them: its arguments, with first use."""
    generated: set[str] = set()
    needed: dict[str, Where | None] = {}
    for node in nodes:
        if isinstance(node, VarRef) and node.name not in generated and node.name not in needed:
            needed[node.name] = node.where
        elif isinstance(node, (Gen, Select)) and node.name:
            generated.add(node.name)
    return needed


class TextFunction(Function):
    """A compiled text program; its keyword arguments are its variables."""

    def __init__(self, nodes: tuple[Node, ...], name: str, source: str = ""):
        self.nodes = nodes
        self.source = source
        self.arguments = arguments(nodes)
        for var, where in self.arguments.items():  # run() takes these names for itself
            if var in RESERVED or var in RUN_KEYWORDS:
                raise StmSyntaxError(f"variable {{{var}}} is read before it is generated, so it is "
                                     f"passed to run() by name, and run() takes {var!r} for itself "
                                     f"({'reserved' if var in RESERVED else 'a sampling option'}): "
                                     f"rename it", where or Where(1, 1, name))
        # the {x} that read an argument: those before the program generates x (later ones read
        # what it generated)
        reads = set()
        generated: set[str] = set()
        for i, node in enumerate(nodes):
            if isinstance(node, VarRef) and node.name in self.arguments and node.name not in generated:
                reads.add(i)
            elif isinstance(node, (Gen, Select)) and node.name:
                generated.add(node.name)

        def body(s, **args):
            for i, node in enumerate(nodes):
                if i in reads:
                    node = Text(str(args[node.name]))
                s += node
        super().__init__(body, name)

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
        if args:
            raise TypeError(f"text program {self.name} takes its variables by name")
        for var, where in self.arguments.items():
            if var not in kwargs:
                raise UnknownVariable(var, where, list(kwargs))
        extra = sorted(set(kwargs) - set(self.arguments))
        if extra:
            takes = ", ".join(self.arguments) or "none"
            raise TypeError(f"text program {self.name} has no variable {extra[0]!r} "
                            f"(its variables: {takes})")
        return (), dict(kwargs)

    def placeholders(self) -> dict[str, Placeholder]:
        return {var: Placeholder(var) for var in self.arguments}

    def parameter_names(self) -> frozenset[str]:
        return frozenset(self.arguments)


def compile_text(source: str, name: str = "<text>") -> TextFunction:
    """A runnable program from .stm source."""
    return TextFunction(compile_nodes(source, name), name, source)


def load(path: str | Path) -> TextFunction:
    """A runnable program from a .stm file."""
    path = Path(path)
    return compile_text(path.read_text(encoding="utf-8-sig"), str(path))  # an editor's BOM is not text
