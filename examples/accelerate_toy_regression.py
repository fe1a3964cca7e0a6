"""The toy linear regression of Accelerate's gradient-accumulation guide: 8 points, accumulate 4
micro-batches of 2.

One step on the window equals one step on all 8 points: both print 2.04000.
"""
import copy

import torch

from gradaccum import Accumulator

x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
y = torch.tensor([2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0])

model = torch.nn.Linear(1, 1, bias=False)
torch.nn.init.zeros_(model.weight)
model_clone = copy.deepcopy(model)
print(f"initial model weight is {model.weight.mean().item():.5f}")


def loss_fn(m, batch):
    inputs, labels = batch
    return torch.nn.functional.mse_loss(m(inputs.view(-1, 1)), labels.view(-1, 1))


# with accumulation: 4 micro-batches of 2 points, one optimizer step
acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.02))
result = acc.step((x, y), loss_fn, micro_batch_size=2)
print(f"{result.micro_batches} micro-batches, {result.num_items} items, loss {result.loss:.5f}")

# without: one step on the whole batch
clone_opt = torch.optim.SGD(model_clone.parameters(), lr=0.02)
loss_fn(model_clone, (x, y)).backward()
clone_opt.step()

print(f"w/ accumulation, the final model weight is {model.weight.mean().item():.5f}")
print(f"w/o accumulation, the final model weight is {model_clone.weight.mean().item():.5f}")
