"""What the book promises its readers, as rules a test can check on the sources.

A chapter's prose states no time, ratio or bandwidth typed by hand: each comes from the
recorded results through the notebook (``report.glue_number`` and myst-nb's ``{glue}``
role), so that prose and figures cannot disagree. A chapter holds at most
:data:`MAX_PROSE_WORDS` words of prose. The browser check applies the word and timing
limits again to the rendered pages.
"""
from __future__ import annotations

import json
import pathlib
import re
from typing import List

ROOT = pathlib.Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
CHAPTERS = ("ctc", "sinkhorn", "segment_ops", "lstm")
MAX_PROSE_WORDS = 2500
MAX_TIMINGS_IN_PROSE = 8

_FENCE = re.compile(r"^(```+|:::+)[^\n]*\n.*?^\1\s*$", re.S | re.M)
_DISPLAY_MATH = re.compile(r"\$\$.*?\$\$", re.S)
_INLINE_MATH = re.compile(r"(?<!\\)\$[^$\n]+\$")
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_GLUE = re.compile(r"\{glue(?::\w+)?\}`[^`]+`")
_ROLE = re.compile(r"\{[\w:-]+\}`([^`]*)`")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_REFERENCES = re.compile(r"^#+\s*References\b.*", re.S | re.M)
#: a number typed next to a unit of time, a ratio mark or a rate: what must be glued
TYPED = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s*(?:[–-]\s*\d[\d,]*(?:\.\d+)?\s*)?"
    r"(?:ms|µs|μs|us|ns|s|seconds?|milliseconds?|microseconds?|×(?!\s*\d)|x(?!\s*\d)|times|TB/s|GB/s|%)(?![\w/])")
#: a time in rendered text (what the timing limit counts)
TIMING = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s*(?:ms|µs|μs|us|ns|s)(?![\w/])")
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'’._-]*")


def markdown_of(path: pathlib.Path) -> str:
    """The markdown of a notebook's markdown cells (or of a ``.md`` page), joined."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text()


def prose(markdown: str) -> str:
    """The prose of a page: no code or directive blocks, maths, comments or the closing
    References section; a glued value counts as one word, ``N``."""
    text = _REFERENCES.sub("", markdown)
    text = _FENCE.sub("", text)
    text = _COMMENT.sub("", text)
    text = _DISPLAY_MATH.sub("", text)
    text = _INLINE_MATH.sub("", text)
    text = _GLUE.sub("N", text)
    text = _ROLE.sub(r"\1", text)
    text = _LINK.sub(r"\1", text)
    return text


def words(text: str) -> int:
    return len(_WORD.findall(text))


def typed_numbers(markdown: str) -> List[str]:
    """Times, ratios and rates typed by hand in a page's prose (inline code aside)."""
    text = re.sub(r"`[^`\n]*`", "", prose(markdown))
    return [m.group(0) for m in TYPED.finditer(text)]


def glue_keys_used(markdown: str) -> List[str]:
    return re.findall(r"\{glue(?::\w+)?\}`([^`:]+)", markdown)
