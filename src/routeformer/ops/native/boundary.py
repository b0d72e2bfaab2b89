"""The C boundary checked: the prototypes of the kernels' exported functions, read from the C
sources, against the ctypes declarations of the Python wrappers.

A ctypes declaration that disagrees with its C prototype (an argument missing, an int64_t passed
where the C takes an int, a double where it takes a pointer) is not an error ctypes can see: the
call reads garbage, silently. So every declaration (`routeformer.ops.native.declare`) is compared
with the prototype the first time `kernel` hands the function out, and a mismatch raises
`CBoundaryError` naming the function and the argument.

What is compared, per argument and for the return value, is the *kind* the calling convention
cares about: pointer, 64-bit int, 32-bit int, double, float (and void for the return). The C side
is read from the shipped *_kernels.c files by a small preprocessor (comments, line splices,
`#define`/`#undef` of object- and function-like macros with `#` and `##`, `#include "..."` of the
headers beside them; a prototype written inside a macro or a template header is expanded as the
compiler expands it). Conditional blocks are all read (`#if` is not evaluated): a function defined
in both branches (an AVX-512 kernel and its stub) has each of its prototypes checked. Static
functions are internal and skipped; a prototype declared in one file and defined in another must
agree too (`c_prototypes` keeps them all). tests/ops/native/test_c_boundary.py checks this reader
against the compiler's own preprocessor.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_HERE = Path(__file__).parent

#: The argument kinds the check compares.
POINTER, INT64, INT32, DOUBLE, FLOAT, VOID = "pointer", "int64", "int32", "double", "float", "void"

# C base types passed by value, by kind (LP64: long is 64 bits, as ctypes.c_long on Linux/macOS).
_C_KINDS = {
    "int64_t": INT64, "uint64_t": INT64, "long": INT64, "size_t": INT64, "ssize_t": INT64,
    "ptrdiff_t": INT64, "intptr_t": INT64, "uintptr_t": INT64,
    "int": INT32, "int32_t": INT32, "uint32_t": INT32, "unsigned": INT32, "signed": INT32,
    "int16_t": "int16", "uint16_t": "int16", "short": "int16",
    "int8_t": "int8", "uint8_t": "int8", "char": "int8", "_Bool": "bool", "bool": "bool",
    "double": DOUBLE, "float": FLOAT, "void": VOID,
}
_QUALIFIERS = {"const", "volatile", "restrict", "__restrict", "__restrict__", "register", "struct", "enum",
               "union"}
_SPECIFIERS = {"static", "inline", "__inline", "__inline__", "extern", "_Noreturn"}


class CBoundaryError(TypeError):
    """A ctypes declaration that does not match the C prototype of its function."""


@dataclass(frozen=True)
class Prototype:
    """One C prototype of an exported function: its return kind and argument kinds, with the
    C text of each argument (after macro expansion) for error messages."""

    name: str
    returns: str
    arguments: tuple[str, ...]
    texts: tuple[str, ...]
    source: str  # the file it was read in
    defined: bool  # a definition (else a declaration ending in ';')

    def __str__(self) -> str:
        return f"{self.returns} {self.name}({', '.join(self.texts) or 'void'})  [{self.source}]"


# -- the C side ------------------------------------------------------------------------------------
_TOKEN = re.compile(r"""
    "(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'   # string and character literals
  | [A-Za-z_]\w*                                  # identifiers
  | \.?\d(?:[eEpP][+-]|[\w.])*                     # numbers
  | \#\# | \.\.\. | -> | <<= | >>= | [-+*/%&|^!=<>]= | && | \|\| | << | >> | \+\+ | --
  | [^\s\w]                                       # any other punctuator
""", re.VERBOSE)
_COMMENT = re.compile(r"""("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')|/\*.*?\*/|//[^\n]*""", re.DOTALL)


def _strip_comments(text: str) -> str:
    text = text.replace("\\\r\n", "").replace("\\\n", "")  # line splices first, as the compiler does
    return _COMMENT.sub(lambda m: m.group(1) or " ", text)


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


@dataclass
class _Macro:
    params: tuple[str, ...] | None  # None: object-like
    body: list[str]
    variadic: bool = False


class _Preprocessor:
    """Enough of the C preprocessor to expand the kernels' sources: see the module docstring."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.macros: dict[str, _Macro] = {}

    def run(self, path: Path, depth: int = 0) -> list[str]:
        if depth > 20:
            raise RecursionError(f"#include nested too deeply at {path}")
        out: list[str] = []
        pending: list[str] = []
        for line in _strip_comments(path.read_text()).split("\n"):
            stripped = line.strip()
            if not stripped.startswith("#"):
                pending.append(line)
                continue
            out += self.expand(_tokens("\n".join(pending)))
            pending = []
            directive = _tokens(stripped[1:])
            if not directive:
                continue
            word, rest = directive[0], stripped[1:].lstrip()[len(directive[0]):]
            if word == "define":
                self._define(rest)
            elif word == "undef":
                self.macros.pop(rest.split()[0], None)
            elif word == "include":
                match = re.match(r'\s*"([^"]+)"', rest)
                if match and (self.directory / match.group(1)).exists():
                    out += self.run(self.directory / match.group(1), depth + 1)
            # if/ifdef/ifndef/elif/else/endif: every branch is read (see the module docstring);
            # pragma, error, line: nothing to expand
        return out + self.expand(_tokens("\n".join(pending)))

    def _define(self, rest: str) -> None:
        match = re.match(r"\s*([A-Za-z_]\w*)(\()?", rest)
        if match is None:
            return
        name = match.group(1)
        if match.group(2):  # function-like: the parenthesis touches the name
            close = rest.index(")", match.end())
            params = tuple(p.strip() for p in rest[match.end():close].split(",") if p.strip())
            variadic = bool(params) and params[-1] == "..."
            params = tuple("__VA_ARGS__" if p == "..." else p for p in params)
            self.macros[name] = _Macro(params, _tokens(rest[close + 1:]), variadic)
        else:
            self.macros[name] = _Macro(None, _tokens(rest[match.end():]))

    def expand(self, tokens: list[str], hidden: frozenset[str] = frozenset()) -> list[str]:
        """The tokens with the macros expanded, except inside braces: a function's body (or a
        struct's) says nothing of its prototype, and is passed on as written."""
        out: list[str] = []
        i = depth = 0
        while i < len(tokens):
            token = tokens[i]
            if token in ("{", "}"):
                depth += 1 if token == "{" else -1
            macro = self.macros.get(token) if depth <= 0 else None
            if macro is None or token in hidden:
                out.append(token)
                i += 1
                continue
            if macro.params is None:
                out += self.expand(self._paste(list(macro.body)), hidden | {token})
                i += 1
                continue
            if i + 1 >= len(tokens) or tokens[i + 1] != "(":
                out.append(token)  # a function-like macro's name without arguments
                i += 1
                continue
            args, i = self._arguments(tokens, i + 1)
            out += self.expand(self._substitute(macro, args, hidden), hidden | {token})
        return out

    @staticmethod
    def _arguments(tokens: list[str], start: int) -> tuple[list[list[str]], int]:
        """The arguments of a call whose '(' is tokens[start]; returns them and the index past ')'."""
        args: list[list[str]] = [[]]
        depth = 0
        for i in range(start, len(tokens)):
            token = tokens[i]
            if token == "(":
                depth += 1
                if depth == 1:
                    continue
            elif token == ")":
                depth -= 1
                if depth == 0:
                    return args, i + 1
            elif token == "," and depth == 1:
                args.append([])
                continue
            args[-1].append(token)
        raise SyntaxError("unterminated macro call")

    def _substitute(self, macro: _Macro, args: list[list[str]], hidden: frozenset[str]) -> list[str]:
        params = macro.params or ()
        if macro.variadic and len(args) > len(params):  # the extra arguments go to __VA_ARGS__
            args = [*args[:len(params) - 1], [t for arg in args[len(params) - 1:] for t in (*arg, ",")][:-1]]
        if params == () and args == [[]]:
            args = []
        if len(args) != len(params):
            raise SyntaxError(f"macro takes {len(params)} arguments, got {len(args)}")
        raw = dict(zip(params, args, strict=True))
        body, out = macro.body, []
        for j, token in enumerate(body):
            if token == "#" and j + 1 < len(body) and body[j + 1] in raw:
                continue  # stringized below
            if j > 0 and body[j - 1] == "#" and token in raw:
                out.append('"' + " ".join(raw[token]).replace("\\", "\\\\").replace('"', '\\"') + '"')
            elif token in raw:
                pasted = (j > 0 and body[j - 1] == "##") or (j + 1 < len(body) and body[j + 1] == "##")
                out += raw[token] if pasted else self.expand(raw[token], hidden)
            else:
                out.append(token)
        return self._paste(out)

    @staticmethod
    def _paste(tokens: list[str]) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(tokens):
            if tokens[i] == "##" and out and i + 1 < len(tokens):
                out[-1] += tokens[i + 1]
                i += 2
            else:
                out.append(tokens[i])
                i += 1
        return out


def _drop_attributes(tokens: list[str]) -> list[str]:
    """Without `__attribute__((...))` and `_Pragma("...")`, which say nothing of the types."""
    out: list[str] = []
    i = 0
    while i < len(tokens):
        if tokens[i] in ("__attribute__", "_Pragma") and i + 1 < len(tokens) and tokens[i + 1] == "(":
            depth, i = 0, i + 1
            while True:
                depth += {"(": 1, ")": -1}.get(tokens[i], 0)
                i += 1
                if depth == 0:
                    break
            continue
        out.append(tokens[i])
        i += 1
    return out


def _split_top(tokens: list[str], separator: str) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    depth = 0
    for token in tokens:
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(token, 0)
        if token == separator and depth == 0:
            parts.append([])
        else:
            parts[-1].append(token)
    return parts


def _kind(tokens: list[str]) -> str:
    """The kind of one declared type (an argument or the return type)."""
    if "*" in tokens or "[" in tokens or "(" in tokens:  # pointers, arrays (decay), function pointers
        return POINTER
    words = [t for t in tokens if t not in _QUALIFIERS and t not in _SPECIFIERS]
    kinds = [_C_KINDS[w] for w in words if w in _C_KINDS]
    if not kinds:
        return "unknown:" + " ".join(words)
    if "int16" in kinds or "int8" in kinds or "bool" in kinds or kinds[0] in (DOUBLE, FLOAT, VOID):
        return kinds[0]
    return INT64 if INT64 in kinds else INT32  # long, long long, unsigned long; int, unsigned int


def _prototype(chunk: list[str], source: str, defined: bool) -> Prototype | None:
    """The prototype of a top-level declaration's tokens (up to its ')'), or None when it is no
    exported function (static, a typedef, a variable)."""
    chunk = _drop_attributes(chunk)
    if not chunk or chunk[-1] != ")" or chunk[0] in ("typedef", "static") or "=" in chunk:
        return None
    if "static" in chunk[:chunk.index("(")]:
        return None
    depth, open_at = 0, None
    for index in range(len(chunk) - 1, -1, -1):  # the parameter list: the last balanced (...)
        depth += {")": 1, "(": -1}.get(chunk[index], 0)
        if depth == 0:
            open_at = index
            break
    if open_at is None or open_at == 0 or not re.match(r"[A-Za-z_]\w*$", chunk[open_at - 1]):
        return None
    name, head = chunk[open_at - 1], chunk[:open_at - 1]
    if not head:  # a call or a macro use at file scope, not a declaration
        return None
    params = [p for p in _split_top(chunk[open_at + 1:-1], ",") if p]
    if len(params) == 1 and params[0] == ["void"]:
        params = []
    kinds = tuple(_kind(p) for p in params)
    return Prototype(name, _kind(head), kinds, tuple(" ".join(p) for p in params), source, defined)


def _declarations(tokens: list[str], source: str) -> list[Prototype]:
    """The exported functions declared or defined at file scope in an expanded token stream."""
    found: list[Prototype] = []
    chunk: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "{":
            prototype = _prototype(chunk, source, defined=True)
            depth = 0
            while True:  # skip the body (or a struct's members, an initializer)
                depth += {"{": 1, "}": -1}.get(tokens[i], 0)
                i += 1
                if depth == 0:
                    break
            if prototype is not None or (chunk and chunk[-1] == ")"):  # a function: the chunk ends
                found += [prototype] if prototype is not None else []
                chunk = []
            else:
                chunk.append("{}")
            continue
        if token == ";":
            # (one declarator per declaration: `int f(int), g(void);` would be read as f alone)
            prototype = _prototype(_split_top(chunk, ",")[0], source, defined=False)
            if prototype is not None:
                found.append(prototype)
            chunk = []
        else:
            chunk.append(token)
        i += 1
    return found


def parse_sources(sources: tuple[Path, ...]) -> dict[str, list[Prototype]]:
    """Every prototype of every exported function in these translation units (each read from a
    fresh macro table, as the compiler reads them), by function name."""
    prototypes: dict[str, list[Prototype]] = {}
    for source in sources:
        tokens = _Preprocessor(source.parent).run(source)
        for prototype in _declarations(tokens, source.name):
            prototypes.setdefault(prototype.name, []).append(prototype)
    return prototypes


@cache
def c_prototypes() -> dict[str, list[Prototype]]:
    """The prototypes of the shipped kernels (every *_kernels.c beside this file), read once."""
    from routeformer.ops.native import SOURCES

    return parse_sources(tuple(SOURCES))


# -- the Python side --------------------------------------------------------------------------------
def ctypes_kind(ctype) -> str:
    """The kind of a ctypes type as argument or return type (None: void)."""
    if ctype is None:
        return VOID
    if isinstance(ctype, type) and issubclass(ctype, ctypes._Pointer | ctypes._CFuncPtr):
        return POINTER
    code = getattr(ctype, "_type_", None)
    if not isinstance(code, str):
        return f"unknown:{getattr(ctype, '__name__', ctype)}"
    if code in "PzZ":
        return POINTER
    if code == "d":
        return DOUBLE
    if code == "f":
        return FLOAT
    if code == "?":
        return "bool"
    if code in "bBhHiIlLqQ":
        return {1: "int8", 2: "int16", 4: INT32, 8: INT64}[ctypes.sizeof(ctype)]
    return f"unknown:{ctype.__name__}"


def _describe(ctype) -> str:
    return "None" if ctype is None else getattr(ctype, "__name__", repr(ctype))


def mismatches(prototype: Prototype, restype, argtypes) -> list[str]:
    """What differs between a ctypes declaration and one C prototype (empty: they agree)."""
    problems = []
    if ctypes_kind(restype) != prototype.returns:
        problems.append(f"return type: ctypes {_describe(restype)} ({ctypes_kind(restype)}) but C returns "
                        f"{prototype.returns}")
    if len(argtypes) != len(prototype.arguments):
        problems.append(f"{len(argtypes)} arguments declared but C takes {len(prototype.arguments)}")
    for index, (ctype, kind, text) in enumerate(zip(argtypes, prototype.arguments, prototype.texts,
                                                    strict=False)):  # (a count mismatch: reported above)
        if ctypes_kind(ctype) != kind:
            problems.append(f"argument {index} (`{text}`): ctypes {_describe(ctype)} ({ctypes_kind(ctype)}) "
                            f"but C takes {kind}")
    return problems


def check(name: str, restype, argtypes, prototypes: dict[str, list[Prototype]] | None = None) -> None:
    """Raise CBoundaryError unless the declaration (restype, argtypes) of `name` matches every C
    prototype of it (by default the shipped sources' ones)."""
    found = (c_prototypes() if prototypes is None else prototypes).get(name)
    if not found:
        raise CBoundaryError(f"routeformer: no exported C function `{name}` in the kernel sources "
                             "(a ctypes declaration of a function that is not there, or that is static)")
    for prototype in found:
        problems = mismatches(prototype, restype, argtypes)
        if problems:
            raise CBoundaryError(f"routeformer: the ctypes declaration of `{name}` does not match its C "
                                 f"prototype\n    {prototype}\n  " + "\n  ".join(problems))
