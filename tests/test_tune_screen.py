"""`minimize`'s screened bisections (`ptq.tuning.screen`): a head is decided on the hardest photos with the others
predicted, and the head chosen is verified on every photo; when it falls short there, a longer one is taken by a
full bisection, so the tuned table reaches the goal on the full validation set."""
from __future__ import annotations

import numpy as np
import pytest

from ptq.core.graph import load_model
from ptq.table.quant_table import load_quant_table
from ptq.tuning.data import Score, Validation
from ptq.tuning.early_stop import PassRule
from ptq.tuning.screen import Screen
from reports.tables import with_bits
from tests.test_tune import setup

ORDER = ["c3", "a2", "out", "a1", "input", "c1", "c2"]  # the chain's activations, most useful first
HARD, EASY = (0, 1, 2), (3, 4, 5, 6)  # photos (one sample each): the screen scores the 3 hardest of 7


class _Photos:
    """A scorer (`ptq.tuning.data.Scorer`): photo p's cosine is 0.9985 (hard) or 0.9999 (easy), minus, for each
    tensor in 8 bits, 0.0001 on the hard photos; `trap` in 8 bits costs the easy photos 0.01 (the hard ones do not
    show it)."""

    def __init__(self, trap=None):
        self.trap, self.passes = trap, []

    def cosines(self, graph, table, float_nodes, samples=None):
        narrow = [n for n in ORDER if table.tensors[n].qparams.bits != 16]
        samples = list(range(7)) if samples is None else list(samples)
        self.passes.append(samples)
        return [0.9985 - 0.0001 * len(narrow) if p in HARD else 0.9999 - (0.01 if self.trap in narrow else 0.0)
                for p in samples]


def _tuner(tmp_path, scorer):
    from ptq.tuning.tuner import _State, _Tuner

    model_path, table_path = setup(tmp_path)
    table, graph = load_quant_table(table_path), load_model(model_path)
    check = Validation([{}] * 7, [np.ones(1)] * 7, scorer=scorer)
    tuner = _Tuner(graph, table, None, check, 0.998, 2.0, 1e-5)
    tuner.order = HARD + EASY  # hardest first
    wide = with_bits(table, ORDER, 16)
    tuner.saved = {n: table.tensors[n] for n in ORDER}
    tuner.state = _State(wide, graph, check.cosine(graph, wide), int16=list(ORDER))
    return tuner, table, wide, check


def test_the_prediction_lowers_the_unscored_photos_by_the_mean_drop_of_the_scored():
    screen = Screen.of([0.999, 0.998, 0.9995, 0.997], order=(3, 1, 0, 2), fraction=0.5, least=1)
    assert screen.photos == 2 and screen.scored == (1, 3)
    partial = Score.of([0.997, 0.9955])  # photos 1 and 3: drops 0.001 and 0.0015, mean 0.00125
    want = Score.of([0.999 - 0.00125, 0.997, 0.9995 - 0.00125, 0.9955])
    assert screen.predicted(partial).mean == pytest.approx(want.mean, abs=1e-12)
    assert screen.predicted(partial).sem == pytest.approx(want.sem, abs=1e-12)
    gained = screen.predicted(Score.of([0.9985, 0.9975]))  # better than the start: the others stay at theirs
    assert gained.photo_means == pytest.approx((0.999, 0.9985, 0.9995, 0.9975))
    assert Screen.of([0.99, 0.98], fraction=0.5, least=1).photos == 1 and Screen.of([0.99], least=1) is None
    assert Screen.of([0.99] * 7).photos == 3 and Screen.of([0.99] * 3) is None  # 3 photos at least, some left


def test_a_screened_pass_scores_only_the_photos_of_its_order(tmp_path):
    tuner, table, wide, check = _tuner(tmp_path, _Photos())
    score = check.cosine(tuner.state.graph, wide, rule=PassRule(0.998, 2.0, HARD))
    assert score.screened and score.scored == 3 and score.photo_means == pytest.approx((0.9985,) * 3)
    out = check.cosine(tuner.state.graph, table, rule=PassRule(0.9999, 2.0, HARD))  # out of reach at once
    assert not out.screened and out.scored == 1


def test_a_screened_head_that_falls_short_on_every_photo_is_replaced_by_a_longer_one(tmp_path):
    scorer = _Photos(trap="c1")  # c1 in 8 bits costs the easy photos, which the screen does not score
    tuner, table, wide, check = _tuner(tmp_path, scorer)
    tuner.shortest_head([[n] for n in ORDER], "16-bit tensors")
    changes = [(s.change, s.kept) for s in tuner.steps]
    assert ("back to 8/8 bits, verified on every photo: all but the 1 most useful of 7 16-bit tensors", False) \
        in changes  # screened: c3 alone
    assert sorted(tuner.state.int16) == sorted(ORDER[:6])  # c1 needed: only c2 goes back to 8 bits
    assert tuner.done() and tuner.state.score.scored is None and not tuner.state.score.screened
    full = Validation(check.inputs, check.reference, scorer=_Photos(trap="c1")).cosine(tuner.state.graph,
                                                                                        tuner.state.table)
    assert tuner.state.score == full and full.bound(2.0) >= 0.998
    for n in ORDER:
        assert tuner.state.table.tensors[n] == (wide if n in tuner.state.int16 else table).tensors[n]


def test_a_screened_head_that_reaches_on_every_photo_is_kept_with_the_full_score(tmp_path):
    scorer = _Photos()
    tuner, table, wide, check = _tuner(tmp_path, scorer)
    tuner.shortest_head([[n] for n in ORDER], "16-bit tensors")
    screened = [s for s in tuner.steps if s.screened]
    assert screened and all(s.scored == 3 for s in screened)
    assert [s.change for s in tuner.steps if not s.screened] == \
        ["back to 8/8 bits, verified on every photo: all but the 1 most useful of 7 16-bit tensors"]
    assert tuner.state.int16 == ["c3"] and tuner.done()
    assert tuner.state.score == Validation(check.inputs, check.reference, scorer=_Photos()).cosine(
        tuner.state.graph, tuner.state.table)
    assert sum(len(p) for p in scorer.passes) < 7 * (1 + len(tuner.steps))  # fewer photos than full passes


def test_each_initializer_is_digested_once_and_a_new_array_changes_the_step_key(tmp_path):
    from ptq.engine.executor import prepare
    from ptq.engine.quantize_memo import ObjectDigests
    from ptq.tuning.prefix_cache import step_key
    from ptq.tuning.tuner import with_biases

    model_path, table_path = setup(tmp_path)
    table, graph = load_quant_table(table_path), load_model(model_path)
    digests = ObjectDigests()
    first = prepare(graph, table)
    keys = [step_key(first, i, digests) for i in range(len(first.steps))]
    held = dict(digests.by_id)
    again = prepare(graph, table)
    assert [step_key(again, i, digests) for i in range(len(again.steps))] == keys
    assert digests.by_id == held  # the same arrays: no new digest
    assert keys == [step_key(first, i) for i in range(len(first.steps))]  # as digesting every array again
    bias = next(n for n in graph.initializers if n.startswith("B"))
    moved = prepare(with_biases(graph, {bias: graph.initializers[bias] + 1}), table)
    changed = [i for i in range(len(moved.steps)) if step_key(moved, i, digests) != keys[i]]
    assert len(changed) == 1 and bias in moved.steps[changed[0]].node.inputs
