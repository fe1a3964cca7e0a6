"""Issue #33 item 4: the refusal of an unknown compute_loss no longer leads a loss that couples the
batch's rows into ``exact_items = 'rows'``, and a sentence-transformers trainer cannot declare it."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")
from transformers import Trainer  # noqa: E402

from gradaccum.integrations.hf_trainer import ExactTrainer  # noqa: E402


def test_the_refusal_says_rows_must_be_independent_and_where_a_coupled_loss_goes():
    class Mine(Trainer):
        def compute_loss(self, model, inputs, **kwargs):  # pragma: no cover - never run
            return None

    with pytest.raises(TypeError, match=r"each row's term independent of the other rows.*couples the rows.*"
                                        r"compute_loss_func=WindowLoss"):
        type("Exact", (ExactTrainer, Mine), {})


def test_a_sentence_transformers_trainer_is_refused_even_when_it_declares_rows():
    st = pytest.importorskip("sentence_transformers")
    for declared in ({}, {"exact_items": "rows"}):
        with pytest.raises(TypeError, match=r"couple the batch's rows.*ExactSentenceTransformerTrainer"):
            type("X", (ExactTrainer, st.SentenceTransformerTrainer), dict(declared))
