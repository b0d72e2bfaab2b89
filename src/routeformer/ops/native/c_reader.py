"""Reading the kernels' C sources as the compiler would, for the boundary check (boundary.py):
comments stripped, tokens, and a small preprocessor (line splices, `#define` / `#undef` of
object- and function-like macros with `#` and `##`, `#include "..."` of the headers beside the
sources; `#if` blocks are all read, not evaluated)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_TOKEN = re.compile(r"""
    "(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'   # string and character literals
  | [A-Za-z_]\w*                                  # identifiers
  | \.?\d(?:[eEpP][+-]|[\w.])*                     # numbers
  | \#\# | \.\.\. | -> | <<= | >>= | [-+*/%&|^!=<>]= | && | \|\| | << | >> | \+\+ | --
  | [^\s\w]                                       # any other punctuator
""", re.VERBOSE)
_COMMENT = re.compile(r"""("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')|/\*.*?\*/|//[^\n]*""", re.DOTALL)


def strip_comments(text: str) -> str:
    text = text.replace("\\\r\n", "").replace("\\\n", "")  # line splices first, as the compiler does
    return _COMMENT.sub(lambda m: m.group(1) or " ", text)


def c_tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


@dataclass
class _Macro:
    params: tuple[str, ...] | None  # None: object-like
    body: list[str]
    variadic: bool = False


class Preprocessor:
    """Enough of the C preprocessor to expand the kernels' sources: see the module docstring."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.macros: dict[str, _Macro] = {}

    def run(self, path: Path, depth: int = 0) -> list[str]:
        if depth > 20:
            raise RecursionError(f"#include nested too deeply at {path}")
        out: list[str] = []
        pending: list[str] = []
        for line in strip_comments(path.read_text()).split("\n"):
            stripped = line.strip()
            if not stripped.startswith("#"):
                pending.append(line)
                continue
            out += self.expand(c_tokens("\n".join(pending)))
            pending = []
            directive = c_tokens(stripped[1:])
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
        return out + self.expand(c_tokens("\n".join(pending)))

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
            self.macros[name] = _Macro(params, c_tokens(rest[close + 1:]), variadic)
        else:
            self.macros[name] = _Macro(None, c_tokens(rest[match.end():]))

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
