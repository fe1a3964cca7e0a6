"""Bad input is a clear error naming the argument and value, raised before anything moves."""
from __future__ import annotations

import pytest
import torch

from gradaccum import Accumulator, SplitError
from helpers import mse, regression_batch, regression_model


@pytest.fixture
def setup():
    model = regression_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    yield model, opt, Accumulator(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "parameters moved"
    assert all(p.grad is None for p in model.parameters()), "gradients left behind"
    assert not opt.state, "optimizer state changed"


@pytest.mark.parametrize("value, match", [
    (0, "micro_batch_size must be >= 1, got 0"),
    (-3, "micro_batch_size must be >= 1, got -3"),
    (2.5, "micro_batch_size must be a positive int, 'auto' or None, got 2.5"),
    ("big", "micro_batch_size must be a positive int, 'auto' or None, got 'big'"),
    (True, "micro_batch_size must be a positive int"),
])
def test_bad_micro_batch_size(setup, value, match):
    _, _, acc = setup
    with pytest.raises(ValueError, match=match):
        acc.step(regression_batch(4), mse, micro_batch_size=value)


def test_empty_window(setup):
    _, _, acc = setup
    with pytest.raises(ValueError, match=r"window is empty \(0 micro-batches\)"):
        acc.step([], mse)


def test_batch_given_without_micro_batch_size(setup):
    _, _, acc = setup
    with pytest.raises(ValueError, match="window must be a list of micro-batches"):
        acc.step(torch.zeros(4, 5), mse)


def test_leading_dimensions_disagree(setup):
    _, _, acc = setup
    x, y = regression_batch(6)
    with pytest.raises(ValueError, match=r"disagree on their leading dimension: .*\[0\] has 6 items but .*\[1\] has 5"):
        acc.step((x, y[:5]), mse, micro_batch_size=2)


def test_leading_dimensions_disagree_in_a_later_micro_batch(setup):
    _, _, acc = setup
    x, y = regression_batch(6)
    with pytest.raises(ValueError, match=r"window\[1\]\[0\] has 3 items but window\[1\]\[1\] has 2"):
        acc.step([(x[:3], y[:3]), (x[3:], y[4:])], mse)


@pytest.mark.parametrize("accum_steps", [0, -1, 1.5, "4", True])
def test_bad_accum_steps(setup, accum_steps):
    _, _, acc = setup
    with pytest.raises(ValueError, match=f"accum_steps must be a positive int, got {accum_steps!r}"):
        acc.train([regression_batch(2)], mse, accum_steps=accum_steps)


def test_bad_schedule_values(setup):
    _, _, acc = setup
    with pytest.raises(ValueError, match=r"accum_steps\[2\] must be a positive int, got 0"):
        acc.train([], mse, accum_steps={0: 2, 2: 0})
    with pytest.raises(ValueError, match="keys must be epochs"):
        acc.train([], mse, accum_steps={-1: 2})


def test_bad_epochs(setup):
    _, _, acc = setup
    with pytest.raises(ValueError, match=r"epochs must be an int >= 0 \(0 for a finished run: nothing to train\), got -1"):
        acc.train([], mse, accum_steps=2, epochs=-1)
    with pytest.raises(ValueError, match="epochs must be an int >= 0"):
        acc.train([], mse, accum_steps=2, epochs=1.5)


def test_unknown_precision():
    model = regression_model()
    with pytest.raises(ValueError, match="precision must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp8")


@pytest.mark.parametrize("kwargs, match", [
    ({"max_grad_norm": 0}, "max_grad_norm must be a positive finite number or None, got 0"),
    ({"max_grad_norm": float("inf")}, "max_grad_norm must be a positive finite number"),
    ({"nonfinite": "ignore"}, r"Accumulator\(nonfinite='ignore'\): nonfinite must be 'skip' .* or 'raise'"),
])
def test_bad_constructor_values(kwargs, match):
    model = regression_model()
    with pytest.raises(ValueError, match=match):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_wrong_types():
    model = regression_model()
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got list"):
        Accumulator(model, [])
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        Accumulator(lambda x: x, torch.optim.SGD(model.parameters(), lr=0.1))


def test_loss_fn_that_returns_a_vector(setup):
    _, _, acc = setup
    with pytest.raises(ValueError, match=r"loss must be a scalar tensor .* got \(2, 3\)"):
        acc.step(regression_batch(4), lambda m, b: (m(b[0]) - b[1]).pow(2), micro_batch_size=2)


def test_window_misuse(setup):
    model, _, acc = setup
    x, y = regression_batch(4)
    with pytest.raises(RuntimeError, match="must run inside `with window.micro_batch"):
        with acc.window(2) as w:
            w.backward(mse(model, (x, y)), 4)
    with pytest.raises(RuntimeError, match="opened for 2 micro-batches but 1 ran"):
        with acc.window(2) as w:
            with w.micro_batch():
                w.backward(mse(model, (x, y)), 4)
            w.step()
    with pytest.raises(RuntimeError, match="closed without step"):
        with acc.window(1) as w:
            with w.micro_batch():
                w.backward(mse(model, (x, y)), 4)


def test_a_nested_micro_batch_and_a_second_backward_name_their_cause(setup):
    """A micro_batch() block opened inside another, and a second window.backward in one block, are each refused
    when they happen, naming what happened and the fix (they used to surface at step() as "opened for N
    micro-batches but M ran"), before the second backward reaches the gradient: no step, nothing left behind."""
    model, _, acc = setup
    x, y = regression_batch(4)
    with pytest.raises(RuntimeError) as nested:
        with acc.window(2) as w:
            with w.micro_batch():
                with w.micro_batch():
                    w.backward(mse(model, (x, y)), 4)
    assert str(nested.value) == (
        "window.micro_batch() opened inside another micro_batch() (micro-batch 1 of the window is still open): each "
        "micro-batch is one block, one after the other; close the open block before opening the next, and run one "
        "window.backward in each")
    with pytest.raises(RuntimeError) as twice:
        with acc.window(2) as w:
            with w.micro_batch():
                w.backward(mse(model, (x, y)), 4)
            with w.micro_batch():
                w.backward(mse(model, (x, y)), 4)
                w.backward(mse(model, (x, y)), 4)
    assert str(twice.value) == (
        "window.backward called twice in one micro-batch (micro-batch 2 of the window): each `with "
        "window.micro_batch():` block runs one forward and one window.backward(loss, num_items=...); add the "
        "losses into one before its backward, or give each its own micro_batch() block (and the window as many "
        "micro-batches)")
    assert acc.steps == 0
    with pytest.raises(RuntimeError, match=r"^the window was opened for 1 micro-batch and all have run;"):
        with acc.window(1) as w:
            with w.micro_batch():
                w.backward(mse(model, (x, y)), 4)
            w.micro_batch()


def test_the_second_backward_is_refused_before_it_reaches_the_gradient():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = regression_batch(4)
    with acc.window(1) as w:
        with w.micro_batch():
            w.backward(mse(model, (x, y)), 4)
            grads = [p.grad.clone() for p in model.parameters()]
            with pytest.raises(RuntimeError, match="window.backward called twice in one micro-batch"):
                w.backward(mse(model, (x, y)), 4)
            assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
        w.step()
    assert acc.steps == 1


@pytest.mark.parametrize("window", ["tuple", "list"])
def test_a_batch_given_as_a_window_is_refused(setup, window):
    """`step((X, Y), loss_fn)` without micro_batch_size used to run X and then Y as two micro-batches."""
    _, _, acc = setup
    x, y = regression_batch(6)
    batch = (x, y) if window == "tuple" else [x, y]
    with pytest.raises(ValueError, match=r"ambiguous.*micro_batch_size=M.*list of micro-batches"):
        acc.step(batch, mse)


def test_a_window_of_single_tensor_micro_batches_goes_in_tuples():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = regression_batch(6)
    result = acc.step([(x[:4],), (x[4:],)], lambda m, b: m(b[0]).pow(2).mean())
    assert result.num_items == 6 and result.micro_batches == 2


def test_a_micro_batch_block_kept_after_its_window_closed_is_refused():
    """The block ``window.micro_batch()`` returns belongs to its window: entered after the window closed, it
    says where it must run (on one process in fp32 the block switches nothing, and is one object per
    Accumulator)."""
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with acc.window(1) as w:
        block = w.micro_batch()
        with block:
            w.backward(mse(model, regression_batch(3, seed=1)), 3)
        w.step()
    with pytest.raises(RuntimeError, match=r"use window.micro_batch\(\) inside `with acc.window"):
        with block:
            pass


def test_a_window_s_weights_read_before_it_opens_say_where_to_read_them():
    """``window.weights`` is made from the window's setup: read before ``with`` opens it, it says where."""
    model = regression_model()
    window = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1)).window(1)
    with pytest.raises(RuntimeError, match=r"read window.weights inside `with acc.window"):
        window.weights


def test_a_switching_micro_batch_block_kept_for_a_later_window_is_refused():
    """Under autocast (or across ranks) a block carries its window's switches (which micro-batch reduces):
    entered inside a later window it would switch that window wrongly, so it says where it must run."""
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    batch = regression_batch(3, seed=1)
    with acc.window(1) as w:
        block = w.micro_batch()
        with block:
            w.backward(mse(model, batch), 3)
        w.step()
    with acc.window(1) as later:
        with pytest.raises(RuntimeError, match=r"use window.micro_batch\(\) inside `with acc.window"):
            with block:
                pass
        with later.micro_batch():
            later.backward(mse(model, batch), 3)
        later.step()


def test_a_window_inside_an_open_window_is_refused_and_the_outer_one_survives():
    from helpers import clone_pair, reference_step, assert_params_close

    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    acc = Accumulator(model, opt, compute_grad_norm=True)
    a, b = regression_batch(3, seed=1), regression_batch(5, seed=2)
    with acc.window(2) as w:
        with w.micro_batch():
            w.backward(mse(model, a), 3)
        with pytest.raises(RuntimeError, match="a window is already open"):
            acc.step(b, mse, micro_batch_size=2)
        with pytest.raises(RuntimeError, match="a window is already open"):
            acc.window(1)
        with pytest.raises(RuntimeError, match="a window is already open"):
            acc.train([b], mse, accum_steps=1)
        with w.micro_batch():
            w.backward(mse(model, b), 5)
        result = w.step()
    reference_step(ref, ref_opt, lambda: mse(ref, tuple(torch.cat(t) for t in zip(a, b))))
    assert result.num_items == 8 and result.grad_norm > 0
    assert_params_close(model, ref)
    acc.step(b, mse, micro_batch_size=2)  # closed: usable again


def test_an_optimizer_over_another_models_parameters_is_refused():
    model, other = regression_model(), regression_model(seed=1)
    with pytest.raises(ValueError, match="the optimizer holds none of the Sequential's 4 trainable parameters"):
        Accumulator(model, torch.optim.SGD(other.parameters(), lr=0.1))
    frozen_head = regression_model()
    frozen_head[2].requires_grad_(False)  # an optimizer over part of the model is fine
    Accumulator(frozen_head, torch.optim.SGD(frozen_head[0].parameters(), lr=0.1))


def test_data_parallel_must_be_auto_or_none():
    model = regression_model()
    with pytest.raises(ValueError, match="data_parallel must be 'auto' or 'none', got 'ddp'"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), data_parallel="ddp")


@pytest.mark.parametrize("count, match", [(-1, "num_items must be a finite number >= 0"),
                                          (float("nan"), "num_items must be a finite number >= 0"),
                                          (torch.ones(2), "num_items must be one number")])
def test_bad_num_items(setup, count, match):
    model, _, acc = setup
    x, y = regression_batch(4)
    with pytest.raises(ValueError, match=match):
        with acc.window(1) as w:
            with w.micro_batch():
                w.backward(mse(model, (x, y)), count)


def test_a_detached_loss_is_our_error(setup):
    model, _, acc = setup
    with pytest.raises(ValueError, match="loss does not require grad"):
        acc.step(regression_batch(4), lambda m, b: mse(m, b).detach(), micro_batch_size=2)


def test_load_state_dict_names_missing_and_unknown_keys_and_what_a_state_holds():
    """One line, gradaccum's own error (it was a bare KeyError), raised before anything is loaded."""
    from gradaccum import ConfigurationError

    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.state.steps = 3
    holds = ("an Accumulator's state holds steps, skipped, epoch, reference, count_ratio, last_window_items, "
             "auto_micro_batch_size, counts_first, scheduler_at and precision: pass what Accumulator.state_dict() returned (e.g. "
             "checkpoint['accumulator'], not the whole checkpoint)")
    unknown = "which no Accumulator state holds"
    for state, said in (({"x": 1}, f"lacks 'steps', 'precision' and holds 'x', {unknown}"),
                        ({"auto_micro_batch_size": None}, "lacks 'steps', 'precision'"),
                        ({**acc.state_dict(), "steps": 8, "skiped": 1}, f"holds 'skiped', {unknown}"),
                        ({"model": {}, "accumulator": acc.state_dict()},
                         f"lacks 'steps', 'precision' and holds 'model', 'accumulator', {unknown}")):
        with pytest.raises(ConfigurationError) as info:
            acc.load_state_dict(state)
        assert str(info.value) == f"Accumulator.load_state_dict: the state {said}; {holds}"
        assert acc.steps == 3


def test_check_equivalence_refuses_vector_and_detached_losses():
    from gradaccum import check_equivalence

    model = regression_model()
    with pytest.raises(ValueError, match=r"must return a scalar loss .* got \(8, 3\)"):
        check_equivalence(model, lambda m, b: (m(b[0]) - b[1]).pow(2), regression_batch(8), 4)
    with pytest.raises(ValueError, match="does not require grad"):
        check_equivalence(model, lambda m, b: mse(m, b).detach(), regression_batch(8), 4)
    assert all(p.grad is None for p in model.parameters())


def test_a_list_of_micro_batches_with_micro_batch_size_is_refused():
    """Issue 34, item 2: the whole list reached loss_fn as one micro-batch, and the model raised a
    TypeError of its own; now it is refused as the ambiguous tuple is, before anything runs."""
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    (x, y) = regression_batch(8)
    with pytest.raises(SplitError, match=r"window is a list of 2 micro-batches and micro_batch_size=4 was given"):
        acc.step([(x[:4], y[:4]), (x[4:], y[4:])], mse, micro_batch_size=4)
    with pytest.raises(SplitError, match="a list of 2 micro-batches"):
        acc.step([{"x": x[:4]}, {"x": x[4:]}], lambda m, b: m(b["x"]).pow(2).mean(), micro_batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and acc.steps == 0
    acc.step([x, y], mse, micro_batch_size=4)  # one batch given as a list of tensors is still one batch
    assert acc.steps == 1


PIPELINE = ("the Accumulator does not run a pipeline's stages; hand them to gradaccum.PipelineWindow(stages, "
            "optimizer, loss_fn, n_microbatches=..., reduction='sum'), build the torch.distributed.pipelining "
            "schedule with loss_fn=pipe.loss and scale_grads=False, and step pipe.step(schedule, ...) "
            "(gradaccum.pipeline, docs/guides/pipeline.md)")


@pytest.mark.parametrize("module, name", [("torch.distributed.pipelining.stage", "PipelineStage"),
                                          ("torch.distributed.pipelining._IR", "Pipe"),
                                          ("torch.distributed.pipelining.schedules", "ScheduleGPipe")])
def test_a_pipeline_stage_is_refused_with_what_is_supported(module, name):
    """A torch.distributed.pipelining object (the classes in type only: nothing initialised) is refused with what
    gradaccum supports, not told to wrap a stage in DDP (which then fails: the ranks hold different models)."""
    import importlib

    from gradaccum import NotExactError

    cls = getattr(importlib.import_module(module), name)
    stage = cls.__new__(cls)
    if isinstance(stage, torch.nn.Module):
        torch.nn.Module.__init__(stage)
    model = regression_model()
    with pytest.raises(NotExactError) as info:
        Accumulator(stage, torch.optim.SGD(model.parameters(), lr=0.1))
    assert str(info.value) == f"model is a {name}: {PIPELINE}"


def test_an_unwrapped_model_under_several_ranks_is_not_told_to_wrap_a_pipeline_stage(monkeypatch):
    """Under several ranks a model no wrapper reduces is refused (torchrun: tests/distributed/worker.py); the
    message says to wrap the whole model, and that a pipeline stage has no route, instead of only 'wrap it'."""
    import gradaccum.sync as sync

    monkeypatch.setattr(sync, "is_distributed", lambda: True)
    monkeypatch.setattr(sync.dist, "get_world_size", lambda group=None: 2)
    model = regression_model()
    with pytest.raises(ValueError) as info:
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    said = str(info.value)
    assert "Wrap the whole model, the same on every rank (DistributedDataParallel(model)" in said
    assert said.endswith(f"Where each rank holds a stage of a pipeline: {PIPELINE}"), said
