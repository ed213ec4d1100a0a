"""Generates the site's reference pages from the code, so that they cannot drift from it.

    python scripts/gen_docs_reference.py           write docs/reference/recipe.md and docs/reference/cli.md
    python scripts/gen_docs_reference.py --check   exit 1, naming the stale pages, when they differ from the code

* docs/reference/recipe.md: every recipe key, walked from the config dataclasses (`RLConfig` for `kind: rl`,
  `SFTConfig` for `kind: sft | cpt`) with each field's type, default and documentation (`doc(...)` metadata, or
  the `name: text` entries of the class docstring for `DecodeConfig`). A field with no documentation is an error.
* docs/reference/cli.md: `ebpo --help` and every command's and benchmark's own `--help`, as argparse prints it.

CI runs the check through the docs build (scripts/mkdocs_hooks.py) and tests/test_docs_site.py.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

ROOT = Path(__file__).resolve().parents[1]
RECIPE_PAGE = ROOT / "docs" / "reference" / "recipe.md"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
HELP_COLUMNS = "100"  # argparse wraps help to $COLUMNS: fixed, so the page does not depend on the terminal


def _type_name(tp: Any) -> str:
    """A readable type: `int`, `float or null`, `one of "a", "b"`, `list of str`."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin is Union or origin is getattr(types, "UnionType", Union):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict or tp is dict:
        return "mapping"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def docstring_fields(cls) -> dict[str, str]:
    """`name: text` entries of a class docstring (indented continuation lines joined), as DecodeConfig writes them."""
    out: dict[str, str] = {}
    current = None
    for line in (cls.__doc__ or "").splitlines():
        m = re.match(r"^    (\w+): (.*)$", line)
        if m:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current and line.startswith("        ") and line.strip():
            out[current] += " " + line.strip()
        else:
            current = None
    return out


def field_docs(cls) -> dict[str, str]:
    """Every field's documentation; KeyError-like ValueError naming an undocumented field."""
    from_docstring = docstring_fields(cls)
    docs = {}
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help") or from_docstring.get(f.name)
        if not text:
            raise ValueError(f"{cls.__module__}.{cls.__qualname__}.{f.name} has no documentation: give it "
                             f"doc(...) (or a `{f.name}: ...` line in the class docstring)")
        docs[f.name] = text
    return docs


def _cell(text: str) -> str:
    """Markdown-table-safe text: pipes escaped, and outside `code` spans '<' and '*' escaped."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*").replace("_", "\\_")
    return "`".join(parts)


def section_rows(cls, prefix: str = "") -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """[(section key, [(dotted key, type, default, doc), ...]), ...] for `cls` and its nested sections."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    own, nested = [], []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            nested += [(f"{prefix}{f.name}", docs[f.name], tp)]
        else:
            own.append((prefix + f.name, _type_name(tp), _default(f), docs[f.name]))
    out = [(prefix.rstrip(".") or "(top level)", own)] if own else []
    for key, _, tp in nested:
        out += section_rows(tp, key + ".")
    return out


def _table(rows) -> list[str]:
    lines = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for key, tp, default, text in rows:
        shown = f"`{default}`" if "`" not in default and "|" not in default else _cell(default)
        lines.append(f"| `{key}` | {_cell(tp)} | {shown} | {_cell(text)} |")
    return lines


def recipe_page() -> str:
    from ebpo.rl.config import RLConfig
    from ebpo.sft.config import SFTConfig
    from rollout.config import DecodeConfig

    out = ["# Recipe keys", "",
           "<!-- Generated by scripts/gen_docs_reference.py from the config dataclasses; do not edit by hand. -->", "",
           "Every key a recipe may set, walked from the typed config dataclasses with each field's documentation.",
           "A recipe is YAML; `ebpo train RECIPE.yaml key=value ...` overrides any key with dotted names",
           "(`learner.lr=1e-4`, `rollout.decode={temperature: 0.8}`), and an unknown key or a bad value stops the run at",
           "start-up naming the key and the allowed values. `ebpo train RECIPE.yaml --help` prints the same list for",
           "the recipe's kind, and `--print-config` the resolved recipe.", ""]
    for title, cls, note in (
            ("RL recipes (`kind: rl`)", RLConfig, "`ebpo.rl.config.RLConfig`; the shipped ones are `recipes/rl_*.yaml` "
                                                  "and `recipes/quickstart*.yaml`."),
            ("CPT and SFT recipes (`kind: sft` or `kind: cpt`)", SFTConfig,
             "`ebpo.sft.config.SFTConfig`; the shipped ones are `recipes/sft_*.yaml` and `recipes/cpt_*.yaml`.")):
        out += [f"## {title}", "", note, ""]
        for section, rows in section_rows(cls):
            out += [f"### `{section}`" if section != "(top level)" else "### Top level", ""] + _table(rows) + [""]
    out += ["## Decoding keys (`rollout.decode`, `rollout.eval_decode`)", "",
            "These mappings hold `rollout.config.DecodeConfig` fields, applied over the chosen preset "
            "(`rollout.preset`, `rollout.eval_preset`).", ""]
    hints = typing.get_type_hints(DecodeConfig)
    docs = field_docs(DecodeConfig)
    out += _table([(f.name, _type_name(hints[f.name]), _default(f), docs[f.name])
                   for f in dataclasses.fields(DecodeConfig)]) + [""]
    return "\n".join(out)


def _help_of(target: str, argv: list[str]) -> str:
    from ebpo.cli import resolve

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            resolve(target)(argv)
        except SystemExit:
            pass
    text = buf.getvalue().rstrip()
    if not text.startswith("usage:"):
        raise ValueError(f"{target} --help printed no usage line")
    return text


def cli_page() -> str:
    from ebpo.cli import BENCHMARKS, COMMANDS, build_parser

    os.environ["COLUMNS"] = HELP_COLUMNS
    out = ["# Command line", "",
           "<!-- Generated by scripts/gen_docs_reference.py from the argparse parsers; do not edit by hand. -->", "",
           "`ebpo` (or `python -m ebpo`) and each of its commands, with the help its own parser prints.", "",
           "## `ebpo`", "", "```text", build_parser().format_help().rstrip(), "```", ""]
    for name, (target, _) in COMMANDS.items():
        if target is not None:
            out += [f"## `ebpo {name}`", "", "```text", _help_of(target, ["--help"]), "```", ""]
    out += ["## Benchmarks (`ebpo bench NAME`)", ""]
    for name, (target, _) in BENCHMARKS.items():
        out += [f"### `ebpo bench {name}`", "", "```text", _help_of(target, ["--help"]), "```", ""]
    return "\n".join(out)


def pages() -> dict[Path, str]:
    return {RECIPE_PAGE: recipe_page(), CLI_PAGE: cli_page()}


def stale() -> list[str]:
    """The generated pages whose committed text differs from what the code generates now."""
    return [str(p.relative_to(ROOT)) for p, text in pages().items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail when a generated page is stale; write nothing")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        if bad:
            print(f"stale generated docs: {bad}; run `python scripts/gen_docs_reference.py`", file=sys.stderr)
            return 1
        return 0
    for path, text in pages().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
