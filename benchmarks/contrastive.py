"""Section 7: a loss that couples the window's items (in-batch negatives), per window.

One window of N (anchor, positive) text pairs on a tiny BERT sentence-transformers model (built from a
config, no download), the multiple-negatives ranking loss, side by side in one run:

* the big batch (the baseline: all N pairs in one forward and backward, where it fits);
* ``gradaccum.WindowLoss`` with micro-batches of m pairs, through ``Accumulator.step``, keeping 0, 1,
  half and all but one of the micro-batches' pass-1 graphs (``keep_graphs``: their forward is not run
  again);
* sentence-transformers' ``CachedMultipleNegativesRankingLoss(mini_batch_size=m)``, its own cached
  loss for this very objective (m sequences per forward);
* plain accumulation over micro-batches of m pairs (the other objective, for its distance).

Each takes one SGD step (lr 1, so the parameters move by the gradient). Time per window is the median
over rotated repeats (one thread, CPU time of this thread); peak memory is measured by PeakMeter
around one window; the distance is the largest parameter difference from the float64 big batch's
step, with dropout off so that the big batch is one deterministic target, relative to the largest
change that step made.
"""
from __future__ import annotations

import copy
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

from common import QUICK, between_markers, median, paired_ratio, side_by_side

from gradaccum import Accumulator, WindowLoss
from gradaccum.memory import PeakMeter

PAIRS = 32 if QUICK else 64
MICRO = 8 if QUICK else 16
REPEATS = 3 if QUICK else 9
WINDOW = PAIRS // MICRO  # micro-batches per window
KEEPS = [0, 1, WINDOW // 2, WINDOW - 1]  # pass-1 graphs kept: none (caching alone), the default, half, all but one


def _model(folder: Path, hidden: int = 64) -> Any:
    """A tiny BERT (``hidden`` wide, 2 layers) behind mean pooling, saved to ``folder`` and loaded by
    sentence-transformers as a local model (no download)."""
    from transformers import BertConfig, BertModel, BertTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.models import Pooling, Transformer
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(995)]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizer(vocab=str(folder / "vocab.txt")).save_pretrained(folder)  # transformers 5 reads vocab=
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=2 * hidden, max_position_embeddings=128)).save_pretrained(folder)
    return SentenceTransformer(modules=[Transformer(str(folder)), Pooling(hidden, "mean")], device="cpu")


def _features(n: int, seed: int) -> Dict[str, Any]:
    """``n`` token sequences of 6 to 32 tokens, padded: the features sentence-transformers' forward takes."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 33, (n,), generator=g)
    ids = torch.zeros(n, int(lengths.max()), dtype=torch.long)
    for i, length in enumerate(lengths.tolist()):
        ids[i, :length] = torch.randint(5, 1000, (length,), generator=g)
        ids[i, 0], ids[i, length - 1] = 2, 3
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "token_type_ids": torch.zeros_like(ids)}


def _contenders(base: Any, batch: Dict[str, Dict[str, Any]]) -> Dict[str, Callable[[], Any]]:
    """Each contender's one window on a model of its own (the same initial weights), by name."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers.losses import CachedMultipleNegativesRankingLoss, MultipleNegativesRankingLoss
    columns = [batch["anchor"], batch["positive"]]
    out: Dict[str, Callable[[], Any]] = {}
    models: Dict[str, Any] = {}

    def fresh(name: str) -> Any:
        models[name] = copy.deepcopy(base)
        return models[name], torch.optim.SGD(models[name].parameters(), lr=1.0)

    big, big_opt = fresh("big batch")
    big_loss = MultipleNegativesRankingLoss(big)

    def big_batch() -> None:
        big_opt.zero_grad()
        big_loss([dict(c) for c in columns], None).backward()  # a copy: the model writes its outputs into it
        big_opt.step()

    embed = lambda m, mb: tuple(m(dict(mb[k]))["sentence_embedding"] for k in ("anchor", "positive"))  # noqa: E731
    windowed: Dict[str, Callable[[], Any]] = {}
    for keep in KEEPS:
        ours, ours_opt = fresh(f"WindowLoss keep {keep}")
        ours_loss = MultipleNegativesRankingLoss(ours)
        window_loss = WindowLoss(embed, lambda m, reps, fn=ours_loss: fn.compute_loss_from_embeddings(list(reps), None),
                                 keep_graphs=keep)
        acc = Accumulator(ours, ours_opt)
        windowed[f"WindowLoss keep {keep}"] = lambda acc=acc, wl=window_loss: acc.step(batch, wl, micro_batch_size=MICRO)

    st, st_opt = fresh("CachedMNRL")
    st_loss = CachedMultipleNegativesRankingLoss(st, mini_batch_size=MICRO)

    def cached_mnrl() -> None:
        st_opt.zero_grad()
        st_loss([dict(c) for c in columns], None).backward()
        st_opt.step()

    plain, plain_opt = fresh("plain accumulation")
    plain_loss = MultipleNegativesRankingLoss(plain)
    plain_acc = Accumulator(plain, plain_opt)
    out = {"big batch": big_batch, **windowed,
           "CachedMNRL": cached_mnrl,
           "plain accumulation": lambda: plain_acc.step(
               batch, lambda m, mb: plain_loss.compute_loss_from_embeddings(list(embed(m, mb)), None),
               micro_batch_size=MICRO)}
    out["_models"] = models  # type: ignore[assignment]
    return out


def _distances(base: Any, batch: Dict[str, Dict[str, Any]]) -> Dict[str, float]:
    """Each contender's one step in float64 with dropout off, against the big batch's."""
    model = copy.deepcopy(base).double().eval()
    runs = _contenders(model, batch)
    models = runs.pop("_models")
    before = [p.detach().clone() for p in model.parameters()]
    for fn in runs.values():
        fn()
    moved = {name: [p.detach() - b for p, b in zip(m.parameters(), before)] for name, m in models.items()}
    scale = max(d.abs().max().item() for d in moved["big batch"])
    return {name: max((a - b).abs().max().item() for a, b in zip(moved[name], moved["big batch"])) / scale
            for name in runs}


def contrastive() -> List[Dict[str, Any]]:
    """The table at two widths: the backward's share of the time grows with the width (matrix work)."""
    return [_at(hidden) for hidden in (64, 256)]


def _at(hidden: int) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        base = _model(Path(folder), hidden)
    batch = {"anchor": {**_features(PAIRS, 1), "modality": "text"},
             "positive": {**_features(PAIRS, 2), "modality": "text"}}
    distance = _distances(base, batch)
    runs = _contenders(base.train(), batch)  # float32, dropout on: what training runs
    runs.pop("_models")
    runs.pop("plain accumulation")  # the other objective: its time says nothing
    samples = side_by_side(runs, REPEATS)
    peaks: Dict[str, int] = {}
    for name, fn in runs.items():
        with PeakMeter("cpu") as meter:
            fn()
        peaks[name] = meter.result.peak_bytes
    rows: List[Dict[str, Any]] = []
    for name in ["big batch", *[f"WindowLoss keep {k}" for k in KEEPS], "CachedMNRL", "plain accumulation"]:
        row: Dict[str, Any] = {"contender": name, "distance": distance[name]}
        if name in samples:
            ratio = paired_ratio(samples, name, "big batch")
            row.update(ms=median(samples[name]) * 1e3, time_ratio=ratio["ratio"], q1=ratio["q1"], q3=ratio["q3"],
                       peak_mib=peaks[name] / 2**20, memory_ratio=peaks[name] / peaks["big batch"])
        rows.append(row)
    return {"pairs": PAIRS, "micro_batch": MICRO, "repeats": REPEATS, "hidden": hidden, "rows": rows}


# -- the WindowLoss table of docs/guides/contrastive.md ---------------------------------------------------

GUIDE = ("<!-- bench:contrastive: written by make bench (benchmarks/contrastive.py), do not edit -->",
         "<!-- /bench:contrastive -->")


def render_guide(sizes: List[Dict[str, Any]]) -> str:
    """The contrastive guide's table (the wider model first) and the figures its text compares, from a run of
    :func:`contrastive` (one record per width)."""
    def label(contender: str, window: int) -> str:
        if contender == "CachedMNRL":
            return "sentence-transformers' `CachedMultipleNegativesRankingLoss`"
        keep = int(contender.rsplit(" ", 1)[1])
        note = {0: " (caching alone)", 1: " (the default)", window // 2: " (half)"}.get(keep, "")
        return f"`keep_graphs={keep}`{note}"

    lines = ["| width | per window | time / big batch | peak memory / big batch |", "|---|---|---|---|"]
    by_width = {}
    for c in sorted(sizes, key=lambda c: -c["hidden"]):
        rows = {r["contender"]: r for r in c["rows"] if "time_ratio" in r and r["contender"] != "big batch"}
        by_width[c["hidden"]] = rows
        lines += [f"| {c['hidden']} | {label(name, c['pairs'] // c['micro_batch'])} | {r['time_ratio']:.2f} | "
                  f"{r['memory_ratio']:.2f} |" for name, r in rows.items()]
    wide, narrow = (by_width[w] for w in sorted(by_width, reverse=True)[:2])
    half = f"WindowLoss keep {(sizes[0]['pairs'] // sizes[0]['micro_batch']) // 2}"
    distance = max(r["distance"] for c in sizes for r in c["rows"] if r["contender"].startswith("WindowLoss"))
    lines += ["", f"Keeping 1 graph peaks at {narrow['WindowLoss keep 1']['memory_ratio']:.2f} of the big batch against "
              f"caching alone's {narrow['WindowLoss keep 0']['memory_ratio']:.2f} at the narrow width "
              f"({wide['WindowLoss keep 1']['memory_ratio']:.2f} and {wide['WindowLoss keep 0']['memory_ratio']:.2f} at "
              f"the wide one); half the graphs kept comes to {wide[half]['time_ratio']:.2f}x at about half the big "
              f"batch's memory at the wide width, {narrow[half]['time_ratio']:.2f}x at the narrow one. Every "
              f"`WindowLoss` row is the big batch's step to float64 rounding (distance at most {distance:.0e})."]
    return "\n".join(lines) + "\n"


def write_guide(sizes: List[Dict[str, Any]], path: Path) -> None:
    """The guide's table between its markers, from this run (a path without the markers gets it alone)."""
    path.write_text(between_markers(path.read_text() if path.exists() else "", *GUIDE, render_guide(sizes)))


# -- sentence-transformers' trainer, per loss: the table of docs/guides/sentence-transformers.md ---------

ST_TABLE = ("<!-- st-losses: written by make bench (benchmarks/contrastive.py), do not edit -->",
            "<!-- /st-losses -->")


def st_losses() -> List[Dict[str, Any]]:
    """Per loss of issue #33 item 1: one SGD step of the stock ``SentenceTransformerTrainer`` with 6 rows
    x 4 accumulation steps and of ``ExactSentenceTransformerTrainer`` with the same, each against the
    stock trainer's one batch of 24 rows (float64, a BERT from a config with mean pooling); the distance
    is relative to the largest change the big batch's step made."""
    import sys

    from common import ROOT

    sys.path.insert(0, str(ROOT / "tests" / "integrations"))
    from st_helpers import dataset, distance, fresh, losses, moved, tiny_model, train_once

    from sentence_transformers import SentenceTransformerTrainer

    from gradaccum.integrations.sentence_transformers import ExactSentenceTransformerTrainer

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        base, guide = tiny_model(tmp / "model"), tiny_model(tmp / "guide", seed=1)
        for name, (kind, make) in losses(base, guide).items():
            data = dataset(kind, 24)
            runs = {}
            for label, cls, batch, accumulation in (("big", SentenceTransformerTrainer, 24, 1),
                                                    ("stock", SentenceTransformerTrainer, 6, 4),
                                                    ("exact", ExactSentenceTransformerTrainer, 6, 4)):
                model = fresh(base)
                train_once(cls, model, make(model), data, tmp / "out", batch=batch, accumulation=accumulation)
                runs[label] = moved(base, model)
            rows.append({"loss": name, "columns": kind, "stock": distance(runs["stock"], runs["big"]),
                         "exact": distance(runs["exact"], runs["big"])})
    return rows


def write_st_table(rows: List[Dict[str, Any]], page: Path) -> None:
    """The per-loss table between the page's markers."""
    lines = ["| loss | dataset | stock trainer, 6 x 4 | ExactSentenceTransformerTrainer, 6 x 4 |", "|---|---|---|---|"]
    lines += [f"| {r['loss']} | {r['columns']} | {r['stock']:.1e} | {r['exact']:.1e} |" for r in rows]
    text = page.read_text()
    start, end = text.index(ST_TABLE[0]) + len(ST_TABLE[0]), text.index(ST_TABLE[1])
    page.write_text(text[:start] + "\n" + "\n".join(lines) + "\n" + text[end:])
