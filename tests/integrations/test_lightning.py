"""PyTorch Lightning with ``ExactAccumulation`` on one process, against one float64 step per window.

Data (scenarios.py): 7 micro-batches of 1-3 padded sequences (3-30 tokens), accumulate 3, so the
windows hold 3, 3 and 1 micro-batches (a short last window); SGD with momentum and a step-interval
LambdaLR schedule. Lightning gets a DataLoader over the pre-padded micro-batches (``batch_size=None``).
The reference: per window, the mean over every target of the window as one padded batch. The same
fit without the callback (Lightning's own accumulation) is shown off by far more than the tolerance.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pl = pytest.importorskip("pytorch_lightning")

from integrations import scenarios as S  # noqa: E402
from gradaccum import ConfigurationError, count_targets  # noqa: E402
from gradaccum.integrations.lightning import ExactAccumulation  # noqa: E402
from hf_helpers import gpt2, llama, pad  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:pytorch_lightning"),
              pytest.mark.filterwarnings("ignore::UserWarning:lightning_fabric")]

MICRO = S.rank_micro_batches(0, S.SIZES[0])
WINDOWS = S.windows_of([MICRO], S.ACCUM)
MODELS = {"gpt2": gpt2, "llama-float64-norm": lambda: S.float64_rmsnorm(llama())}


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
@pytest.mark.parametrize("name", list(MODELS))
def test_exact_where_native_is_not(name, clip):
    """Params equal the reference at rtol 1e-10 after 3 windows (the last one short); Lightning's own
    accumulation on the same data is off by more than 1e-6 (about 1e-2); the logged loss is untouched
    (each micro-batch's mean); global_step counts windows; the last window's N is its target count."""
    model = MODELS[name]()
    ref = S.reference(model, WINDOWS, clip=clip)
    if clip is not None:  # the clip engages: the reference's first gradient is longer than the limit
        assert _first_grad_norm(model) > 2 * clip
    lit, trainer, cb = S.lightning_fit(model, MICRO, exact=True, clip=clip)
    native, _, _ = S.lightning_fit(model, MICRO, exact=False, clip=clip)
    assert S.params_close(lit.model, ref) is None, S.params_close(lit.model, ref)
    assert S.max_diff(native.model, ref) > 1e-6
    assert trainer.global_step == len(WINDOWS) == 3
    assert cb.last_window_items == count_targets(pad(WINDOWS[-1])["labels"])
    # logging untouched: the logged value is the last micro-batch's own mean, as without the callback
    assert len(lit.logged) == len(MICRO) and lit.logged[0] == native.logged[0]
    assert trainer.callback_metrics["train_loss"].item() == lit.logged[-1]


def _first_grad_norm(model: nn.Module) -> float:
    import copy

    m = copy.deepcopy(model)
    mb = pad(WINDOWS[0])
    S.causal_lm_loss(S.lm_logits(m, mb), mb["labels"])[0].backward()
    return float(torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf")))


def test_llama_float32_norm_is_exact_to_its_float32_rounding():
    """Stock Llama computes RMSNorm in float32 even in a float64 model. Lightning shows a window's
    count only after its backwards, so that island rounds ``grad * W / R`` where the big batch rounds
    ``grad / N``: the integration lands within float32 rounding (rtol 1e-7), native 1e-2 away."""
    model = llama()
    ref = S.reference(model, WINDOWS)
    lit, _, _ = S.lightning_fit(model, MICRO, exact=True)
    native, _, _ = S.lightning_fit(model, MICRO, exact=False)
    for p, q in zip(lit.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-8)
    assert S.max_diff(native.model, ref) > 1e3 * S.max_diff(lit.model, ref)


def test_a_bare_mean_on_padded_labels_is_refused_and_rows_is_the_declared_opt_out():
    """``training_step`` returning a bare mean (a Hugging Face model's ``outputs.loss``: over the targets) on
    batches whose labels hold -100, with ``ExactAccumulation()`` counting rows: refused at the first window's
    boundary, before its step, naming ``count_targets`` and ``num_items='rows'``, also where only a later
    micro-batch of the window is padded. Declared with ``num_items="rows"``, the fit runs, weighing rows as
    declared (the last window's N is its rows)."""
    from gradaccum import NotExactError

    model = MODELS["gpt2"]()
    unpadded_first = [MICRO[2], MICRO[0], MICRO[1]]  # one sequence, no -100; then two padded micro-batches
    assert not (MICRO[2]["labels"] == -100).any() and (MICRO[0]["labels"] == -100).any()
    for micro_batches in (MICRO, unpadded_first):
        with pytest.raises(NotExactError, match=r"ExactAccumulation: training_step returned a bare mean loss .*"
                                                r"count_targets.*num_items='rows'"):
            S.lightning_fit(model, micro_batches, exact=False, callbacks=[ExactAccumulation()])
    _, trainer, _ = S.lightning_fit(model, MICRO, exact=False, callbacks=[rows := ExactAccumulation(num_items="rows")])
    assert trainer.global_step == len(WINDOWS) and rows.last_window_items == len(WINDOWS[-1])


def test_count_returned_from_training_step_is_the_same_run():
    """``training_step`` returning ``(mean, count)`` instead of ``num_items=``: bit-identical parameters.
    Both counts are device tensors here (a tensor count's weight is rounded on its device, an int's on
    the host: the two differ by an ulp, and both equal the reference in test_exact_where_native_is_not)."""
    model = gpt2()
    tensor_count = ExactAccumulation(num_items=lambda batch: (batch["labels"][:, 1:] != -100).sum())
    a, _, _ = S.lightning_fit(model, MICRO, exact=False, callbacks=[tensor_count])
    b, _, _ = S.lightning_fit(model, MICRO, exact=True, return_count=True)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert "training_step" not in vars(b)  # the wrapper is gone after fit


class Regression(pl.LightningModule):
    """Rows are the items: the default count is the batch's leading dimension."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_default_count_is_the_leading_dimension():
    """Micro-batches of 5, 1, 3, 2 and 4 rows, accumulate 2 (windows 6, 5 and 4 rows): each step is
    the MSE over the window's rows. No num_items: the rows are counted."""
    from torch.utils.data import DataLoader

    S.quiet()
    g = torch.Generator().manual_seed(3)
    sizes = [5, 1, 3, 2, 4]
    batches = [(torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64))
               for n in sizes]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    ref = Regression(S.copy.deepcopy(net))
    opt = ref.configure_optimizers()
    for w in range(3):
        x = torch.cat([b[0] for b in batches[2 * w:2 * w + 2]])
        y = torch.cat([b[1] for b in batches[2 * w:2 * w + 2]])
        opt.zero_grad()
        nn.functional.mse_loss(ref.net(x), y).backward()
        opt.step()
    fitted = {}
    for exact in (True, False):
        lit = Regression(S.copy.deepcopy(net))
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2, logger=False,
                             callbacks=[ExactAccumulation()] if exact else [], enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(lit, DataLoader(batches, batch_size=None))
        fitted[exact] = lit
    assert S.params_close(fitted[True], ref) is None
    assert S.max_diff(fitted[False], ref) > 1e-6


def test_checkpoint_resume_is_the_uninterrupted_run(tmp_path):
    """Two epochs (6 windows, two of them short) straight, or one epoch, a checkpoint, and a resumed
    second epoch: bit-identical parameters, both equal to 6 reference steps at rtol 1e-10."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    model = gpt2()
    ref = S.reference(model, WINDOWS, epochs=2)
    straight, _, _ = S.lightning_fit(model, MICRO, exact=True, epochs=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    S.lightning_fit(model, MICRO, exact=True, epochs=1, callbacks=[ckpt], checkpointing=True, root=str(tmp_path))
    resumed, trainer, _ = S.lightning_fit(model, MICRO, exact=True, epochs=2, ckpt_path=str(tmp_path / "last.ckpt"),
                                          root=str(tmp_path))
    assert trainer.global_step == 6
    assert all(torch.equal(p, q) for p, q in zip(straight.model.parameters(), resumed.model.parameters()))
    assert S.params_close(straight.model, ref) is None


def test_a_checkpoint_saved_inside_a_window_is_refused_on_resume(tmp_path):
    """A probe: a ModelCheckpoint after a validation inside a window (val_check_interval=2 under
    accumulate_grad_batches=3) holds none of that window's gradient, and a fit resumed from it ended 6e-2 to
    1e-1 off the uninterrupted fit, in silence. Refused as it is loaded, naming the fix; one saved at a
    window's end resumes (the test above)."""
    import pytorch_lightning as pl

    from gradaccum import ConfigurationError

    class SaveInside(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:  # the first window's second micro-batch of 3
                trainer.save_checkpoint(str(tmp_path / "inside.ckpt"))

    model = gpt2()
    S.lightning_fit(model, MICRO, exact=True, epochs=1, callbacks=[SaveInside()], root=str(tmp_path))
    with pytest.raises(ConfigurationError, match=r"saved inside a window.*val_check_interval a multiple of "
                                                 r"accumulate_grad_batches"):
        S.lightning_fit(model, MICRO, exact=True, epochs=2, ckpt_path=str(tmp_path / "inside.ckpt"),
                        root=str(tmp_path))


def test_errors_name_the_argument_and_the_fix():
    with pytest.raises(TypeError, match=r"num_items=3.*callable"):
        ExactAccumulation(num_items=3)

    class Manual(Regression):
        def __init__(self):
            super().__init__(nn.Linear(2, 1))
            self.automatic_optimization = False

    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, callbacks=[ExactAccumulation()], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(ConfigurationError, match="automatic_optimization = False"):
        trainer.fit(Manual(), torch.utils.data.DataLoader([(torch.zeros(1, 2), torch.zeros(1, 1))], batch_size=None))


def test_gradaccum_imports_without_the_frameworks():
    code = ("import sys, gradaccum, gradaccum.integrations; "
            "assert 'pytorch_lightning' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)




def test_a_window_of_zero_items_is_skipped():
    """Rank 1's micro-batches of scenarios.masked_batches on one process, windows of 2: the middle
    window's masks are all 0 (0 items, as when every label is ignored). Like the core, the callback
    skips it: no optimizer step (AdamW's weight decay does not move the weights, its step count stays),
    no scheduler step, global_step not advanced; one warning. The parameters equal a float64
    reference that steps on the other two windows only (rtol 1e-10)."""
    micro = S.masked_batches(1)
    with pytest.warns(UserWarning, match="counted 0 items") as caught:
        net, trainer, cb = S.masked_fit(micro, exact=True)
    assert len([w for w in caught if "counted 0 items" in str(w.message)]) == 1
    assert S.params_close(net, S.masked_reference([micro])) is None, S.params_close(net, S.masked_reference([micro]))
    assert trainer.global_step == 2 and cb.skipped == 1
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 2
    assert all(state["step"] == 2 for state in trainer.optimizers[0].state.values())


def test_a_resume_after_a_skipped_window_is_the_uninterrupted_run(tmp_path):
    """Rank 1's masked micro-batches, windows of 2, two epochs (the second in another order, starting
    with the window of no item). A fit checkpointed after its first epoch (whose middle window, of no
    item, was skipped) and resumed from Lightning's checkpoint ends bit-identical to the straight fit:
    the callback's state (R fixed by the fit's first micro-batch, the skipped windows, the steps, the
    last window's N) is in the checkpoint, so the resumed fit, whose first micro-batch counts 0 items,
    divides by the same R (6, not 1: not a power of 2 apart, so a lost R changes the rounding). Both
    equal the float64 reference (rtol 1e-10)."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    masked = S.masked_batches(1)  # items per micro-batch: 2, 3, 0, 0, 2, 2
    micro = [masked[k] for k in (1, 0, 2, 3, 4, 5)]  # R = 2 * 3: no power of 2 away from the resumed fit's own
    again_order = [masked[k] for k in (2, 3, 0, 1, 4, 5)]
    data = lambda: S.EpochBatches([micro, again_order])  # noqa: E731
    straight, trainer, cb = S.masked_fit(data(), exact=True, epochs=2)
    assert trainer.global_step == 4 and cb.skipped == 2
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _, first, cut = S.masked_fit(data(), exact=True, epochs=1, callbacks=[ckpt], root=str(tmp_path))
    assert first.global_step == 2 and cut.skipped == 1
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved[ExactAccumulation.CHECKPOINT_KEY] == cut.state.saved()
    resumed, again, cb2 = S.masked_fit(data(), exact=True, epochs=2, ckpt_path=str(tmp_path / "last.ckpt"),
                                       root=str(tmp_path))
    assert again.global_step == 4 and cb2.skipped == 2 and cb2.state.steps == 4
    assert cb2.state.reference == cb.state.reference == 6.0
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), resumed.parameters()))
    assert S.params_close(straight, S.masked_reference([micro + again_order])) is None


def test_a_window_whose_loss_is_not_finite_is_skipped():
    """Micro-batch 4 (window 1 of 3) gives nan logits, so its loss and the window's gradient are nan. The
    callback skips that window, from the norm of the gradient it hands over: the parameters equal a
    reference that never saw the window (rtol 1e-10), no scheduler step, global_step not advanced,
    skipped counts it, one warning. Lightning's own accumulation steps on it and ends with nan parameters.
    Under ``nonfinite="raise"`` the fit stops at that window with the fix; a bad value is refused."""
    model = gpt2()
    ref = S.reference(model, [w for i, w in enumerate(WINDOWS) if i != 1])
    model.lm_head.register_forward_hook(S.NanOnCall(4))
    with pytest.warns(UserWarning, match=r"ExactAccumulation: a window's gradient was not finite") as said:
        lit, trainer, cb = S.lightning_fit(model, MICRO, exact=True)
    assert len([w for w in said if "not finite" in str(w.message)]) == 1
    assert S.params_close(lit.model, ref) is None, S.params_close(lit.model, ref)
    assert trainer.global_step == 2 and cb.skipped == 1 and cb.state.steps == 2
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 2
    native, _, _ = S.lightning_fit(model, MICRO, exact=False)
    assert not S.all_finite(native.model)
    raising = ExactAccumulation(num_items=lambda b: count_targets(b["labels"]), nonfinite="raise")
    with pytest.raises(FloatingPointError, match=r"window 2 of this run.*ExactAccumulation\(nonfinite='skip'\)"):
        S.lightning_fit(model, MICRO, exact=False, callbacks=[raising])
    with pytest.raises(ConfigurationError, match=r"ExactAccumulation\(nonfinite=None\): nonfinite must be 'skip'"):
        ExactAccumulation(nonfinite=None)
