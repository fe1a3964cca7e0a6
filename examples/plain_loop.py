"""A plain PyTorch accumulation loop (each micro-batch's loss divided by N) made exact with gradaccum's lower-level window.

The hand-written loop divides each micro-batch loss by N, which mis-weights the short last window
(here 3 items against 16). With ``acc.window`` each micro-batch reports its mean loss and item count;
the step normalizes by the window's total.
"""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradaccum import Accumulator

torch.manual_seed(0)
x = torch.randn(67, 10)
y = (x.sum(dim=1, keepdim=True) > 0).float()
loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
acc = Accumulator(model, optimizer, max_grad_norm=1.0)
criterion = nn.BCEWithLogitsLoss()
accumulation_steps = 4

for epoch in range(5):
    batches = list(loader)
    for start in range(0, len(batches), accumulation_steps):
        window = batches[start:start + accumulation_steps]  # the last one is shorter
        with acc.window(len(window)) as w:
            for inputs, targets in window:
                with w.micro_batch():  # skips DDP's all-reduce except on the last micro-batch
                    loss = criterion(model(inputs), targets)
                    w.backward(loss, num_items=len(inputs))
            result = w.step()
    print(f"epoch {epoch}: loss {result.loss:.4f} over {result.num_items} items, step {result.step}")
