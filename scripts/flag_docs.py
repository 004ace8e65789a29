"""The flag reference of docs/configuration.md, made from the parsers themselves.

Every table row is one flag of ``deepserve up`` or of ``python -m services.<name>``: its
spellings (vLLM's aliases after the first), its environment twin, its default and its help.
The parsers read their twins while they are built, so they are built here with every twin
unset; the defaults shown are the code's, not this shell's.

    python scripts/flag_docs.py           # print the generated part
    python scripts/flag_docs.py --write   # replace it in docs/configuration.md

``tests/unit/test_docs.py`` fails while docs/configuration.md differs from what this prints.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DOC = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- flags:begin -->\n", "<!-- flags:end -->"
SERVICES = ("recipe", "entrypoint", "balancer", "prefill", "decode", "aggregated", "kvstore")
COMMON = ("--nats-url", "--http-port", "--host", "--instance-id", "--drain-seconds")
COMMON += ("--log-level", "--log-format")
_TWIN = re.compile(r"\s*\[env (\w+)\]")
_TWIN_IN_TEXT = re.compile(r"\benv (DEEPSERVE_\w+)")  # a plain add_argument that says so
_ENV_NAMES = re.compile(r"^(DEEPSERVE_\w+|NATS_URL|REDIS_URL)$")


from libs.common.config import common_flags  # noqa: E402  (after the path is set)


@contextmanager
def _no_twins() -> Iterator[None]:
    """Build parsers as if no environment twin were set."""
    saved = {k: v for k, v in os.environ.items() if _ENV_NAMES.match(k)}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def _up_parser() -> argparse.ArgumentParser:
    from deepserve import cli

    top = argparse.ArgumentParser(prog="deepserve")
    sub = top.add_subparsers(dest="command")
    cli._add_up(sub)
    return sub.choices["up"]


def _service_parser(service: str) -> argparse.ArgumentParser:
    module = importlib.import_module(f"services.{service}.config")
    return module.build_parser()  # type: ignore[no-any-return]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) if value else ""
    return f"`{value}`"


def _spellings(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        names = [o for o in action.option_strings if not o.startswith("--no-")]
        return " ".join(f"`{n}`" for n in names) + " (`--no-` turns it off)"
    return " ".join(f"`{o}`" for o in action.option_strings)


def _rows(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        if action.option_strings[0] in skip or (action.help or "").startswith(argparse.SUPPRESS):
            continue
        help_text = action.help or ""
        twin = _TWIN.search(help_text) or _TWIN_IN_TEXT.search(help_text)
        env = f"`{twin.group(1)}`" if twin else ""
        what = _cell(_TWIN.sub("", help_text))
        rows.append(f"| {_spellings(action)} | {env} | {_default(action)} | {what} |")
    return rows


def _table(title: str, rows: list[str]) -> str:
    head = "| flag | environment twin | default | what it sets |\n|---|---|---|---|\n"
    return f"### {title}\n\n{head}" + "\n".join(rows) + "\n"


def markdown() -> str:
    """The generated part of docs/configuration.md."""
    with _no_twins():
        parts = [_table("`deepserve up`", _rows(_up_parser()))]
        common = argparse.ArgumentParser()
        common_flags(common, "<service>")
        parts.append(_table("Every service", _rows(common)))
        for service in SERVICES:
            parser = _service_parser(service)
            parts.append(_table(f"`python -m services.{service}`", _rows(parser, COMMON)))
    return "\n".join(parts)


def main() -> int:
    text = markdown()
    if "--write" not in sys.argv[1:]:
        print(text, end="")
        return 0
    doc = DOC.read_text()
    head, rest = doc.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(head + BEGIN + text + END + tail)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
