"""ptq.opdocs.whitepaper: the 79 chapter-4 sections, the ops' `section` attributes mapped onto them, and the count
`ptq ops` prints."""
from __future__ import annotations

import re
from pathlib import Path

from ops import get_op
from ptq.opdocs.whitepaper import SECTIONS, implemented_summary, ops_by_section, sections_of

SEED = Path("/work/shared/seeds/002_cc45d858d73c34f6.txt")


def test_there_are_79_sections_numbered_in_order():
    assert [n for n, _ in SECTIONS] == [f"4.{i}" for i in range(1, 80)]
    assert dict(SECTIONS)["4.8"] == "BiasAdd" and dict(SECTIONS)["4.79"] == "Where"


def test_section_names_match_the_whitepaper_headings_where_the_seed_is_present():
    if not SEED.exists():  # the seed lives outside the repository; the names above are checked when it is there
        return
    text = SEED.read_text(encoding="utf-8")
    headings = dict(re.findall(r"^#+ *\**(4\.\d+)\** *\**([A-Za-z0-9]+)", text, flags=re.M))
    assert headings, "no chapter 4 heading found"
    for number, name in headings.items():
        if number in dict(SECTIONS):
            assert dict(SECTIONS)[number].lower() == name.lower(), number


def test_sections_of_splits_on_slash_and_ignores_notes_and_other_chapters():
    assert sections_of(get_op("MaxPool")) == ["4.43", "4.44"]
    assert sections_of(get_op("Clip")) == ["4.11", "4.55"]
    assert sections_of(get_op("Conv")) == ["4.14", "4.22", "4.35"]
    assert sections_of(get_op("ScaledMatMul", "ai.ptq")) == ["4.42"]
    assert sections_of(get_op("Erf")) == []


def test_every_section_has_an_op():
    table = ops_by_section()
    assert [n for n, ops in table.items() if not ops] == []
    assert implemented_summary() == "79 of 79 whitepaper chapter-4 operators implemented"


def test_a_missing_section_is_counted_and_named(monkeypatch):
    monkeypatch.setattr(type(get_op("BiasAdd", "ai.ptq")), "section", "")
    assert implemented_summary() == "78 of 79 whitepaper chapter-4 operators implemented; missing: 4.8 BiasAdd"
