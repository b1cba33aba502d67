"""Whether a Lark grammar can ever finish: every expansion of ``start`` must reach a finite string.

llguidance compiles ``start: "x" start`` (or a left-recursive rule with no base case)
without complaint, but no output ever completes it: the request could only end at
max_tokens. This is the classic "productive symbols" fixpoint over the grammar's
rules. It is conservative: anything it does not understand (directives, inline
``%json``, templates) counts as productive, so it only refuses grammars it has fully
read and found endless.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r'''
    (?P<ws>[ \t]+|//[^\n]*)
  | (?P<nl>\n)
  | (?P<str>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<re>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<rule>[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?\d+)?[ \t]*:(?![:=]))
  | (?P<name>[?!]?[A-Za-z_][A-Za-z_0-9]*)
  | (?P<op>[()\[\]|?*+])
  | (?P<range>~[ \t]*\d+(?:[ \t]*\.\.[ \t]*\d+)?)
  | (?P<dots>\.\.)
''', re.X)

_Item = tuple[str, object, str]  # kind ("lit" | "name" | "group"), payload, quantifier


def _parse(text: str) -> dict[str, list[list[_Item]]] | None:
    """Rules as alternatives of items; None when the text uses anything beyond plain rules."""
    toks: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            return None  # a directive, an inline %json, ...: not ours to judge
        kind = m.lastgroup or ""
        if kind != "ws":
            toks.append((kind, m.group()))
        pos = m.end()
    rules: dict[str, list[list[_Item]]] = {}
    i = 0

    def alternatives(stop: str) -> list[list[_Item]]:
        nonlocal i
        alts: list[list[_Item]] = [[]]
        while i < len(toks):
            kind, value = toks[i]
            if kind == "nl":
                if stop == "" and (i + 1 >= len(toks) or toks[i + 1][1] != "|"):
                    return alts
                i += 1
                continue
            if kind == "rule" or (kind == "op" and value in ")]" and value == stop):
                return alts
            i += 1
            if kind == "op" and value == "|":
                alts.append([])
            elif kind in ("str", "re"):
                alts[-1].append(("lit", value, ""))
            elif kind == "name":
                alts[-1].append(("name", value.lstrip("?!"), ""))
            elif kind == "op" and value in "([":
                inner = alternatives(")" if value == "(" else "]")
                if i >= len(toks) or toks[i][1] != (")" if value == "(" else "]"):
                    raise ValueError("unbalanced")
                i += 1
                alts[-1].append(("group", inner, "?" if value == "[" else ""))
            elif kind in ("op", "range") and value[0] in "?*+~" and alts[-1]:
                k, payload, _ = alts[-1][-1]
                optional = value in "?*" or re.fullmatch(r"~\s*0(\s*\.\..*)?", value) is not None
                alts[-1][-1] = (k, payload, "?" if optional else "+")
            elif kind == "dots" and alts[-1] and alts[-1][-1][0] == "lit":
                i += 1  # "a".."z": a character range, one literal
            else:
                raise ValueError(value)
        return alts

    try:
        while i < len(toks):
            kind, value = toks[i]
            if kind == "nl":
                i += 1
                continue
            if kind != "rule":
                return None
            name = value.split(":")[0].strip().lstrip("?!").split(".")[0]
            i += 1
            rules.setdefault(name, []).extend(alternatives(""))
    except (ValueError, IndexError):
        return None
    return rules


def endless_rules(text: str) -> list[str] | None:
    """The rules with no finite expansion if ``start`` is one of them, else None (also when unsure)."""
    text = re.sub(r"(?m)^%llguidance[ \t]*\{[ \t]*\}[ \t]*$", "", text)  # what gbnf_to_lark writes first
    rules = _parse(text)
    if rules is None or "start" not in rules:
        return None
    productive: set[str] = set()

    def item_ok(item: _Item) -> bool:
        kind, payload, quant = item
        if quant == "?" or kind == "lit":
            return True
        if kind == "name":
            name = str(payload)
            return name in productive or name not in rules  # undefined: llguidance's business
        return any(all(item_ok(x) for x in alt) for alt in payload)  # type: ignore[attr-defined]

    changed = True
    while changed:
        changed = False
        for name, alts in rules.items():
            if name not in productive and any(all(item_ok(x) for x in alt) for alt in alts):
                productive.add(name)
                changed = True
    if "start" in productive:
        return None
    return sorted(n for n in rules if n not in productive)
