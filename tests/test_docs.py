"""The documentation stays true: every relative link in README.md, docs/, proto/ and examples/
resolves inside the repository (files and #anchors), and the configuration reference in
docs/operator.md lists every key pdd_wire.config accepts, with its real default."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec

from pdd_wire import config as cfgmod

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "proto").rglob("*.md")),
        *sorted((ROOT / "examples").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _code_free(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # a heading's `code` counts
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_every_relative_link_resolves():
    assert len(DOCS) > 10
    broken = []
    for doc in DOCS:
        for target in LINK.findall(_code_free(doc.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif ROOT not in dest.parents and dest != ROOT:
                broken.append(f"{doc.relative_to(ROOT)}: {target} (outside the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def config_keys(t=cfgmod.Config, prefix: str = ""):
    """(dotted key, default) of every leaf the config accepts; lists of tables as ``peers[].x``."""
    for f in msgspec.structs.fields(t):
        args = [a for a in typing.get_args(f.type) if a is not type(None)]
        sub = args[0] if typing.get_origin(f.type) is list and args else f.type
        if isinstance(sub, type) and issubclass(sub, msgspec.Struct):
            yield from config_keys(sub, f"{prefix}{f.name}{'[]' if sub is not f.type else ''}.")
        elif f.default is msgspec.NODEFAULT and f.default_factory is not msgspec.NODEFAULT:
            yield f"{prefix}{f.name}", f.default_factory()  # a list's default ([])
        else:
            yield f"{prefix}{f.name}", f.default


def documented() -> dict[str, str]:
    """The configuration reference table of docs/operator.md: key -> default cell."""
    rows = re.findall(r"^\| `([a-z_.\[\]]+)` \| ([^|]+?) \|", (ROOT / "docs" / "operator.md").read_text(), re.M)
    return dict(rows)


def test_config_reference_lists_every_key_with_its_default():
    doc = documented()
    for key, default in config_keys():
        assert key in doc, f"docs/operator.md: the configuration reference lacks {key}"
        cell = doc[key]
        if default is msgspec.NODEFAULT:
            assert cell == "required", (key, cell)
        elif default is None:
            assert cell == "unset", (key, cell)
        else:
            value = msgspec.toml.decode(f"v = {cell.strip('`')}")["v"]
            assert value == default and type(value) is type(default), (key, cell, default)
