"""MkDocs hooks (mkdocs.yml `hooks:`) that let one Markdown source read right on GitHub and in the built guide.

A `|` inside a code span in a table row must be written `\\|` for GitHub, which drops the backslash; Python-Markdown
already keeps pipes inside code spans in their cell and would print the backslash.
"""
from __future__ import annotations

import re

CODE_SPAN = re.compile(r"`[^`\n]*`")


def unescape_table_pipes(markdown: str) -> str:
    """`\\|` -> `|` inside the code spans of table rows (lines starting with `|`); everything else as it is."""
    lines = []
    for line in markdown.split("\n"):
        if line.lstrip().startswith("|"):
            line = CODE_SPAN.sub(lambda span: span.group(0).replace("\\|", "|"), line)
        lines.append(line)
    return "\n".join(lines)


def on_page_markdown(markdown: str, **kwargs) -> str:
    return unescape_table_pipes(markdown)
