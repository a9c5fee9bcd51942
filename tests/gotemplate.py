"""The part of Go's text/template that Ollama's chat templates here use, to render them in
tests: the ``ollama`` binary (and Go) cannot be installed on this machine, and no renderer of
Go templates is on PyPI. Follows https://pkg.go.dev/text/template for what it covers:

- ``{{- `` and `` -}}`` trim the white space (spaces, tabs, newlines) beside the action;
- ``range PIPE`` (the dot becomes each element), ``if PIPE`` / ``else if PIPE`` / ``else`` /
  ``end``; an empty string, zero, nil or empty list is false;
- ``$x := PIPE`` and ``$x = PIPE`` (assignment reaches the variable declared outside a range,
  as in Go since 1.11), ``$`` the data passed in;
- ``.Field``, ``$.Field``, ``$x``, string literals and ``eq A B``; any other action raises.
"""

from __future__ import annotations

import re

_ACTION = re.compile(r"{{(-\s)?(.*?)(\s-)?}}", re.S)
_ARG = re.compile(r'"(?:[^"\\]|\\.)*"|\(|\)|[^\s()]+')


def render(template: str, data: dict) -> str:
    nodes, rest = _parse(_lex(template), 0, ())
    assert rest == len(_lex(template)), "unbalanced end"
    out: list[str] = []
    _run(nodes, data, data, {"$": data}, out)
    return "".join(out)


def _lex(template: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        if m.group(1):
            text = text.rstrip(" \t\r\n")
        tokens.append(("text", text))
        tokens.append(("action", m.group(2).strip()))
        pos = m.end()
        if m.group(3):
            stripped = template[pos:].lstrip(" \t\r\n")
            pos = len(template) - len(stripped)
    tokens.append(("text", template[pos:]))
    return tokens


def _parse(tokens, i, until):
    nodes = []
    while i < len(tokens):
        kind, value = tokens[i]
        if kind == "text":
            nodes.append(("text", value))
            i += 1
            continue
        word = value.split(None, 1)[0] if value else ""
        if word in until or (value.startswith("else") and "else" in until):
            return nodes, i
        if word in ("range", "if"):
            branches, i = _parse_block(tokens, i, word)
            nodes.append((word, branches))
        else:
            nodes.append(("action", value))
            i += 1
    return nodes, i


def _parse_block(tokens, i, word):
    branches = []  # (condition or None, body)
    condition = tokens[i][1][len(word):].strip()
    i += 1
    while True:
        body, i = _parse(tokens, i, ("end", "else"))
        branches.append((condition, body))
        value = tokens[i][1]
        i += 1
        if value == "end":
            return branches, i
        if value.startswith("else if"):
            condition = value[len("else if"):].strip()
        elif value == "else":
            condition = None
        else:
            raise ValueError(f"unsupported action {value!r}")


def _truth(v) -> bool:
    return bool(v)


def _run(nodes, dot, root, variables, out):
    for kind, value in nodes:
        if kind == "text":
            out.append(value)
        elif kind == "action":
            m = re.fullmatch(r"(\$\w+)\s*(:?=)\s*(.+)", value, re.S)
            if m:
                variables[m.group(1)] = _eval(m.group(3), dot, variables)
            else:
                out.append(str(_eval(value, dot, variables)))
        elif kind == "if":
            for condition, body in value:
                if condition is None or _truth(_eval(condition, dot, variables)):
                    _run(body, dot, root, variables, out)
                    break
        elif kind == "range":
            (items_expr, body), *other = value
            items = _eval(items_expr, dot, variables)
            if items:
                for item in items:
                    _run(body, item, root, variables, out)
            elif other:
                _run(other[0][1], dot, root, variables, out)


def _eval(expr: str, dot, variables):
    args = _ARG.findall(expr)
    if args[0] == "eq":
        a, b = (_value(x, dot, variables) for x in args[1:3])
        return a == b
    if len(args) != 1:
        raise ValueError(f"unsupported pipeline {expr!r}")
    return _value(args[0], dot, variables)


def _value(arg: str, dot, variables):
    if arg.startswith('"'):
        return arg[1:-1].encode().decode("unicode_escape")
    if arg.startswith("$."):
        return _field(variables["$"], arg[2:])
    if arg.startswith("$"):
        return variables[arg]
    if arg == ".":
        return dot
    if arg.startswith("."):
        return _field(dot, arg[1:])
    raise ValueError(f"unsupported argument {arg!r}")


def _field(obj, path: str):
    for name in path.split("."):
        obj = obj[name]
    return obj
