"""CLIP-style contrastive training with in-batch negatives, 64 pairs per step in micro-batches of 16.

Each image's loss depends on every caption of the batch (they are its negatives), so accumulating
micro-batch losses trains another objective: each image would only see 15 negatives, not 63.
gradaccum's WindowLoss caches the micro-batches' embeddings, computes the loss once over the whole
window, and backpropagates each micro-batch's share: every step is the 64-pair batch's step.

Run: python examples/contrastive.py   (float64 on the CPU, a few seconds)
"""
import copy
import math

import torch
from torch import nn

from gradaccum import Accumulator, WindowLoss

torch.manual_seed(0)
PAIRS, MICRO, STEPS, VOCAB = 64, 16, 8, 40


class CLIP(nn.Module):
    """An image tower, a caption tower (mean of token embeddings, padding ignored) and a learned
    temperature, as in CLIP."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 16))
        self.words = nn.Embedding(VOCAB, 16, padding_idx=0)
        self.logit_scale = nn.Parameter(torch.tensor([math.log(1 / 0.07)]))

    def forward(self, images, tokens):
        mask = (tokens != 0).unsqueeze(-1).to(self.words.weight.dtype)
        captions = (self.words(tokens) * mask).sum(1) / mask.sum(1)
        return self.image(images), captions


def clip_loss(model, embeddings):
    """Symmetric cross-entropy over the window's image-caption similarities."""
    images, captions = (nn.functional.normalize(e, dim=-1) for e in embeddings)
    logits = images @ captions.T * model.logit_scale.exp()
    target = torch.arange(len(images))
    return (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.T, target)) / 2


def batch(step):
    """64 pairs: an image of class c and a caption of 2 to 6 tokens drawn from c's words (padded)."""
    g = torch.Generator().manual_seed(step)
    classes = torch.randint(0, 8, (PAIRS,), generator=g)
    images = torch.randn(8, 32, generator=g)[classes] + 0.5 * torch.randn(PAIRS, 32, generator=g)
    lengths = torch.randint(2, 7, (PAIRS,), generator=g)
    words = 1 + classes[:, None] * 4 + torch.randint(0, 5, (PAIRS, 6), generator=g)
    tokens = torch.where(torch.arange(6) < lengths[:, None], words.clamp(max=VOCAB - 1), 0)
    return images.double(), tokens


model = CLIP().double().eval()  # dropout off, so all three runs draw nothing: comparable step by step
big, plain = copy.deepcopy(model), copy.deepcopy(model)
opts = [torch.optim.AdamW(m.parameters(), lr=2e-2) for m in (model, big, plain)]

acc = Accumulator(model, opts[0])
contrastive = WindowLoss(encode=lambda m, mb: m(*mb), loss=clip_loss)
plain_acc = Accumulator(plain, opts[2])
per_micro_batch = lambda m, mb: clip_loss(m, m(*mb))  # noqa: E731 - plain accumulation: 15 negatives each

for step in range(STEPS):
    data = batch(step)
    result = acc.step(data, contrastive, micro_batch_size=MICRO)
    plain_acc.step(data, per_micro_batch, micro_batch_size=MICRO)
    opts[1].zero_grad()
    clip_loss(big, big(*data)).backward()  # the reference: one big batch of 64 pairs
    opts[1].step()
    print(f"step {result.step}: loss {result.loss:.4f} over {result.num_items} pairs "
          f"in {result.micro_batches} micro-batches")


def distance(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


print(f"distance from one big batch after {STEPS} steps: WindowLoss {distance(model, big):.1e}, "
      f"plain accumulation {distance(plain, big):.1e}")
