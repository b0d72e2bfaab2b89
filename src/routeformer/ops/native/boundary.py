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

from routeformer.ops.native.c_reader import Preprocessor

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
        tokens = Preprocessor(source.parent).run(source)
        for prototype in _declarations(tokens, source.name):
            prototypes.setdefault(prototype.name, []).append(prototype)
    return prototypes


@cache
def c_prototypes() -> dict[str, list[Prototype]]:
    """The prototypes of the shipped kernels (every *_kernels.c beside this file), read once."""
    from routeformer.ops.native.build import SOURCES

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
