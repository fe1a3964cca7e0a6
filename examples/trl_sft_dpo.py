"""Exact gradient accumulation in TRL's SFT and DPO trainers (docs/guides/trl.md).

A tiny float64 GPT-2 built from a config (its ``loss_type`` is None, so stock SFT counts unshifted
labels) and a tiny Llama, a word-level tokenizer made here (nothing is downloaded). SFT: 10 sequences
in micro-batches of 2, ``gradient_accumulation_steps=2`` (windows of 4, 4 and 2 sequences). DPO: 19
pairs, so the last window holds micro-batches of 2 and 1 pairs. Each run is compared with one step
per window through the trainer's own loss over the window's examples as one batch:

    python examples/trl_sft_dpo.py

prints the largest parameter difference (Delta) of the Exact trainer and of TRL's own accumulation.
TRL's fused LM head accumulates in float32 (and projects in bf16 under its default ``bf16=True``),
so about 1e-9 is that kernel's rounding, not the weighting.
"""
from __future__ import annotations

import copy
import tempfile

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from gradaccum.integrations.trl import ExactDPOTrainer, ExactSFTTrainer

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
VOCAB, LR = 50, 0.1
word_level = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
TOKENIZER = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="t0", eos_token="t0")

g = torch.Generator().manual_seed(0)
SEQUENCES = [{"input_ids": torch.randint(1, VOCAB, (int(torch.randint(3, 20, (1,), generator=g)),),
                                         generator=g).tolist()} for _ in range(10)]


def words(n_min, n_max):
    n = int(torch.randint(n_min, n_max, (1,), generator=g))
    return " ".join(f"t{i}" for i in torch.randint(2, VOCAB, (n,), generator=g).tolist())


PAIRS = [{"prompt": words(2, 6) + " ", "chosen": words(1, 8) + " t0", "rejected": words(1, 8) + " t0"}
         for _ in range(19)]


def trainer(cls, model, examples):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    dpo = issubclass(cls, DPOTrainer)
    args = (DPOConfig if dpo else SFTConfig)(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_train_epochs=1, max_grad_norm=0.0, max_length=None, report_to="none", save_strategy="no",
        use_cpu=True, disable_tqdm=True, train_sampling_strategy="sequential", logging_steps=1)
    extra = {"ref_model": copy.deepcopy(model)} if dpo else {}  # DPO's frozen starting point
    return cls(model=model, args=args, train_dataset=Dataset.from_list(examples), processing_class=TOKENIZER,
               optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)), **extra)


def one_big_batch_per_window(cls, model, examples):
    """TRL's own loss over each window's (prepared) examples collated into one batch, one step each."""
    t = trainer(cls, model, examples)
    rows = [t.train_dataset[i] for i in range(len(t.train_dataset))]
    t.model.train()
    for start in range(0, len(rows), 4):
        t.optimizer.zero_grad()
        with t.accelerator.autocast():
            t.compute_loss(t.model, t.data_collator(rows[start:start + 4])).backward()
        t.optimizer.step()
    return t.model


def delta(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def trained(cls, model, examples):
    t = trainer(cls, model, examples)
    t.remove_callback(transformers.PrinterCallback)
    t.train()
    return t.model


if __name__ == "__main__":
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)).double()
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                         use_cache=False, pad_token_id=0)).double()
    for name, exact, stock, model, examples in (("SFT, 10 sequences", ExactSFTTrainer, SFTTrainer, gpt2, SEQUENCES),
                                                ("DPO, 19 pairs", ExactDPOTrainer, DPOTrainer, llama, PAIRS)):
        ref = one_big_batch_per_window(stock, model, examples)
        print(f"{name}, windows of 4: Delta from one big batch per window: {exact.__name__} "
              f"{delta(trained(exact, model, examples), ref):.1e}, stock {stock.__name__} "
              f"{delta(trained(stock, model, examples), ref):.1e}")
