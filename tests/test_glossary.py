"""docs/glossary.md gives one meaning per word (issues 24, 42), and the code keeps to it.

Pure file checks: each word has one entry, every path an entry names exists (a module named
without its folder, somewhere under src/ringtrain), and "transport" names one thing in the code,
the package ``ringtrain.transport`` (it also named the launcher's ssh command module and a
setting's values were explained as a second kind of thing).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "ringtrain"
GLOSSARY = ROOT / "docs" / "glossary.md"
ENTRY = re.compile(r"^\*\*(?P<word>[^*]+?)\.\*\* (?P<text>.*?)(?=^\*\*|\Z)", re.M | re.S)
PATH = re.compile(r"`((?:[a-z_]+/)+[a-z_]*(?:\.py)?)`")
BARE = re.compile(r"`([a-z0-9_]+\.py)`")  # a module named without its folder


def entries() -> list[tuple[str, str]]:
    return [(m["word"], " ".join(m["text"].split())) for m in ENTRY.finditer(GLOSSARY.read_text())]


def test_each_word_has_one_entry() -> None:
    words = [word.lower() for word, _ in entries()]
    assert len(words) >= 10  # the parse found the entries
    assert sorted(w for w in set(words) if words.count(w) > 1) == []


def test_every_path_an_entry_names_exists() -> None:
    named = {p for _, text in entries() for p in PATH.findall(text)}
    assert "transport/ring.py" in named
    missing = [p for p in sorted(named) if not ((SRC / p).exists() or (ROOT / p).exists())]
    assert missing == []
    bare = {p for _, text in entries() for p in BARE.findall(text)}
    assert [p for p in sorted(bare) if not any(SRC.rglob(p))] == []


def test_transport_is_the_package_only() -> None:
    """No module or package but ``ringtrain.transport`` is named "transport"; the entry says
    what ``Config.transport`` is and where starting agents over ssh lives instead."""
    named = sorted(
        str(p.relative_to(SRC))
        for p in SRC.rglob("*transport*")
        if "__pycache__" not in p.parts and p.suffix in ("", ".py")
    )
    assert named == ["transport"]
    assert not (SRC / "launch" / "transport.py").exists()
    assert (SRC / "launch" / "agent_start.py").exists()
    (text,) = [text for word, text in entries() if word == "Transport"]
    for must in ("`ringtrain.transport`", "`Config.transport`", "`launch/agent_start.py`"):
        assert must in text
