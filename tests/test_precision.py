"""bf16 parameters accumulate as one big batch: the window's gradient is summed in float32 by default
and rounded once to bf16 for the optimizer (issue 38's table, as a test; ``make bench``'s precision
section prints the same table from :func:`bf16_errors`).

The model is a small GPT-2 built from a config, cast to bfloat16; the reference is the same weights in
float64 on the whole window as one padded batch. Every figure is the relative L2 error of the gradient
the optimizer is handed, over all parameters. The **floor** is what no accumulation can beat: each
micro-batch's own bf16 gradient (weighted ``n_k / N``), summed exactly (float64), rounded once to bf16.
"""
from __future__ import annotations

import copy
import inspect
import warnings
from pathlib import Path
from typing import Dict, List, Sequence

import pytest
import torch
from torch import nn

from gradaccum import Accumulator
from gradaccum.accumulator import LowPrecisionWarning
from gradaccum.memory import PeakMeter

from hf_helpers import gpt2, lm_loss, micro_batches, pad, sequences

ROUTES = ("floor", "plain", "default", "param")


class Capture(torch.optim.SGD):
    """An optimizer that records the gradient it is handed and moves nothing."""

    def __init__(self, params, sink: List[torch.Tensor]) -> None:  # noqa: ANN001
        self.params, self.sink = list(params), sink
        super().__init__(self.params, lr=0.0)

    def step(self, closure=None):  # noqa: ANN001, ANN201
        if closure is not None:  # Lightning's: the window's last backward and its on_before_optimizer_step
            closure()
        self.sink.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).double().flatten()
                                    for p in self.params]))  # no gradient handed over: zeros


def _flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])


def window(k: int, seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    """``k`` micro-batches of 1 to 3 sequences of 4 to 24 tokens, each padded on its own."""
    g = torch.Generator().manual_seed(seed)
    split = [int(n) for n in torch.randint(1, 4, (k,), generator=g)]
    lengths = [int(n) for n in torch.randint(4, 25, (sum(split),), generator=g)]
    return micro_batches(sequences(lengths, seed), split)


def bf16_errors(k: int, seed: int = 0, routes: Sequence[str] = ROUTES) -> Dict[str, float]:
    """Relative L2 error from the float64 big batch of the window gradient each route hands the
    optimizer, on a bf16 GPT-2 over ``k`` micro-batches: ``floor`` (above), ``plain`` (``(S_k / N).backward()``
    summed in the bf16 ``.grad``), ``default`` (``Accumulator`` as constructed by default: float32 buffers)
    and ``param`` (``Accumulator(accum_dtype="param")``, the opt-out: the sum in the bf16 ``.grad``)."""
    torch.manual_seed(seed)
    low = gpt2(seed).to(torch.bfloat16)
    mbs = window(k, seed)
    exact = big_batch_gradient(low, mbs)
    counts = [int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs]
    total = sum(counts)
    out: Dict[str, float] = {}
    for route in routes:
        model = copy.deepcopy(low)
        if route in ("floor", "plain"):
            summed = None
            for mb, n in zip(mbs, counts):
                if route == "floor":
                    model.zero_grad(set_to_none=True)
                (lm_loss(model, mb)[0] * (n / total)).backward()
                if route == "floor":
                    g = _flat_grad(model)
                    summed = g if summed is None else summed + g
            got = summed.to(torch.bfloat16).double() if route == "floor" else _flat_grad(model)
        else:
            sink: List[torch.Tensor] = []
            kwargs = {} if route == "default" else {"accum_dtype": "param"}
            acc = Accumulator(model, Capture(model.parameters(), sink), **kwargs)
            acc.step(mbs, lm_loss)
            got = sink[0]
        out[route] = ((got - exact).norm() / exact.norm()).item()
    return out


def big_batch_gradient(low: nn.Module, mbs: Sequence[Dict[str, torch.Tensor]]) -> torch.Tensor:
    """The float64 gradient of the window as one padded batch, from ``low``'s weights."""
    ref = copy.deepcopy(low).double()
    lm_loss(ref, pad([s for mb in mbs for s in _unpadded(mb)]))[0].backward()
    return _flat_grad(ref)


def _unpadded(mb: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
    return [ids[:int(m.sum())] for ids, m in zip(mb["input_ids"], mb["attention_mask"])]


def accumulation_memory(k: int = 8, seed: int = 0) -> Dict[str, int]:
    """Peak bytes of one window (``Accumulator.step``) on the bf16 GPT-2, with float32 buffers (the
    default) and without (``accum_dtype="param"``), and the parameters' bytes for scale."""
    low = gpt2(seed).to(torch.bfloat16)
    mbs = window(k, seed)
    out = {"param_bytes": sum(p.numel() * p.element_size() for p in low.parameters())}
    for route, kwargs in (("default", {}), ("param", {"accum_dtype": "param"})):
        model = copy.deepcopy(low)
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), **kwargs)
        acc.step(mbs[:1], lm_loss)  # the first window's one-off allocations outside the measured one
        with PeakMeter("cpu") as meter:
            acc.step(mbs, lm_loss)
        out[route] = meter.result.peak_bytes
    return out


@pytest.fixture(scope="module")
def errors() -> Dict[int, Dict[str, float]]:
    with torch.random.fork_rng():
        torch.set_num_threads(1)  # one thread on every side: the same bf16 kernels for every route
        return {k: bf16_errors(k) for k in (16, 64)}


@pytest.mark.parametrize("k", [16, 64])
def test_bf16_parameters_accumulate_within_a_quarter_of_the_floor_by_default(errors, k):
    """The default rounds the window's gradient to bf16 once: within 1.25x of the floor."""
    e = errors[k]
    assert e["default"] <= 1.25 * e["floor"], e


def test_the_opt_out_sums_in_bf16_and_drifts_with_the_window(errors):
    """``accum_dtype="param"`` (the old default) rounds the running sum after every micro-batch: worse
    than the default at K = 16 already, and about twice the floor at K = 64. The plain loop beside it
    rounds the same way (the stock path)."""
    assert errors[16]["param"] > 1.1 * errors[16]["default"], errors[16]
    e = errors[64]
    assert e["param"] > 1.5 * e["default"] and e["plain"] > 1.5 * e["default"], e
    assert e["param"] > 1.5 * e["floor"], e


def unfreezing_error(frozen_at_first: bool, **kwargs) -> float:
    """The relative error from the float64 big batch of the gradient handed over in a bf16 GPT-2's second
    window (16 micro-batches), its blocks ``frozen_at_first`` (when the Accumulator is built and through a
    first window of 2 micro-batches, then unfrozen) or trainable throughout; ``kwargs`` go to the Accumulator."""
    with torch.random.fork_rng():
        torch.set_num_threads(1)  # the same bf16 kernels on every side
        torch.manual_seed(0)
        model, mbs = gpt2(0).to(torch.bfloat16), window(16, 0)
        blocks = list(model.transformer.h.parameters())
        for p in blocks:
            p.requires_grad_(not frozen_at_first)
        sink: List[torch.Tensor] = []
        acc = Accumulator(model, Capture(model.parameters(), sink), **kwargs)
        acc.step(mbs[:2], lm_loss)
        for p in blocks:
            p.requires_grad_(True)
        acc.step(mbs, lm_loss)
        exact = big_batch_gradient(gpt2(0).to(torch.bfloat16), mbs)
    return ((sink[-1] - exact).norm() / exact.norm()).item()


def test_a_bf16_layer_unfrozen_after_the_accumulator_was_built_sums_in_float32_too():
    """Gradual unfreezing: the blocks are frozen when the Accumulator is built and through a first window,
    then unfrozen. Their gradient in the next window is summed in the float32 buffers, to the bit as if they
    had been trainable throughout, not in their bf16 ``.grad`` (the opt-out's error, measured beside it)."""
    got = unfreezing_error(True)
    assert got == unfreezing_error(False), got
    assert unfreezing_error(True, accum_dtype="param") > 1.1 * got, got


def test_a_bf16_layer_unfrozen_while_a_window_is_open_is_scaled_with_the_window():
    """Unfrozen after the window opened (a LightningModule's own on_train_batch_start runs after the callback's):
    its hook comes with the next window, so this window sums its gradient in its own ``.grad``, which is scaled by
    R / N with the rest (R = 1 from a first window of one item, N = 16 here: before, it was handed over 16x too
    large). Each parameter's gradient against the float64 big batch's, to bf16's rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).to(torch.bfloat16)
    model[0].requires_grad_(False)
    sink: List[torch.Tensor] = []
    acc = Accumulator(model, Capture(model.parameters(), sink))
    g = torch.Generator().manual_seed(1)
    mbs = [(torch.randn(n, 4, generator=g).bfloat16(), torch.randn(n, 1, generator=g).bfloat16()) for n in (1, 6, 9)]
    mse = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    acc.step(mbs[:1], mse)
    with acc.window(3) as window:
        model[0].requires_grad_(True)
        for mb in mbs:
            with window.micro_batch():
                window.backward(mse(model, mb), len(mb[0]))
        window.step()
    ref = copy.deepcopy(model).double()
    x, y = (torch.cat(parts).double() for parts in zip(*mbs))
    nn.functional.mse_loss(ref(x), y).backward()
    got = sink[-1].split([p.numel() for p in ref.parameters()])
    for (name, p), q in zip(ref.named_parameters(), got):
        assert ((q - p.grad.flatten()).norm() / p.grad.norm()).item() < 0.05, name


def test_the_drivers_buffers_take_a_bf16_parameter_frozen_when_they_are_built():
    """ExactTrainer's and ExactAccumulation's buffers are built once, before a callback may unfreeze a layer
    (Lightning's BaseFinetuning): a frozen bf16 parameter is hooked as the first window after its unfreezing
    opens, and folds into float32 from then on."""
    from gradaccum.accumulator import driver_buffers

    p = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
    buffers = driver_buffers("ExactAccumulation", [p], "auto", owns_the_sum=True, fix="")
    assert buffers is not None and buffers.params == [p]
    p.requires_grad_(True)
    buffers.open()
    (p.float() * 3).sum().backward()
    assert p.grad is None and buffers.tensors()[0].dtype == torch.float32  # folded by its hook
    buffers.write_grads_()
    assert torch.equal(p.grad, torch.full((4,), 3.0, dtype=torch.bfloat16))


def test_float32_buffers_cost_the_bf16_gradients_bytes_again():
    """Measured by PeakMeter: the default holds float32 buffers (4 bytes a parameter) where the opt-out
    holds the bf16 ``.grad`` (2 bytes): the net cost is 2 bytes a parameter, the bf16 parameters' own
    size (measured 1.00x; at most one more parameter-sized bf16 tensor, the last gradient living next
    to its buffer until its hook drops it)."""
    m = accumulation_memory()
    extra = m["default"] - m["param"]
    assert m["param_bytes"] <= extra <= 1.25 * m["param_bytes"], m


def test_fp32_parameters_get_no_buffers_and_bf16_ones_do():
    fp32 = nn.Linear(3, 2)
    assert Accumulator(fp32, torch.optim.SGD(fp32.parameters(), lr=0.1)).buffers is None
    bf16 = nn.Linear(3, 2).to(torch.bfloat16)
    acc = Accumulator(bf16, torch.optim.SGD(bf16.parameters(), lr=0.1))
    assert acc.buffers is not None and acc.buffers.dtype == torch.float32
    for opt_out in ("param", None):
        assert Accumulator(bf16, torch.optim.SGD(bf16.parameters(), lr=0.1), accum_dtype=opt_out).buffers is None


def test_fp16_autocast_with_low_precision_parameters_says_what_it_costs():
    """GradScaler unscales float32 gradients only: no buffers there, and a warning that names the cost."""
    model = nn.Linear(3, 2).to(torch.float16)
    with pytest.warns(LowPrecisionWarning, match="summed in the parameters' own dtype.*accum_dtype='param'") as said:
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")
    assert acc.buffers is None
    built = inspect.currentframe().f_lineno - 2  # the warning points at the line that built the Accumulator
    assert [(Path(w.filename).name, w.lineno) for w in said] == [(Path(__file__).name, built)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", accum_dtype="param")


def test_accum_dtype_refuses_what_is_neither_a_name_nor_a_dtype():
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match="accum_dtype must be 'auto'.*got 'float32'"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accum_dtype="float32")


# -- the trainers' drivers sum in float32 too (#38 item 3) ----------------------------------------

DRIVER_K = 16


def exact_trainer_gradient(low: nn.Module, mbs: Sequence[Dict[str, torch.Tensor]], tmp: str, **kwargs) -> torch.Tensor:
    """The gradient ExactTrainer hands the optimizer for one window of ``mbs`` (one micro-batch per
    Trainer batch, no clipping), captured by :class:`Capture`; ``kwargs`` go to ExactTrainer."""
    from transformers import TrainingArguments

    from gradaccum.integrations.hf_trainer import ExactTrainer

    model, sink = copy.deepcopy(low), []
    opt = Capture(model.parameters(), sink)
    args = TrainingArguments(tmp, report_to="none", use_cpu=True, per_device_train_batch_size=1,
                             gradient_accumulation_steps=len(mbs), max_steps=1, max_grad_norm=0.0,
                             remove_unused_columns=False, save_strategy="no", logging_strategy="no",
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = ExactTrainer(model=model, args=args, train_dataset=list(mbs), data_collator=lambda rows: rows[0],
                           optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)), **kwargs)
    trainer.train()
    assert len(sink) == 1, len(sink)
    return sink[0]


def lightning_lm(low: nn.Module, optimizer) -> type:
    """A LightningModule class training a copy of ``low`` on ``lm_loss``, with ``optimizer(params)``."""
    import pytorch_lightning as pl

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = copy.deepcopy(low)

        def training_step(self, batch, _):  # noqa: ANN001, ANN201
            return lm_loss(self.lm, batch)

        def configure_optimizers(self):  # noqa: ANN201
            return optimizer(self.lm.parameters())

    return LM


def lightning_gradient(low: nn.Module, mbs: Sequence[Dict[str, torch.Tensor]], **kwargs) -> torch.Tensor:
    """The gradient Lightning hands the optimizer for one window of ``mbs`` under ExactAccumulation
    (``training_step`` returns ``lm_loss``'s ``(mean, count)``; no clipping); ``kwargs`` go to the callback."""
    import pytorch_lightning as pl

    from gradaccum.integrations.lightning import ExactAccumulation

    sink: List[torch.Tensor] = []

    LM = lightning_lm(low, lambda params: Capture(params, sink))

    data = torch.utils.data.DataLoader(list(mbs), batch_size=None, shuffle=False)
    fit = pl.Trainer(accumulate_grad_batches=len(mbs), max_steps=1, callbacks=[ExactAccumulation(**kwargs)],
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", devices=1)
    fit.fit(LM(), data)
    assert len(sink) == 1, len(sink)
    return sink[0]


@pytest.fixture(scope="module")
def driver_errors(tmp_path_factory) -> Dict[str, float]:
    """Relative L2 error from the float64 big batch of the window gradient each driver hands the
    optimizer on the bf16 GPT-2 over K = 16 micro-batches, by default and with ``accum_dtype="param"``,
    and the floor (each micro-batch's bf16 gradient summed exactly, rounded once to bf16)."""
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        torch.manual_seed(0)
        low = gpt2(0).to(torch.bfloat16)
        mbs = window(DRIVER_K, 0)
        exact = big_batch_gradient(low, mbs)
        rel = lambda got: ((got - exact).norm() / exact.norm()).item()  # noqa: E731
        out = {"floor": bf16_errors(DRIVER_K, routes=("floor",))["floor"]}
        tmp = tmp_path_factory.mktemp("exact_trainer")
        with warnings.catch_warnings():
            warnings.simplefilter("error", LowPrecisionWarning)  # neither driver warns on one process
            for name, kwargs in (("default", {}), ("param", {"accum_dtype": "param"})):
                out[f"trainer_{name}"] = rel(exact_trainer_gradient(low, mbs, str(tmp / name), **kwargs))
                out[f"lightning_{name}"] = rel(lightning_gradient(low, mbs, **kwargs))
        return out


@pytest.mark.parametrize("driver", ["trainer", "lightning"])
def test_the_trainers_drivers_sum_bf16_parameters_in_float32_by_default(driver_errors, driver):
    """ExactTrainer and Lightning's ExactAccumulation, on one process, fold each micro-batch's bf16
    gradient into float32 buffers and round the window's sum once before the framework clips and
    steps: within 1.25x of the floor, and the opt-out (the sum in the bf16 ``.grad``) measurably worse
    beside it."""
    e = driver_errors
    assert e[f"{driver}_default"] <= 1.25 * e["floor"], e
    assert e[f"{driver}_param"] > 1.1 * e[f"{driver}_default"], e


def test_the_drivers_warn_where_a_wrapper_owns_the_sum_and_refuse_a_bad_name():
    """Where the sum is not the driver's (a data-parallel wrapper, a loss scaler that unscales .grad
    first) the bf16 sum in .grad is named once with the fix; float32 parameters and the opt-out get no
    buffers and no warning; a name that is neither 'auto' nor 'param' is refused with both."""
    from gradaccum.accumulator import driver_buffers
    from gradaccum.errors import ConfigurationError
    from gradaccum.integrations.lightning import ExactAccumulation

    bf16, fp32 = nn.Linear(3, 2).to(torch.bfloat16), nn.Linear(3, 2)
    with pytest.warns(LowPrecisionWarning, match=r"Driver: the trainable parameters are torch\.bfloat16.*the fix"):
        assert driver_buffers("Driver", bf16.parameters(), "auto", owns_the_sum=False, fix="the fix") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", LowPrecisionWarning)
        for params, accum, owns in ((fp32.parameters(), "auto", True), (fp32.parameters(), "auto", False),
                                    (bf16.parameters(), "param", False), (bf16.parameters(), "param", True)):
            assert driver_buffers("Driver", params, accum, owns_the_sum=owns, fix="") is None
    buffers = driver_buffers("Driver", bf16.parameters(), "auto", owns_the_sum=True, fix="")
    assert buffers is not None and buffers.dtype == torch.float32 and len(buffers.params) == 2
    with pytest.raises(ConfigurationError, match=r"ExactAccumulation\(accum_dtype='float32'\).*'auto'.*'param'"):
        ExactAccumulation(accum_dtype="float32")
    from gradaccum.integrations.hf_trainer import ExactTrainer

    with pytest.raises(ConfigurationError, match=r"ExactTrainer\(accum_dtype=torch\.float32\).*'auto'.*'param'"):
        ExactTrainer(model=bf16, accum_dtype=torch.float32)


def test_exact_trainer_opens_buffers_for_bf16_parameters_only(tmp_path):
    """One process: bf16 parameters get float32 buffers (and no warning); float32 ones none (no hooks:
    the Trainer's path as before)."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from gradaccum.integrations.hf_trainer import ExactTrainer

    def trainer(dtype, **kwargs):
        model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=8, n_layer=1, n_head=2)).to(dtype)
        args = TrainingArguments(str(tmp_path / str(dtype)), report_to="none", use_cpu=True,
                                 gradient_accumulation_steps=2)
        return ExactTrainer(model=model, args=args, train_dataset=[{"input_ids": torch.tensor([1, 2, 3])}], **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("error", LowPrecisionWarning)
        low = trainer(torch.bfloat16)
        assert low.buffers is not None and low.buffers.dtype == torch.float32
        assert trainer(torch.bfloat16, accum_dtype="param").buffers is None
        assert trainer(torch.float32).buffers is None


def test_a_skipped_window_leaves_the_drivers_buffers_empty(tmp_path):
    """A window of no item (every label ignored) is skipped by both drivers: its float32 buffers are
    cleared at the boundary, so nothing of it is held after the step that was not taken."""
    import pytorch_lightning as pl
    from transformers import TrainerCallback

    from gradaccum.integrations.lightning import ExactAccumulation

    low = gpt2(0).to(torch.bfloat16)
    empty = [{**mb, "labels": torch.full_like(mb["labels"], -100)} for mb in window(3, 1)]
    held: Dict[str, List[int]] = {"trainer": [], "lightning": []}

    class TrainerProbe(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
            held["trainer"].append(len(trainer.buffers.tensors()))

    from transformers import TrainingArguments

    from gradaccum.integrations.hf_trainer import ExactTrainer

    model = copy.deepcopy(low)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    args = TrainingArguments(str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=1,
                             gradient_accumulation_steps=len(empty), num_train_epochs=1, max_grad_norm=0.0,
                             remove_unused_columns=False, save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = ExactTrainer(model=model, args=args, train_dataset=empty, data_collator=lambda rows: rows[0],
                           optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)),
                           callbacks=[TrainerProbe()])
    trainer.train()
    assert trainer.skipped == 1 and held["trainer"] == [0], held

    class LightningProbe(pl.Callback):
        def on_train_batch_end(self, fit, pl_module, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
            held["lightning"].append(len(callback.buffers.tensors()))

    LM = lightning_lm(low, lambda params: torch.optim.SGD(params, lr=1.0))

    callback = ExactAccumulation()
    fit = pl.Trainer(accumulate_grad_batches=len(empty), max_epochs=1, callbacks=[callback, LightningProbe()],
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", devices=1)
    with pytest.warns(UserWarning, match="no optimizer or scheduler step"):
        fit.fit(LM(), torch.utils.data.DataLoader(empty, batch_size=None, shuffle=False))
    assert callback.skipped == 1 and held["lightning"][-1] == 0 and min(held["lightning"][:-1]) > 0, held


def test_a_second_fit_is_not_summed_into_buffers_a_first_fit_left_open():
    """Lightning may not reach ExactAccumulation's teardown (another callback's on_exception raising first
    stops the hooks): the first fit's float32 buffers, still folding, would take the second fit's gradients
    in silence. A second fit with the callback ends as one whose first fit was torn down."""
    import pytorch_lightning as pl

    from gradaccum.integrations.lightning import ExactAccumulation

    data = window(4, 2)
    models = []
    for torn_down in (True, False):
        LM = lightning_lm(gpt2(0).to(torch.bfloat16), lambda params: torch.optim.SGD(params, lr=1.0))
        module, callback = LM(), ExactAccumulation()
        for fit_number in range(2):
            fit = pl.Trainer(accumulate_grad_batches=2, max_epochs=1, callbacks=[callback], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             accelerator="cpu", devices=1)
            fit.fit(module, torch.utils.data.DataLoader(data, batch_size=None, shuffle=False))
            if fit_number == 0 and not torn_down:
                callback.buffers.open()  # as the fit left them where its teardown never ran
        models.append(module)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


class _TwoDtypes(nn.Module):
    """A float32 layer (summed in the float64 buffers) then a float64 one (already of the buffers' dtype:
    its gradient sums in ``.grad``), as a bf16 model with float32 layers is under ``accum_dtype="auto"``."""

    def __init__(self) -> None:
        super().__init__()
        self.low, self.high = nn.Linear(4, 8), nn.Linear(8, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.high(torch.tanh(self.low(x.float())).double())


@pytest.mark.parametrize("counted", ["rows", "by loss_fn"])
def test_a_model_of_two_dtypes_is_measured_clipped_and_rescaled_whole(counted):
    """Buffers hold only the parameters of another dtype than theirs: the boundary's norm, clip and rescale
    R / N must reach the others' ``.grad`` too. Clipping engaged; "by loss_fn": the loss counts each row
    twice, so the items counted up front are half of N and the boundary rescales by 1/2 (R != N)."""
    torch.manual_seed(0)
    model = _TwoDtypes()
    ref = copy.deepcopy(model)
    x, y = torch.randn(10, 4), 50 * torch.randn(10, 1, dtype=torch.float64)
    loss = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    loss_fn = loss if counted == "rows" else (lambda m, b: (loss(m, b), 2 * len(b[0])))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=0.5,
                      accum_dtype=torch.float64)
    assert len(acc.buffers.params) == 2  # the float32 layer's weight and bias
    acc.step([(x[:3], y[:3]), (x[3:4], y[3:4]), (x[4:], y[4:])], loss_fn)  # uneven micro-batches
    loss(ref, (x, y)).backward()  # the big batch: one mean over the 10 rows
    norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5)
    assert norm > 5  # the clip is engaged
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_auto_buffers_no_parameter_in_a_dtype_finer_than_float32():
    """``accum_dtype="auto"`` sums bf16/fp16 gradients in float32, and leaves a float64 parameter's gradient
    in its own ``.grad``: a float32 buffer would round each of its micro-batches' gradients to float32
    (measured 1e-7 off after one step, where float64 is 1e-16 off)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"high": nn.Linear(16, 1).double(), "low": nn.Linear(1, 1).to(torch.bfloat16)})
    ref = copy.deepcopy(model)
    forward = lambda m, x: m["high"](x) + m["low"](x[:, :1].bfloat16()).double()  # noqa: E731
    loss = lambda m, b: nn.functional.mse_loss(forward(m, b[0]), b[1])  # noqa: E731
    x, y = torch.randn(11, 16, dtype=torch.float64), torch.randn(11, 1, dtype=torch.float64)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0))
    assert [id(p) for p in acc.buffers.params] == [id(p) for p in model["low"].parameters()]
    acc.step([(x[:2], y[:2]), (x[2:9], y[2:9]), (x[9:], y[9:])], loss)  # uneven micro-batches
    loss(ref, (x, y)).backward()  # the big batch
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    for got, want in zip(model["high"].parameters(), ref["high"].parameters()):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("skipped", [False, True])
def test_a_backward_between_windows_keeps_its_grad(skipped):
    """After a window's boundary (stepped, or skipped as not finite) the float32 buffers fold nothing more: a
    backward the user runs between windows (a probe, a gradient of their own) keeps its bf16 ``.grad``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1).to(torch.bfloat16)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))  # accum_dtype="auto": float32 buffers
    x = torch.randn(8, 4, dtype=torch.bfloat16)
    scale = float("nan") if skipped else 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = acc.step(x, lambda m, b: m(b).float().pow(2).mean() * scale, micro_batch_size=4)
    assert result.skipped == skipped
    model(x).float().sum().backward()
    assert model.weight.grad is not None and model.weight.grad.dtype == torch.bfloat16
