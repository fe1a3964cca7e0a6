"""PeakMeter: the peak bytes a region allocated, from the allocator itself.

Sizes are known exactly here (``torch.empty`` of n float32 asks the allocator for 4 n bytes), so
the bounds are tight below and loose above only by what torch may allocate on the side.
"""
import pytest
import torch
from torch import nn

from gradaccum import Accumulator
from gradaccum.memory import PeakMemory, PeakMeter, replay, state_bytes

MiB = 2**20
SLACK = 256 * 1024  # what torch may allocate beside the tensors a test makes


def test_peak_is_at_least_the_sum_of_live_tensors():
    """Two tensors alive together: the peak holds both, and not much more."""
    with PeakMeter("cpu") as meter:
        a = torch.empty(MiB // 4)          # 1 MiB
        b = torch.empty(2 * MiB // 4)      # 2 MiB
    peak = meter.result.peak_bytes
    assert 3 * MiB <= peak <= 3 * MiB + SLACK
    assert meter.result.retained_bytes >= 3 * MiB
    assert meter.result.allocations >= 2
    del a, b


def test_a_freed_tensor_still_counts_towards_the_peak():
    """4 MiB freed before 1 MiB is allocated: the peak is the 4 MiB, what remains is the 1 MiB."""
    with PeakMeter("cpu") as meter:
        big = torch.empty(4 * MiB // 4)
        del big
        small = torch.empty(MiB // 4)
    result = meter.result
    assert 4 * MiB <= result.peak_bytes < 5 * MiB
    assert MiB <= result.retained_bytes <= MiB + SLACK
    del small


def test_memory_from_before_the_region_is_not_counted():
    """Freeing an older tensor inside the region neither lowers the figure below zero nor raises it."""
    old = torch.empty(8 * MiB // 4)
    with PeakMeter("cpu") as meter:
        del old
        new = torch.empty(MiB // 4)
    assert MiB <= meter.result.peak_bytes <= MiB + SLACK
    del new


def test_intermediate_tensors_of_an_expression_count():
    """(a * 2) + 1 materializes a temporary the size of a: the peak holds it and the result."""
    a = torch.ones(MiB // 4)
    with PeakMeter("cpu") as meter:
        out = (a * 2) + 1
    assert 2 * MiB <= meter.result.peak_bytes <= 2 * MiB + SLACK
    assert MiB <= meter.result.retained_bytes <= MiB + SLACK
    del out


def test_a_training_step_peaks_above_its_gradients_and_frees_them():
    """One window allocates the gradient buffer (freed at the step's end) and the activations."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(model, opt)
    batch = (torch.randn(64, 256), torch.randint(0, 10, (64,)))

    def loss_fn(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    acc.step(batch, loss_fn, micro_batch_size=16)  # momentum buffers exist from here on
    with PeakMeter("cpu") as meter:
        acc.step(batch, loss_fn, micro_batch_size=16)
    sizes = state_bytes(model, opt)
    activations = 16 * (512 + 512 + 10) * 4  # one micro-batch's hidden layer, its ReLU and logits
    assert meter.result.peak_bytes >= sizes["gradients"] + activations
    assert meter.result.peak_bytes <= 3 * sizes["gradients"] + 64 * activations  # sane, not exact
    assert meter.result.retained_bytes < sizes["gradients"]  # gradients were cleared after the step


def test_the_meter_stops_on_an_exception_and_can_be_used_again():
    meter = PeakMeter("cpu")
    with pytest.raises(KeyError):
        with meter:
            x = torch.empty(MiB // 4)
            raise KeyError("boom")
    assert not torch.autograd._profiler_enabled()
    assert meter.result.peak_bytes >= MiB
    del x
    with meter:
        y = torch.empty(2 * MiB // 4)
    assert 2 * MiB <= meter.result.peak_bytes <= 2 * MiB + SLACK
    del y


def test_inside_another_profiler_it_says_why_it_cannot_run():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="cannot run while a PyTorch profiler is active"):
            with PeakMeter("cpu"):
                pass
    assert not torch.autograd._profiler_enabled()


def test_result_before_a_block_is_an_error():
    with pytest.raises(RuntimeError, match="after a `with PeakMeter"):
        PeakMeter("cpu").result


def test_unsupported_device_names_the_supported_ones():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'.*got device='meta'"):
        PeakMeter("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_without_a_gpu_says_so():
    with pytest.raises(ValueError, match="CUDA is not available here"):
        PeakMeter("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_from_the_caching_allocator():
    """The caching allocator rounds blocks up (to 512 bytes, or 2 MiB segments), hence the slack."""
    with PeakMeter("cuda") as meter:
        a = torch.empty(4 * MiB // 4, device="cuda")
        del a
        b = torch.empty(MiB // 4, device="cuda")
    assert 4 * MiB <= meter.result.peak_bytes <= 4 * MiB + 2 * MiB
    assert meter.result.device.startswith("cuda")
    del b


def test_replay_ignores_frees_from_before_and_follows_address_reuse():
    events = [
        (1, 0xA, 100),   # allocate 100 at A
        (2, 0xF, -500),  # free a block from before the region: ignored
        (3, 0xA, -100),  # free A
        (4, 0xA, 40),    # A reused for 40
        (5, 0xB, 70),    # 110 live
    ]
    assert replay(events) == (110, 110, 3)
    assert replay(list(reversed(events))) == (110, 110, 3)  # time order, not list order
    assert replay([]) == (0, 0, 0)


def test_state_bytes_counts_parameters_gradients_and_optimizer_state():
    model = nn.Linear(10, 5)  # 55 parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert state_bytes(model, opt) == {"parameters": 220, "gradients": 220, "optimizer_state": 0}
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    assert state_bytes(model, opt)["optimizer_state"] == 220


def test_result_is_a_frozen_record():
    with PeakMeter("cpu") as meter:
        pass
    assert isinstance(meter.result, PeakMemory)
    assert meter.result.peak_bytes == 0
    with pytest.raises(AttributeError):
        meter.result.peak_bytes = 1  # type: ignore[misc]
