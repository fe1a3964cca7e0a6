"""Lightning with strategy="ddp" under torchrun, 2 gloo processes: the manual-optimization recipe for a
loss that couples the window's items (tests/integrations/lightning_window.py) equals one float64 big
batch per window on the union of both ranks' shares (rank 0's first), uneven shares included; the
replicas are identical and global_step counts windows."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/

from contrastive import big_batch_step, largest_difference, pair_batch, twin  # noqa: E402
from distributed.worker import main, params_equal_on_all_ranks  # noqa: E402

RANK, WORLD = 0, 1
TOL = 1e-12
SHARES = [{0: 7, 1: 4}, {0: 5, 1: 6}]  # each rank's rows per window


def lightning_ddp_window_loss_recipe():
    from pytorch_lightning.strategies import DDPStrategy

    from integrations.lightning_window import Contrastive, fit

    data = [{r: pair_batch(n, seed=10 * w + r) for r, n in shares.items()} for w, shares in enumerate(SHARES)]
    module = Contrastive()
    ref, _, ref_opt = twin(module.encoder, "sgd")
    trainer = fit(module, [window[RANK] for window in data], strategy=DDPStrategy(process_group_backend="gloo"),
                  devices=WORLD, use_distributed_sampler=False)
    for window in data:
        big_batch_step(ref, ref_opt, [window[r] for r in range(WORLD)], max_grad_norm=0.5)
    worst = largest_difference(module.encoder, ref)
    assert worst < TOL, worst
    assert params_equal_on_all_ranks(module.encoder)
    assert trainer.global_step == len(SHARES), trainer.global_step
    return f"2 windows, uneven shares, clipped: {worst:.1e} from one big batch"


SCENARIOS = [lightning_ddp_window_loss_recipe]

if __name__ == "__main__":
    sys.exit(main(SCENARIOS, globals()))
