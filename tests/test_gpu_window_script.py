"""benchmarks/gpu_window.py, the GPU check issue 48 asks a session with a GPU to run, runs end to end on a
tiny GPT-2 on the CPU (its figures mean nothing here): the script a GPU session starts is known to work."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_every_loop_on_a_tiny_model(capsys):
    pytest.importorskip("transformers")
    saved = list(sys.path)  # the script puts benchmarks/ first, whose distributed.py would shadow tests/distributed
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_window
    finally:
        sys.path[:] = saved
    results = gpu_window.main(["--device", "cpu", "--tiny", "--windows", "2"])
    assert list(results) == ["hand loop", "acc.step", "Trainer, GA 4", "ExactTrainer, GA 4"]
    for r in results.values():
        assert r["device_syncs"] is None and r["host_reads"] == 0 and r["seconds"] > 0  # a CPU tensor's reads are free
    table = capsys.readouterr().out.splitlines()[-4:]
    assert [row.split(" | ")[0] for row in table] == [f"| {name}" for name in results]


def test_the_counter_counts_each_read_of_a_device_tensor_and_none_of_a_cpu_tensor():
    """The Python column's teeth on a machine without a GPU: a stand-in whose device is CUDA is counted once
    per read (each of the six ways Python asks a tensor for its value), a CPU tensor's reads not at all."""
    from types import SimpleNamespace

    import torch

    saved = list(sys.path)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_window
    finally:
        sys.path[:] = saved
    on_device = SimpleNamespace(device=torch.device("cuda"))  # a tensor's device as the counter reads it
    with gpu_window.Syncs(torch.device("cpu")) as syncs:
        for read in gpu_window.Syncs.READS:
            with pytest.raises(TypeError):  # the real read refuses the stand-in, after it was counted
                getattr(torch.Tensor, read)(on_device)
        cpu = torch.tensor(2.0)
        cpu.item(), cpu.tolist(), float(cpu), int(cpu), bool(cpu), cpu.cpu()
    assert syncs.host_reads == len(gpu_window.Syncs.READS) == 6 and syncs.device_syncs is None
    assert torch.Tensor.item is syncs.saved["item"]  # put back on the way out
