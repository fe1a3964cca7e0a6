"""The shortest path: hand Accumulator.train a DataLoader of micro-batches."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradaccum import Accumulator

torch.manual_seed(0)
x = torch.randn(500, 8)
y = x @ torch.randn(8, 1) + 0.1 * torch.randn(500, 1)
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
acc = Accumulator(model, optimizer)


def loss_fn(m, batch):
    inputs, targets = batch
    return nn.functional.mse_loss(m(inputs), targets)


loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
for result in acc.train(loader, loss_fn, accum_steps=4, epochs=10):
    pass
print(f"after {result.step} steps: loss {result.loss:.4f}")
