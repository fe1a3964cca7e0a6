"""What a guide's fragment takes as given, for tests/test_guides.py: ``<!-- run with: NAME -->`` before
a block runs it after ``NAME(tmp_path)`` has put these names into its namespace. Each setup builds
the smallest thing of the kind the guide names (a tiny float64 GPT-2 from a config and its padded
micro-batches; a tiny CLIP; a dual encoder of one's own), nothing downloaded."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict


def _args(tmp_path: Path, **kwargs: Any):
    from transformers import TrainingArguments

    return TrainingArguments(str(tmp_path / "trainer"), max_steps=2, learning_rate=0.1, optim="sgd",
                             report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False, **kwargs)


def hf_trainer_gpt2(tmp_path: Path) -> Dict[str, Any]:
    """``model``, ``args``, ``ds``, ``collator``: a tiny GPT-2, 2 steps of 2 micro-batches of one
    pre-padded batch each."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_helpers import pad

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=64, n_embd=16, n_layer=1, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).double()
    g = torch.Generator().manual_seed(0)
    ds = [pad([torch.randint(1, 50, (int(n),), generator=g) for n in torch.randint(3, 20, (k,), generator=g)])
          for k in (2, 1, 3, 2)]
    return dict(model=model, args=_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2),
                ds=ds, collator=lambda items: items[0])


def hf_trainer_clip(tmp_path: Path) -> Dict[str, Any]:
    """``clip_model``, ``args``, ``pairs``, ``collate``: a tiny CLIP and 8 image-caption pairs."""
    from integrations import clip_helpers as C

    return dict(clip_model=C.clip("clip"), args=_args(tmp_path, per_device_train_batch_size=2,
                                                     gradient_accumulation_steps=2),
                pairs=C.pairs(8), collate=C.collate)


def hf_trainer_own_model(tmp_path: Path) -> Dict[str, Any]:
    """``model`` (two towers and a ``log_scale``), ``args``, ``pairs``, ``collate``, and ``torch`` and
    ``F`` as a script that uses them imports them."""
    import torch
    import torch.nn.functional as F

    from integrations import clip_helpers as C

    return dict(model=C.DualEncoder(), args=_args(tmp_path, per_device_train_batch_size=2,
                                                  gradient_accumulation_steps=2),
                pairs=C.pairs(8), collate=C.collate, torch=torch, F=F)
