"""Notes for the user: something ptq inferred from, or changed in, what the user wrote (a hand-edited quant
table whose scale was rounded to float32, a range whose scale was recomputed).

Library code issues them as `warnings.warn(text, Note)` (Python shows each distinct text once per process;
tests catch them with `pytest.warns(Note)`); the command line prints each as one line, `ptq CMD: note: text`.
"""
from __future__ import annotations


class Note(UserWarning):
    """A one-line note for the user about their input (not an error: ptq went on)."""
