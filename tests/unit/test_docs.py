"""The docs a newcomer reads: a short README with the two-command quick start, links that land
somewhere, and a flag reference that is what the parsers accept today."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _flag_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("flag_docs", ROOT / "scripts" / "flag_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def anchors(markdown: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    out = set()
    for line in _FENCE.sub("", markdown).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    block = readme.split("## Quick start", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert commands == ["make up", "make test"]
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in readme
    for guide in ("getting-started", "deploying", "configuration", "api", "operations"):
        assert f"(docs/{guide}.md)" in readme, f"README does not point to docs/{guide}.md"


def test_every_relative_link_lands() -> None:
    broken = []
    for doc in DOCS:
        text = _FENCE.sub("", doc.read_text())
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_anchor_rule_matches_github() -> None:
    text = "## `deepserve up`: one machine, no containers\n## vLLM's utility routes\n"
    text += "## The GPU stack (`deepserve up --device cuda`)\n```\n# not a heading\n```\n"
    assert anchors(text) == {
        "deepserve-up-one-machine-no-containers",
        "vllms-utility-routes",
        "the-gpu-stack-deepserve-up---device-cuda",
    }


def test_configuration_lists_every_flag_as_the_parsers_do() -> None:
    flag_docs = _flag_docs()
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert flag_docs.BEGIN in doc and flag_docs.END in doc
    table = doc.split(flag_docs.BEGIN, 1)[1].split(flag_docs.END, 1)[0]
    assert table == flag_docs.markdown(), (
        "docs/configuration.md's flag reference is stale: run python scripts/flag_docs.py --write"
    )


def test_flag_reference_names_twins_and_vllm_aliases() -> None:
    text = _flag_docs().markdown()
    # A few rows a vLLM user looks for first, each with its twin.
    gpu = "| `--gpu-memory-fraction` `--gpu-memory-utilization` | `DEEPSERVE_GPU_MEMORY_FRACTION`"
    assert gpu in text
    assert "| `--max-running` `--max-num-seqs` | `DEEPSERVE_MAX_RUNNING`" in text
    assert "| `--nats-url` | `NATS_URL` |" in text and "| `--redis-url` | `REDIS_URL` |" in text
    for service in ("recipe", "entrypoint", "balancer", "prefill", "decode", "aggregated"):
        assert f"### `python -m services.{service}`" in text
    assert "==SUPPRESS==" not in text


def test_flag_reference_ignores_this_shells_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    flag_docs = _flag_docs()
    clean = flag_docs.markdown()
    monkeypatch.setenv("DEEPSERVE_MAX_RUNNING", "7")
    monkeypatch.setenv("NATS_URL", "nats://elsewhere:4222")
    assert flag_docs.markdown() == clean
    assert os.environ["DEEPSERVE_MAX_RUNNING"] == "7"  # put back as it was
