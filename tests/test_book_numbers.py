"""The book's prose states no measured number by hand, and each chapter stays readable.

Every time, ratio or rate in a chapter's prose (and the introduction's) is pasted from
the recorded results by the notebook that reads them; a number typed into the prose
could disagree with the figures the moment the results are measured again.
"""
import json
import re

import pytest

import book_rules as rules

PAGES = [rules.BOOK / f"{c}.ipynb" for c in rules.CHAPTERS] + [rules.BOOK / "intro.ipynb"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_measured_number_typed_by_hand(page):
    typed = rules.typed_numbers(rules.markdown_of(page))
    assert not typed, f"{page.name} types these numbers by hand; glue them from book/results: {typed}"


@pytest.mark.parametrize("chapter", rules.CHAPTERS)
def test_chapter_prose_within_the_word_limit(chapter):
    count = rules.words(rules.prose(rules.markdown_of(rules.BOOK / f"{chapter}.ipynb")))
    assert count <= rules.MAX_PROSE_WORDS, f"{chapter}: {count} words of prose"


@pytest.mark.parametrize("chapter", rules.CHAPTERS)
def test_every_pasted_number_is_glued_by_the_chapter(chapter):
    cells = json.loads((rules.BOOK / f"{chapter}.ipynb").read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    glued = set(re.findall(r"""glue(?:_number)?\(\s*f?["']([\w-]+)["']""", code))
    used = set(rules.glue_keys_used(rules.markdown_of(rules.BOOK / f"{chapter}.ipynb")))
    assert used <= glued, f"{chapter} pastes keys no cell glues: {sorted(used - glued)}"


def test_the_rules_see_what_they_must():
    text = "It runs in 0.67 ms, 4.4 times faster (91x; 2.5×) at 3.1 TB/s, 60% of the floor."
    assert len(rules.typed_numbers(text)) == 6
    assert rules.typed_numbers("a 3 × 3 matrix, {glue}`ctc_ratio` faster, `T = 40 ms`, $2^{25}$") == []
    assert rules.words(rules.prose("Two words\n\n```python\nignored code\n```\n")) == 2
