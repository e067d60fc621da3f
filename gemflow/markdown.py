"""Generated sections of hand-written markdown docs: a bench rewrites its own block, the prose around it stays."""

from __future__ import annotations

from pathlib import Path


def write_marked_section(doc: Path, begin: str, end: str, body: str, title: str) -> None:
    """Replace the block between the ``begin`` and ``end`` marker lines of ``doc`` by ``body``, or append it
    (a new ``doc`` starts with ``title``)."""
    text = doc.read_text() if doc.exists() else f"{title}\n"
    block = f"{begin}\n{body}{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
