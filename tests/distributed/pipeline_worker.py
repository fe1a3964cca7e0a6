"""gradaccum.PipelineWindow under torchrun, 2 gloo processes on the CPU (#49; see test_pipeline.py).

A float64 MLP over token positions, split in 2 stages (or 4 virtual stages, 2 per rank), against one
float64 big batch on the *unsplit* model: the padded token loss's sum over the window divided by its N,
clipped as ``clip_grad_norm_`` clips, one SGD step. Micro-batches hold 23, 3, 9 and 22 target tokens
(the rest ignore_index -100); the second window is short (2 of the schedule's 4 micro-batches). Beside
gradaccum the stock schedule (a mean loss, ``scale_grads=True``) and ``scale_grads=False`` with the mean
loss are measured on the first window's gradient, so the scenario has teeth. Each scenario prints
``PASS <name>: stock <Δ>, mean <Δ>, gradaccum <Δ>`` (the guide quotes those figures).
"""
from __future__ import annotations

import copy
import math
import os
import sys
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: distributed.launch

from distributed.launch import run_guide_torchrun_blocks, run_modules  # noqa: E402
from gradaccum import ConfigurationError, NotExactError, PipelineWindow  # noqa: E402

RANK, WORLD = 0, 1
D, H, V, SEQ, ROWS, K = 6, 12, 9, 16, 2, 4   # features, hidden, vocabulary, positions, rows per micro-batch, K
LAYERS = [(0, 2), (2, 4), (4, 6), (6, 7)]    # the 4 virtual stages' slices of the unsplit model
WINDOWS = [[23, 3, 9, 22], [5, 17]]          # target tokens per micro-batch: a full window, then a short one
LR, CLIP = 0.5, 0.05                          # CLIP below the first window's norm: clipping engaged


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh(),
                         nn.Linear(H, V)).double()


def token_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The padded token loss as a sum over its targets (what gradaccum's schedule is built with)."""
    return F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=-100, reduction="sum")


def token_mean(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The stock schedule's loss: the mean over a micro-batch's targets."""
    return F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=-100)


def window(counts: Sequence[int], seed: int):
    """(inputs, targets) of one window: micro-batch k holds counts[k] targets, the others -100."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(counts) * ROWS, SEQ, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (len(counts) * ROWS, SEQ), generator=g)
    for k, c in enumerate(counts):
        block = y[k * ROWS:(k + 1) * ROWS].reshape(-1)
        block[torch.randperm(block.numel(), generator=g)[c:]] = -100
    return x, y


def big_batch(full: nn.Module, windows, clip=CLIP, lr=LR) -> List[float]:
    """The reference: each window (its parts joined: micro-batches, replicas) one float64 step of the
    unsplit model on sum_k S_k / N, clipped by clip_grad_norm_. Returns the norms before clipping."""
    opt, norms = torch.optim.SGD(full.parameters(), lr=lr), []
    for x, y in windows:
        n = (y != -100).sum()
        if n == 0:
            continue
        (token_sum(full(x), y) / n).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(full.parameters(), clip if clip else math.inf)))
        opt.step()
        opt.zero_grad()
    return norms


def placement(layout: str, r: int) -> List[int]:
    """Pipeline rank r's stage indices: 2 stages ("single"), 4 looped ("interleaved") or V-shaped ("v")."""
    return {"single": [r], "interleaved": [r, r + 2], "v": [r, 3 - r]}[layout]


def stage_slice(index: int, layout: str):
    return (LAYERS[0][0], LAYERS[1][1]) if layout == "single" and index == 0 else \
        (LAYERS[2][0], LAYERS[3][1]) if layout == "single" else LAYERS[index]


def build(full: nn.Module, layout: str, group=None, wrap=None):
    """This rank's stages (copies of the unsplit model's slices, each wrapped by ``wrap``) and their modules."""
    from torch.distributed.pipelining import PipelineStage

    num_stages = 2 if layout == "single" else 4
    modules, stages = [], []
    for index in placement(layout, dist.get_rank(group)):
        a, b = stage_slice(index, layout)
        module = copy.deepcopy(full[a:b])
        modules.append((module, full[a:b]))
        stages.append(PipelineStage(wrap(module) if wrap else module, index, num_stages, torch.device("cpu"),
                                    group=group))
    return stages, modules


def schedule_over(schedule_cls, stages, loss_fn, scale_grads: bool):
    """The schedule over this rank's stages (one stage, or the list of an interleaved or V layout)."""
    return schedule_cls(stages[0] if len(stages) == 1 else stages, n_microbatches=K, loss_fn=loss_fn,
                        scale_grads=scale_grads)


def window_over(schedule_cls, stages, modules, opt=None, reduction="sum", **options):
    """gradaccum's window over the stages, and the schedule built with its ``pipe.loss``."""
    opt = opt or torch.optim.SGD([p for m, _ in modules for p in m.parameters()], lr=LR)
    pipe = PipelineWindow(stages, opt, token_sum if reduction == "sum" else token_mean, n_microbatches=K,
                          reduction=reduction, **options)
    return schedule_over(schedule_cls, stages, pipe.loss, False), pipe


class AllReduces:
    """Counts this rank's ``torch.distributed.all_reduce`` calls while active (as worker.py's CountCalls)."""

    def __enter__(self):
        self.calls, self._real = 0, dist.all_reduce

        def counting(*args, **kwargs):
            self.calls += 1
            return self._real(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


def run_schedule(schedule, stages, x, y, pipe=None):
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    args = (x,) if first else ()
    if pipe is not None:
        return pipe.step(schedule, *args, target=y if last else None)
    schedule.step(*args, target=y if last else None, return_outputs=False)


def worst(values) -> float:
    """The largest of this rank's values, over every rank (all ranks then judge the same number)."""
    t = torch.tensor([max(values, default=0.0)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor's global value (fully_shard's DTensor shards gathered)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def grad_delta(modules, reference_grads: Dict[int, torch.Tensor]) -> float:
    """max |g - g_ref| / max |g_ref| over every stage's parameters (the stock routes' first window)."""
    num, den = [], []
    for module, ref in modules:
        for p, q in zip(module.parameters(), ref.parameters()):
            num.append(float((whole(p.grad) - reference_grads[id(q)]).abs().max()))
            den.append(float(reference_grads[id(q)].abs().max()))
    return worst(num) / worst(den)


def param_delta(modules, before: Dict[int, torch.Tensor]) -> float:
    """max |p - p_ref| / max |p_ref - p_0| over every stage: the distance from the big batch's update."""
    num, den = [], []
    for module, ref in modules:
        for p, q in zip(module.parameters(), ref.parameters()):
            num.append(float((whole(p.detach()) - q.detach()).abs().max()))
            den.append(float((q.detach() - before[id(q)]).abs().max()))
    return worst(num) / worst(den)


def stock_deltas(schedule_cls, layout: str, mine, joined, group=None, wrap=None) -> List[float]:
    """The stock schedule (mean loss, scale_grads=True) and scale_grads=False with the mean loss: each
    one window's gradient (``mine``: this replica's part) against the big batch's (``joined``: every
    replica's parts)."""
    full = model()
    x, y = torch.cat([x for x, _ in joined]), torch.cat([y for _, y in joined])
    (token_sum(full(x), y) / (y != -100).sum()).backward()
    reference = {id(p): p.grad.clone() for p in full.parameters()}
    deltas = []
    for scale_grads in (True, False):
        stages, modules = build(full, layout, group, wrap)
        schedule = schedule_over(schedule_cls, stages, token_mean, scale_grads)
        run_schedule(schedule, stages, *mine)
        deltas.append(grad_delta(modules, reference))
    return deltas


def exact_route(schedule_cls, layout: str, *, reduction="sum", windows=(WINDOWS,), replica=0, pp_group=None,
                dp_group=None, wrap=None) -> str:
    """gradaccum over ``schedule_cls`` against the big batch: a full window (clipping engaged), then a
    short one; the stock routes measured beside it. ``windows``: each replica's target counts per window
    (the big batch joins the replicas' parts); this rank runs replica ``replica``'s."""
    data = [[window(c, seed=10 + 100 * r + i) for i, c in enumerate(counts)] for r, counts in enumerate(windows)]
    joined = [(torch.cat([d[i][0] for d in data]), torch.cat([d[i][1] for d in data])) for i in range(len(data[0]))]
    stock, mean = stock_deltas(schedule_cls, layout, data[replica][0], [d[0] for d in data], pp_group, wrap)
    full = model()
    before = {id(p): p.detach().clone() for p in full.parameters()}
    stages, modules = build(full, layout, pp_group, wrap)
    schedule, pipe = window_over(schedule_cls, stages, modules, reduction=reduction, micro_batch_size=ROWS,
                                 max_grad_norm=CLIP, pp_group=pp_group, dp_group=dp_group)
    results, calls = [], []
    for x, y in data[replica]:
        with AllReduces() as counted:
            results.append(run_schedule(schedule, stages, x, y, pipe))
        calls.append(counted.calls)
    norms = big_batch(full, joined)
    delta = param_delta(modules, before)
    items = [sum(sum(counts[i]) for counts in windows) for i in range(len(windows[0]))]
    last = any(s.is_last for s in stages)
    expected = 1 if dp_group is None else 2 + last   # pp boundary; dp boundary, and N on the last stage
    assert calls == [expected] * len(calls), f"all_reduce calls per window {calls}, expected {expected}"
    assert results[0].grad_norm > CLIP, f"clipping not engaged: norm {results[0].grad_norm}"
    assert [r.micro_batches for r in results] == [len(c) for c in windows[replica]], results
    assert [r.num_items for r in results] == items, ([r.num_items for r in results], items)
    assert abs(results[0].grad_norm - norms[0]) <= 1e-12 * norms[0], (results[0].grad_norm, norms[0])
    assert delta <= 1e-12, f"gradaccum {delta:.1e} from the big batch (stock {stock:.1e}, mean {mean:.1e})"
    assert stock >= 1e-3 and mean >= 1e-3, f"the stock routes are {stock:.1e} and {mean:.1e} off: no teeth"
    return f"stock {stock:.1e}, mean {mean:.1e}, gradaccum {delta:.1e}"


def gpipe():
    from torch.distributed.pipelining import ScheduleGPipe
    return exact_route(ScheduleGPipe, "single")


def one_f_one_b():
    from torch.distributed.pipelining import Schedule1F1B
    return exact_route(Schedule1F1B, "single")


def interleaved_1f1b():
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    return exact_route(ScheduleInterleaved1F1B, "interleaved")


def looped_bfs():
    from torch.distributed.pipelining import ScheduleLoopedBFS
    return exact_route(ScheduleLoopedBFS, "interleaved")


def interleaved_zero_bubble():
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
    return exact_route(ScheduleInterleavedZeroBubble, "interleaved")


def zbv_zero_bubble():
    from torch.distributed.pipelining import ScheduleZBVZeroBubble
    return exact_route(ScheduleZBVZeroBubble, "v")


def declared_mean_with_an_empty_micro_batch():
    """reduction="mean": L_k weighed n_k W / N; a micro-batch of 0 targets (nan mean) brings 0."""
    from torch.distributed.pipelining import Schedule1F1B
    return exact_route(Schedule1F1B, "single", reduction="mean", windows=([[23, 0, 9, 22], [5, 17]],))


def shape_inference_call_is_recognised_after_eval():
    """The stage's shape inference calls pipe.loss once more on a (re)initializing step: the first, and the
    first after schedule.eval (which calls it outside step: your loss itself). A mean loss (its weight
    depends on the micro-batch) over a window, an eval, a second window: both the big batch's steps."""
    from torch.distributed.pipelining import Schedule1F1B

    full = model()
    stages, modules = build(full, "single")
    schedule, pipe = window_over(Schedule1F1B, stages, modules, reduction="mean", max_grad_norm=CLIP)
    data = [window([23, 3, 9, 22], seed=30), window([1, 30, 4, 2], seed=31)]
    before = {id(p): p.detach().clone() for p in full.parameters()}
    run_schedule(schedule, stages, *data[0], pipe)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses = []
    schedule.eval(*((data[1][0],) if first else ()), target=data[1][1] if last else None, losses=losses)
    result = run_schedule(schedule, stages, *data[1], pipe)
    big_batch(full, data)
    delta = param_delta(modules, before)
    if last:
        assert len(losses) == K and all(torch.isfinite(l) for l in losses), losses
    assert not result.skipped and result.step == 2 and delta <= 1e-12, (result, delta)
    return f"2 windows around an eval: {delta:.1e} from the big batch"


def empty_and_nonfinite_windows_skip_on_every_stage():
    """A window of no target and a window with a nan input: no optimizer step on any stage, gradients
    cleared, counted as skipped; the next window is the big batch's step."""
    from torch.distributed.pipelining import ScheduleGPipe

    full = model()
    stages, modules = build(full, "single")
    opt = torch.optim.SGD([p for m, _ in modules for p in m.parameters()], lr=LR)
    steps = []
    opt.register_step_post_hook(lambda *_: steps.append(1))
    schedule, pipe = window_over(ScheduleGPipe, stages, modules, opt, max_grad_norm=CLIP)
    start = [p.detach().clone() for m, _ in modules for p in m.parameters()]
    empty = window([0, 0, 0, 0], seed=3)
    nan_x, nan_y = window([5, 6, 7, 8], seed=4)
    nan_x[1, 3, 0] = math.nan
    results = [run_schedule(schedule, stages, *empty, pipe), run_schedule(schedule, stages, nan_x, nan_y, pipe)]
    same = all(torch.equal(p, q) for p, q in zip(start, (p for m, _ in modules for p in m.parameters())))
    cleared = all(p.grad is None for m, _ in modules for p in m.parameters())
    assert [r.skipped for r in results] == [True, True] and not steps and same and cleared, (results, steps, same)
    assert math.isnan(results[1].grad_norm) and (pipe.state.skipped, pipe.state.steps) == (2, 0), results
    good = window(WINDOWS[0], seed=5)
    before = {id(p): p.detach().clone() for p in full.parameters()}
    result = run_schedule(schedule, stages, *good, pipe)
    big_batch(full, [good])
    delta = param_delta(modules, before)
    assert not result.skipped and steps == [1] and delta <= 1e-12, (result, steps, delta)
    return f"skipped: {results[0].num_items} items, then nan; the next window {delta:.1e} from the big batch"


def resume_is_bit_identical():
    """3 windows straight, against 1 window, a checkpoint (stages, AdamW, scheduler, the window's state)
    loaded into new objects, and 2 more: equal bit for bit."""
    from torch.distributed.pipelining import Schedule1F1B

    data = [window(c, seed=20 + i) for i, c in enumerate([[23, 3, 9, 22], [1, 30, 4, 2], [5, 17]])]

    def fresh(full):
        stages, modules = build(full, "single")
        opt = torch.optim.AdamW([p for m, _ in modules for p in m.parameters()], lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        schedule, pipe = window_over(Schedule1F1B, stages, modules, opt, micro_batch_size=ROWS,
                                     max_grad_norm=CLIP, lr_scheduler=sched)
        return schedule, stages, modules, opt, sched, pipe

    schedule, stages, modules, opt, sched, pipe = fresh(model())
    for x, y in data:
        run_schedule(schedule, stages, x, y, pipe)
    straight = [p.detach().clone() for m, _ in modules for p in m.parameters()]

    schedule, stages, modules, opt, sched, pipe = fresh(model())
    run_schedule(schedule, stages, *data[0], pipe)
    saved = copy.deepcopy({"stages": [m.state_dict() for m, _ in modules], "opt": opt.state_dict(),
                           "sched": sched.state_dict(), "window": pipe.state_dict()})
    schedule, stages, modules, opt, sched, pipe = fresh(model())
    for (m, _), state in zip(modules, saved["stages"]):
        m.load_state_dict(state)
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    pipe.load_state_dict(saved["window"])
    results = [run_schedule(schedule, stages, x, y, pipe) for x, y in data[1:]]
    resumed = [p.detach() for m, _ in modules for p in m.parameters()]
    same = torch.tensor([float(all(torch.equal(a, b) for a, b in zip(straight, resumed)))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    assert same.item() == 1.0 and results[-1].step == 3, (same, results[-1])
    return f"bit-identical after {results[-1].step} steps"


def refusals_name_the_fix():
    """a loss module whose reduction is 'none' or not the declared one, a class-weighted mean, a short window
    that is not whole micro-batches, scale_grads=True, a schedule built without pipe.loss, stages handed
    different windows."""
    from torch.distributed.pipelining import ScheduleGPipe

    full = model()
    said = []

    def refused(kind, make, expect):
        try:
            make()
        except kind as e:
            assert expect in str(e), f"{expect!r} not in {e}"
            said.append(expect)
        else:
            raise AssertionError(f"not refused: {expect}")

    stages, modules = build(full, "single")
    opt = torch.optim.SGD([p for m, _ in modules for p in m.parameters()], lr=LR)
    for loss, declared, expect in [(nn.CrossEntropyLoss(reduction="none"), "sum", "reduction='none'"),
                                   (nn.CrossEntropyLoss(reduction="mean"), "sum", "was declared"),
                                   (nn.CrossEntropyLoss(weight=torch.ones(V, dtype=torch.float64)), "mean",
                                    "class weights"),
                                   (token_sum, "none", "per-item terms")]:
        refused(NotExactError, lambda: PipelineWindow(stages, opt, loss, n_microbatches=K, reduction=declared), expect)
    # arguments that failed only inside a step (a probe: the optimizer stepped before a bad scheduler raised)
    for kind, options, expect in [(TypeError, {"optimizer": None}, "optimizer must be a torch.optim.Optimizer"),
                                  (TypeError, {"lr_scheduler": "cosine"}, "lr_scheduler must have a step() method"),
                                  (ConfigurationError, {"num_items": 5}, "num_items must be a function"),
                                  (ConfigurationError, {"max_grad_norm": True}, "max_grad_norm must be a positive"),
                                  (ConfigurationError, {"max_grad_norm": "1.0"}, "max_grad_norm must be a positive"),
                                  (ConfigurationError, {"pp_group": "world"}, "pp_group='world' is not a process")]:
        arguments = {"optimizer": opt, **options}
        refused(kind, lambda: PipelineWindow(stages, arguments.pop("optimizer"), token_sum, n_microbatches=K,
                                             reduction="sum", **arguments), expect)
    schedule, pipe = window_over(ScheduleGPipe, stages, modules, opt, micro_batch_size=ROWS)
    x, y = window([3, 4, 5, 6], seed=1)
    refused(ConfigurationError, lambda: run_schedule(schedule, stages, x[:5], y[:5], pipe), "of micro_batch_size=2 rows")
    stock = schedule_over(ScheduleGPipe, stages, token_mean, True)
    refused(ConfigurationError, lambda: run_schedule(stock, stages, x, y, pipe), "build it with scale_grads=False")
    # the schedule's own loss, not pipe.loss: counted on the last stage, refused on every stage before the step
    own = schedule_over(ScheduleGPipe, stages, token_sum, False)
    refused(ConfigurationError, lambda: run_schedule(own, stages, x, y, pipe), "build the schedule with loss_fn=pipe.loss")
    # the first stage given 4 micro-batches, the last 3: refused on both, nothing stepped
    last = any(s.is_last for s in stages)
    refused(ConfigurationError, lambda: run_schedule(schedule, stages, x, y[:6] if last else y, pipe),
            "pass both stages the same window")
    assert pipe.state.steps == 0 and all(p.grad is None for m, _ in modules for p in m.parameters())
    return f"{len(said)} refusals"


def guide_example_runs_as_written():
    """docs/guides/pipeline.md's torchrun block, as written, in this launch (the group already joined:
    its init_process_group and destroy_process_group stand aside); 3 steps, the last window short."""
    [(namespace, _)] = run_guide_torchrun_blocks("pipeline.md")
    result = namespace["result"]
    assert (result.step, result.micro_batches, result.skipped) == (3, 2, False), result
    return f"3 steps, the last over {result.num_items} tokens"


#: the guide's table: its row per scenario (the measured figures are checked against it by the tests)
GUIDE_ROWS = {"gpipe": "GPipe", "one_f_one_b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
              "looped_bfs": "LoopedBFS", "interleaved_zero_bubble": "InterleavedZeroBubble",
              "zbv_zero_bubble": "ZBVZeroBubble",
              "fsdp2_1f1b_uneven_items_across_replicas": "1F1B, 2 stages x 2 replicas (fully_shard), 57 and 43 tokens"}


def assert_guide_quotes(line: str, name: str) -> None:
    """The guide's row for scenario ``name`` quotes the three figures its PASS line printed."""
    import re
    from pathlib import Path

    from transcripts import assert_figure

    text = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "pipeline.md").read_text()
    row = next(r for r in text.splitlines() if r.startswith(f"| {GUIDE_ROWS[name]} |"))
    quoted = [c.strip() for c in row.strip("|").split("|")[1:]]
    printed = re.search(r"stock (\S+), mean (\S+), gradaccum (\S+)$", line).groups()
    for q, p in zip(quoted, printed):
        assert_figure(q, p, f"docs/guides/pipeline.md's row {GUIDE_ROWS[name]!r}")


SCENARIOS = [gpipe, one_f_one_b, interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv_zero_bubble,
             declared_mean_with_an_empty_micro_batch, shape_inference_call_is_recognised_after_eval,
             empty_and_nonfinite_windows_skip_on_every_stage,
             resume_is_bit_identical, refusals_name_the_fix, guide_example_runs_as_written]

if __name__ == "__main__":
    run_modules([sys.modules[__name__]], sys.argv[1:])
