"""CLIP-style contrastive training with in-batch negatives, 64 pairs per step in micro-batches of 16.

Each image's loss depends on every caption of the batch (they are its negatives), so accumulating
micro-batch losses trains another objective: each image would only see 15 negatives, not 63.
gradaccum's WindowLoss caches the micro-batches' embeddings, computes the loss once over the whole
window, and backpropagates each micro-batch's share: every step is the 64-pair batch's step.

It prints the loss of each step (the window's mean over its 64 pairs) and, before and after
training, two numbers on 64 held-out pairs that show it learning: their loss, and how often each
image's most similar caption is one of its own class. At the start the logits are sharp and
random, so the loss is far above chance (ln 64 = 4.16: every caption equally likely); a model that
tells the 8 classes apart but not the pairs within a class gets about ln 8 = 2.08, and 100%.

Run: python examples/contrastive.py   (float64 on the CPU, a few seconds)
"""
import copy
import math

import torch
from torch import nn

from gradaccum import Accumulator, WindowLoss

torch.manual_seed(0)
PAIRS, MICRO, STEPS, VOCAB, CLASSES = 64, 16, 8, 40, 8
CENTERS = torch.randn(CLASSES, 32, generator=torch.Generator().manual_seed(8))  # each class's image, fixed


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


def sample(seed):
    """64 pairs: an image of class c (its class's image, plus noise) and a caption of 2 to 6 tokens
    drawn from c's words (padded); and the classes."""
    g = torch.Generator().manual_seed(seed)
    classes = torch.randint(0, CLASSES, (PAIRS,), generator=g)
    images = CENTERS[classes] + 0.5 * torch.randn(PAIRS, 32, generator=g)
    lengths = torch.randint(2, 7, (PAIRS,), generator=g)
    words = 1 + classes[:, None] * 4 + torch.randint(0, 5, (PAIRS, 6), generator=g)
    tokens = torch.where(torch.arange(6) < lengths[:, None], words.clamp(max=VOCAB - 1), 0)
    return images.double(), tokens, classes


def batch(step):
    images, tokens, _ = sample(step)
    return images, tokens


def held_out(model, when):
    """The loss on 64 pairs never trained on, and how often each image's top caption is of its class."""
    with torch.no_grad():
        pictures, tokens, classes = sample(10_000)
        embeddings = model(pictures, tokens)
        loss = clip_loss(model, embeddings).item()
        images, captions = (nn.functional.normalize(e, dim=-1) for e in embeddings)
        top = (images @ captions.T).argmax(1)  # the caption most similar to each image
    same = (classes[top] == classes).double().mean().item()
    print(f"held-out pairs {when}: loss {loss:.2f} (chance {math.log(PAIRS):.2f}), top caption of the image's "
          f"class {same:.0%} (chance {1 / CLASSES:.1%})")


model = CLIP().double().eval()  # dropout off, so all three runs draw nothing: comparable step by step
big, plain = copy.deepcopy(model), copy.deepcopy(model)
opts = [torch.optim.AdamW(m.parameters(), lr=2e-2) for m in (model, big, plain)]

acc = Accumulator(model, opts[0])
contrastive = WindowLoss(encode=lambda m, mb: m(*mb), loss=clip_loss)
plain_acc = Accumulator(plain, opts[2])
per_micro_batch = lambda m, mb: clip_loss(m, m(*mb))  # noqa: E731 - plain accumulation: 15 negatives each

held_out(model, "before training")
for step in range(STEPS):
    data = batch(step)
    result = acc.step(data, contrastive, micro_batch_size=MICRO)
    plain_acc.step(data, per_micro_batch, micro_batch_size=MICRO)
    opts[1].zero_grad()
    clip_loss(big, big(*data)).backward()  # the reference: one big batch of 64 pairs
    opts[1].step()
    print(f"step {result.step}: loss {result.loss:.4f} over {result.num_items} pairs "
          f"in {result.micro_batches} micro-batches")


held_out(model, f"after {STEPS} steps")


def distance(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


print(f"distance from one big batch after {STEPS} steps: WindowLoss {distance(model, big):.1e}, "
      f"plain accumulation {distance(plain, big):.1e}")
