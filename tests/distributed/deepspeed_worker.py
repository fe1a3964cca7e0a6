"""DeepSpeed ZeRO-1/2/3 around the Accumulator, under torchrun with 2 gloo processes on the CPU
(``DS_ACCELERATOR=cpu``; see test_deepspeed.py). Every scenario runs in this one launch: DeepSpeed
imports (and, once per machine, builds its CPU communication op) once.

Each scenario compares against single-process float64 steps on the union of both ranks' windows,
computed on every rank. DeepSpeed keeps float32 master weights (ZeRO-3 refuses float64 parameters),
so the model is float32 and the tolerance is float32's: 1e-6 relative to the reference's move. The
stock routes run beside on the same data, so the table below has teeth: DeepSpeed's own accumulation
(managed, the mean loss per micro-batch, ``gradient_accumulation_steps`` backward passes per step) and
the caller-owned boundary without the data-parallel factor W.

Rank 0 prints ``PASS <name>: <note>`` (the note carries the measured figures), ``FAIL`` or ``SKIP``.
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

from gradaccum import Accumulator  # noqa: E402
from gradaccum.errors import ConfigurationError  # noqa: E402
from distributed.launch import run_modules  # noqa: E402

RANK, WORLD = 0, 1
LR, MOMENTUM, CLIP = 1.0, 0.9, 0.3

# each window: every rank's micro-batch sizes and whether their rows count (an empty window counts none)
# uneven counts across ranks (rank 1 pads), equal counts, a short last window where rank 1 has nothing,
# an empty window (every row masked: no step), and one more after it (the empty one left nothing behind)
WINDOWS: List[Dict[int, List[Tuple[int, bool]]]] = [
    {0: [(4, True), (4, True), (3, True)], 1: [(5, True), (1, True)]},
    {0: [(2, True), (3, True), (1, True)], 1: [(3, True), (3, True), (2, True)]},
    {0: [(2, True)], 1: []},
    {0: [(3, False)], 1: [(2, False)]},
    {0: [(1, True), (4, True)], 1: [(2, True), (5, True)]},
]
# DeepSpeed's own loop needs as many micro-batches on every rank (gradient_accumulation_steps = 3)
EQUAL = [{0: [(4, True), (4, True), (3, True)], 1: [(5, True), (1, True), (2, True)]},
         {0: [(2, True), (3, True), (1, True)], 1: [(3, True), (3, True), (2, True)]}]


def batch(rank: int, window: int, k: int, n: int, counted: bool):
    g = torch.Generator().manual_seed(1000 * window + 100 * rank + k)
    x, y = torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)
    return x, y, torch.full((n,), 1.0 if counted else 0.0)


def shares(windows, rank: int):
    return [[batch(rank, w, k, n, c) for k, (n, c) in enumerate(win[rank])] for w, win in enumerate(windows)]


def loss_fn(model: nn.Module, b) -> torch.Tensor:
    """The mean squared error over the micro-batch's counted rows (its items); 0, and a zero gradient,
    over none (as gradaccum's own losses: a 0/0 mean would put nan into the engine's gradient)."""
    x, y, m = b
    per_row = ((model(x) - y) ** 2).mean(dim=1)
    return (per_row * m).sum() / m.sum().clamp_min(1.0)


def num_items(b) -> int:
    return int(b[2].sum())


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def config(stage: int, *, clip: float = 0.0, managed: bool = False, gas: int = 1, offload: bool = False
           ) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
                           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                           "gradient_clipping": clip, "steps_per_print": 10 ** 9}
    if not managed:
        cfg["managed_gradient_accumulation"] = False
    if offload:  # the optimizer's state and step on the CPU: ZeRO-1/2 sum the window's gradient there
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False  # a torch optimizer over the offloaded float32 masters
    return cfg


def engine(stage: int, **kw):
    import deepspeed

    model = net()
    eng, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR,
                                                                                  momentum=MOMENTUM),
                                          config=config(stage, **kw))
    return eng


def params(eng) -> List[torch.Tensor]:
    """The engine's full float32 parameters on every rank (ZeRO-3 gathers its partitions)."""
    import deepspeed

    ps = list(eng.module.parameters())
    with deepspeed.zero.GatheredParameters(ps, enabled=eng.zero_optimization_stage() == 3):
        return [p.detach().clone().double() for p in ps]


def reference(windows, *, clip: float = 0.0) -> Tuple[List[List[torch.Tensor]], List[Optional[float]]]:
    """Float64 big-batch steps on the union of both ranks' windows: the parameters after each window
    and each window's unclipped gradient norm (None: an empty window, no step)."""
    model = net().double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    after, norms = [], []
    for win in windows:
        parts = [batch(r, w, k, n, c) for w, r, k, n, c in _union(windows, win)]
        x, y, m = (torch.cat(t) for t in zip(*parts))
        if m.sum() == 0:
            norms.append(None)
        else:
            opt.zero_grad()
            loss_fn(model, (x.double(), y.double(), m.double())).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
            norms.append(float(norm))
            opt.step()
        after.append([p.detach().clone() for p in model.parameters()])
    return after, norms


def _union(windows, win):
    w = windows.index(win)
    return [(w, r, k, n, c) for r in range(WORLD) for k, (n, c) in enumerate(win[r])]


def delta(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """Largest parameter difference relative to the reference's largest move from the start."""
    start = [p.detach().double() for p in net().parameters()]
    moved = max((w - s).abs().max().item() for w, s in zip(want, start))
    return max((g - w).abs().max().item() for g, w in zip(got, want)) / moved


def accumulate(stage: int, windows, *, clip: float = 0.0, w_factor: bool = True, eng=None, acc=None,
               start: int = 0):
    """The Accumulator around a caller-owned engine: one ``acc.step`` per window, this rank's share."""
    eng = eng if eng is not None else engine(stage, clip=clip)
    acc = acc if acc is not None else Accumulator(eng)
    if not w_factor:
        acc.sync.grad_divisor = 1.0  # what a loop without W does (the stock mean of DeepSpeed's average)
    results = [acc.step(share, loss_fn, num_items=num_items) for share in shares(windows, RANK)[start:]]
    return eng, acc, results


def stock(stage: int, windows) -> List[torch.Tensor]:
    """DeepSpeed's own loop: managed accumulation over gradient_accumulation_steps micro-batches, each
    micro-batch's mean loss through ``engine.backward`` (which divides it by that count), a step each."""
    eng = engine(stage, managed=True, gas=3)
    for share in shares(windows, RANK):
        for b in share:
            eng.backward(loss_fn(eng, b))
            eng.step()
    return params(eng)


_FOLDERS: List[str] = []


def shared_folder(prefix: str) -> List[str]:
    """A temporary folder both ranks write DeepSpeed's checkpoint into (rank 0 makes it, removed at exit)."""
    folder = [tempfile.mkdtemp(prefix=prefix) if RANK == 0 else None]
    dist.broadcast_object_list(folder)
    _FOLDERS.append(folder[0])
    return folder


# --------------------------------------------------------------------------- scenarios

def _exact_stage(stage: int, offload: bool = False) -> str:
    want, norms = reference(WINDOWS, clip=CLIP)
    eng, acc, results = accumulate(stage, WINDOWS, clip=CLIP, eng=engine(stage, clip=CLIP, offload=offload))
    got = params(eng)
    d = delta(got, want[-1])
    skipped = [r.skipped for r in results]
    assert skipped == [False, False, False, True, False], skipped
    assert acc.steps == 4 and acc.skipped == 1 and eng.global_steps == 4, (acc.steps, acc.skipped, eng.global_steps)
    assert all(r.num_items == sum(n for r_ in range(WORLD) for n, c in WINDOWS[w][r_] if c)
               for w, r in enumerate(results)), [r.num_items for r in results]
    engaged = [n for n in norms if n is not None and n > CLIP]
    assert len(engaged) == 4, norms  # clipping engages on every window that steps
    for r, n in zip(results, norms):
        if n is not None:
            assert abs(r.grad_norm - n) <= 1e-5 * n, (r.grad_norm, n)  # the window's true norm, once
    assert d < 1e-6, f"stage {stage}: delta {d:.2e} from the big batch"
    if offload:
        return f"stage {stage}, optimizer offloaded to the CPU: delta {d:.1e} (clipped; grad_norm = the window's)"
    without_w = delta(params(accumulate(stage, WINDOWS, clip=0.0, w_factor=False)[0]), reference(WINDOWS)[0][-1])
    eq_want, _ = reference(EQUAL)
    stock_d = delta(stock(stage, EQUAL), eq_want[-1])
    eq_d = delta(params(accumulate(stage, EQUAL)[0]), eq_want[-1])
    assert stock_d > 100 * max(eq_d, 1e-9) and without_w > 1e-3, (stock_d, eq_d, without_w)
    return (f"stage {stage}: Accumulator delta {d:.1e} (clipped, uneven, short, empty window skipped; "
            f"grad_norm = the window's); equal-count windows: Accumulator {eq_d:.1e}, DeepSpeed's own loop "
            f"{stock_d:.1e}; without W {without_w:.1e}")


def zero1_exact():
    return _exact_stage(1)


def zero2_exact():
    return _exact_stage(2)


def zero3_exact():
    return _exact_stage(3)


def zero2_cpu_offload_exact():
    """ZeRO-2 with the optimizer offloaded to the CPU, clipped: DeepSpeed sums the window's gradient in its CPU
    partition and takes the clipping norm from that sum at the step (measured: one micro-batch's norm would read
    about half the window's in the first window). Held to the window's norm, as without offload."""
    return _exact_stage(2, offload=True)


def resume_exact():
    """acc.state_dict() saved in DeepSpeed's checkpoint (client_state) and resumed: the same parameters,
    bit for bit, as the run that was never interrupted (ZeRO-2 and ZeRO-3)."""
    notes = []
    for stage in (2, 3):
        whole, _, _ = accumulate(stage, WINDOWS)
        folder = shared_folder("gradaccum-ds-")
        eng, acc, _ = accumulate(stage, WINDOWS[:2])
        eng.save_checkpoint(folder[0], tag="w2", client_state={"accumulator": acc.state_dict()})
        fresh = engine(stage)
        _, client = fresh.load_checkpoint(folder[0], tag="w2")
        acc2 = Accumulator(fresh)
        acc2.load_state_dict(client["accumulator"])
        acc2.set_padding(shares(WINDOWS, RANK)[0][0])  # a fresh process has no micro-batch to pad with yet
        assert acc2.steps == 2, acc2.steps
        resumed, acc2, _ = accumulate(stage, WINDOWS, eng=fresh, acc=acc2, start=2)
        a, b = params(whole), params(resumed)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"stage {stage}: resumed run differs"
        assert acc2.steps == 4 and acc2.skipped == 1, (acc2.steps, acc2.skipped)
        notes.append(f"stage {stage}")
    return "bit-identical after resume: " + ", ".join(notes)


def refusals():
    """What cannot be exact is refused before anything changes, with the fix."""
    managed = engine(2, managed=True)
    checks = [(lambda: Accumulator(managed), '"managed_gradient_accumulation": false'),
              (lambda: Accumulator(engine(1), max_grad_norm=1.0), "gradient_clipping"),
              (lambda: Accumulator(engine(1), precision="bf16"), "bf16"),
              (lambda: Accumulator(engine(1), torch.optim.SGD(net().parameters(), lr=0.1)), "not the DeepSpeed engine's"),
              (lambda: Accumulator(engine(1), accum_dtype=torch.float32), "grad_accum_dtype")]
    for build, text in checks:
        try:
            build()
        except ConfigurationError as e:
            assert text in str(e), (text, str(e))
        else:
            raise AssertionError(f"not refused: {text}")
    eng = engine(2)
    acc = Accumulator(eng)
    try:  # counts from loss_fn alone: the engine's gradient could not be rescaled, so refused before a backward
        acc.step(shares(WINDOWS, RANK)[0], lambda m, b: (loss_fn(m, b), 2 * num_items(b)))
    except ConfigurationError as e:
        assert "known before its first backward" in str(e), str(e)
    else:
        raise AssertionError("counts known only from loss_fn were not refused")
    return f"{len(checks) + 1} refusals, each naming the fix"


def guide_example():
    """docs/guides/deepspeed.md's code block, run as written (its checkpoint in a folder both ranks share)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "deepspeed.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    folder = shared_folder("gradaccum-ds-guide-")
    os.environ["CHECKPOINTS"] = folder[0]
    scope: Dict[str, Any] = {"__name__": "guide"}
    exec(compile(code, "docs/guides/deepspeed.md", "exec"), scope)  # noqa: S102 - the guide's own code
    acc, engine = scope["acc"], scope["engine"]
    assert acc.steps == 3 and engine.global_steps == 3, (acc.steps, engine.global_steps)
    flat = torch.cat([p.reshape(-1) for p in params(engine)])
    every = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(every, flat)
    assert torch.equal(every[0], every[1]), "the ranks' parameters differ"
    return "ran as written: 3 steps, replicas identical, checkpoint saved and loaded"


def nonfinite_window_raises():
    """A window whose loss is not finite raises (the engine holds its gradient, which gradaccum cannot
    drop), and no step is taken or counted."""
    eng = engine(2)
    acc = Accumulator(eng)
    window = shares(WINDOWS, RANK)[0]
    bad = (lambda m, b: loss_fn(m, b) * float("nan")) if RANK == 1 else loss_fn
    try:
        acc.step(window, bad, num_items=num_items)
    except FloatingPointError as e:
        assert "DeepSpeed engine holds" in str(e), str(e)
    else:
        raise AssertionError("a non-finite window under DeepSpeed did not raise")
    assert acc.steps == 0 and eng.global_steps == 0, (acc.steps, eng.global_steps)
    return "FloatingPointError on every rank, no step taken"


def low_precision_is_named_once():
    """bf16 parameters under a wrapper that owns the sum: a LowPrecisionWarning names the setting that
    sums in float32 (DDP, FSDP2's reduce_dtype, DeepSpeed's grad_accum_dtype); none where it sums in float32."""
    import warnings

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradaccum.accumulator import LowPrecisionWarning

    def warned(build) -> List[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build()
        return [str(w.message) for w in caught if issubclass(w.category, LowPrecisionWarning)]

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.1)

    ddp = DDP(net().to(torch.bfloat16))
    assert any("DistributedDataParallel" in m for m in warned(lambda: Accumulator(ddp, sgd(ddp)))), "DDP bf16"
    assert not warned(lambda: Accumulator(ddp, sgd(ddp), accum_dtype="param"))
    found = {}
    for reduce_dtype in (None, torch.float32):
        model = net()
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
        found[reduce_dtype] = warned(lambda: Accumulator(model, sgd(model)))
    assert any("reduce_dtype=torch.float32" in m for m in found[None]) and not found[torch.float32], found
    bf16 = {"bf16": {"enabled": True}}
    fp32_sums = {**bf16, "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}
    import deepspeed

    notes = ["DDP", "FSDP2"]
    for extra, expect in ((bf16, True), (fp32_sums, False)):
        model = net()
        try:
            eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           config={**config(2), **extra})
        except Exception as e:  # noqa: BLE001 - a DeepSpeed without bf16 on this CPU: the other two still ran
            return f"DDP and FSDP2 named; DeepSpeed bf16 not built here ({type(e).__name__})"
        got = warned(lambda: Accumulator(eng))
        assert bool(got) == expect and (not expect or "grad_accum_dtype" in got[0]), (extra, got)
        from types import SimpleNamespace

        from gradaccum.integrations.hf_deepspeed import DeepSpeedWindows

        # ExactTrainer's callback, as the Trainer calls it once the engine is built (a Trainer stand-in)
        trainer = SimpleNamespace(accelerator=SimpleNamespace(deepspeed_engine_wrapped=SimpleNamespace(engine=eng)))
        windows = DeepSpeedWindows(trainer, lambda: True)
        got = warned(lambda: windows.on_train_begin(None, None, None))
        assert bool(got) == expect and (not expect or "grad_accum_dtype" in got[0]), ("ExactTrainer", extra, got)
    notes.append("DeepSpeed (Accumulator and ExactTrainer)")
    return "named under " + ", ".join(notes) + "; silent where the sum is float32 or accum_dtype='param'"


def window_loss_refused():
    """A WindowLoss's cached passes and an exact MoELoss's counting pass bypass engine.backward: refused
    before any forward, with the route that works."""
    from gradaccum import MoELoss, WindowLoss

    acc = Accumulator(engine(1))
    losses = [WindowLoss(lambda m, b: m(b[0]), lambda reps, b: reps.sum()),
              MoELoss(lambda m, b: None, num_experts=2, top_k=1, coef=0.1)]
    for loss in losses:
        try:
            acc.step(shares(WINDOWS, RANK)[0], loss)
        except ConfigurationError as e:
            assert "DeepSpeed engine is not supported yet" in str(e), str(e)
        else:
            raise AssertionError(f"{type(loss).__name__} under DeepSpeed was not refused")
    assert acc.steps == 0
    return "WindowLoss and an exact MoELoss refused before any forward"


# --------------------------------------------------------------------------- ExactTrainer(deepspeed=...)
# The Trainer's data and references are tests/integrations/scenarios.py's (windows of 3, 3 and 1 micro-batches
# of 1-3 padded sequences per rank). Accelerate counts the real processes here (2), so nothing is adjusted.

TRAINER_CLIP = 0.3


def big_sgd(params) -> tuple:
    """SGD with momentum and weight decay, lr 1 on a schedule: moves large enough that float32 parameters
    (LayerNorm weights near 1) round well below 1e-6 of them."""
    opt = torch.optim.SGD(params, lr=1.0, momentum=0.9, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _integrations():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
    import scenarios as S

    return S


def on_deepspeed(cls: type, optimizer) -> type:
    """``cls`` with ``optimizer``'s optimizer and scheduler: under DeepSpeed the Trainer builds its own in
    ``create_optimizer`` / ``create_scheduler`` (ignoring ``optimizers=``) before DeepSpeed wraps them."""

    class OnDeepSpeed(cls):
        def create_optimizer(self, model=None):
            if getattr(self, "_made", None) is None:
                self._made = optimizer(self.model.parameters())
            self.optimizer = self._made[0]
            return self.optimizer

        def create_scheduler(self, num_training_steps, optimizer=None):
            self.lr_scheduler = self._made[1]
            return self.lr_scheduler

    OnDeepSpeed.__name__ = OnDeepSpeed.__qualname__ = f"{cls.__name__}OnDeepSpeed"
    return OnDeepSpeed


def trainer_config(stage: int, *, key: bool) -> Dict[str, Any]:
    """The DeepSpeed config a Trainer user writes ("auto" values the Trainer fills in), with
    ``"managed_gradient_accumulation": false`` where ``key`` (without it ExactTrainer sets it itself)."""
    cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                           "gradient_clipping": "auto", "steps_per_print": 10 ** 9}
    if key:
        cfg["managed_gradient_accumulation"] = False
    return cfg


def hf_deepspeed(model, per_rank, stage: int, *, exact: bool, clip: Optional[float], optimizer,
                 trainer_cls_base: Optional[type] = None, deepspeed: Any = None, **fit: Any):
    """The Trainer (ExactTrainer, ``trainer_cls_base``, or the stock one under DeepSpeed's own accumulation)
    on ``per_rank``; ``deepspeed``: the config as given to TrainingArguments (default: :func:`trainer_config`,
    with the key where ``exact``)."""
    from transformers import Trainer

    from gradaccum.integrations.hf_trainer import ExactTrainer

    S = _integrations()
    cfg = trainer_config(stage, key=exact) if deepspeed is None else deepspeed
    _, trainer = S.hf_fit(model, per_rank, exact=exact, clip=clip, deepspeed=cfg, optimizer=optimizer,
                          trainer_cls=on_deepspeed(trainer_cls_base or (ExactTrainer if exact else Trainer), optimizer),
                          **fit)
    return params(trainer.model_wrapped), trainer


def reference_norms(model, windows, clip, optimizer) -> List[float]:
    """Each window's pre-clip gradient norm in the float64 big-batch run (scenarios.reference's steps)."""
    from gradaccum import causal_lm_loss
    from hf_helpers import pad

    S = _integrations()
    model = copy.deepcopy(model)
    opt, sched = optimizer(model.parameters())
    norms = []
    for window in windows:
        opt.zero_grad(set_to_none=True)
        mb = pad(window)
        causal_lm_loss(S.lm_logits(model, mb), mb["labels"])[0].backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        sched.step()
    return norms


def exact_trainer_stages():
    """ExactTrainer(deepspeed=...) on ZeRO-1/2/3 with the config a Trainer user writes ("auto" values, no
    "managed_gradient_accumulation": ExactTrainer sets it false in its copy, said once; a dict at ZeRO-2/3,
    a JSON file at ZeRO-1, the user's dict left unchanged): within 1e-6 of the float64 big batch (clip
    engaged on every step, the logged grad_norm the window's true norm), the stock Trainer under
    DeepSpeed's own accumulation measurably off."""
    import json
    import warnings

    from hf_helpers import gpt2

    S = _integrations()
    per_rank = [S.rank_micro_batches(r, S.SIZES[r]) for r in range(WORLD)]
    windows = S.windows_of(per_rank, S.ACCUM)
    model = gpt2().float()
    want = [p.detach().clone() for p in S.reference(copy.deepcopy(model).double(), windows, clip=TRAINER_CLIP,
                                                   optimizer=big_sgd).parameters()]
    norms = reference_norms(copy.deepcopy(model).double(), windows, TRAINER_CLIP, big_sgd)
    assert all(n > TRAINER_CLIP for n in norms), norms
    found = []
    folder = tempfile.mkdtemp(prefix="gradaccum-ds-config-")
    for stage in (1, 2, 3):
        users = trainer_config(stage, key=False)
        before = copy.deepcopy(users)
        given: Any = users
        if stage == 1:
            given = os.path.join(folder, "ds_config.json")
            with open(given, "w") as f:
                json.dump(users, f)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got, trainer = hf_deepspeed(model, per_rank, stage, exact=True, clip=TRAINER_CLIP, optimizer=big_sgd,
                                        deepspeed=given)
        notices = [str(w.message) for w in said if "managed_gradient_accumulation" in str(w.message)]
        assert len(notices) == 1 and "while it trains" in notices[0], notices
        assert users == before, "ExactTrainer changed the user's DeepSpeed config"
        assert "managed_gradient_accumulation" not in trainer.args.hf_deepspeed_config.config  # as it was, after
        assert trainer.model_wrapped.managed_gradient_accumulation() is False
        d = delta_from(got, want, model)
        logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        assert trainer.state.global_step == len(windows), trainer.state.global_step
        assert len(logged) == len(norms) and all(abs(a - b) <= 1e-5 * b for a, b in zip(logged, norms)), (logged, norms)
        assert d < 1e-6, f"stage {stage}: delta {d:.2e}"
        found.append(d)
    # unclipped, where a uniformly mis-scaled gradient shows (a clip engaged on every step keeps only its
    # direction); the model as GPT2LMHeadModel(config) builds it (loss_type None): the stock Trainer's own loss
    free = [p.detach().clone() for p in S.reference(copy.deepcopy(model).double(), windows,
                                                   optimizer=big_sgd).parameters()]
    exact_free = delta_from(hf_deepspeed(model, per_rank, 2, exact=True, clip=None, optimizer=big_sgd)[0], free, model)
    stock_free = delta_from(hf_deepspeed(S.stock(copy.deepcopy(model)), per_rank, 2, exact=False, clip=None,
                                         optimizer=big_sgd)[0], free, model)
    shutil.rmtree(folder, ignore_errors=True)
    assert exact_free < 1e-6 and stock_free > 100 * exact_free, (exact_free, stock_free)
    return ("ExactTrainer (the user's config, the key set by it) delta "
            + ", ".join(f"stage {s} {d:.1e}" for s, d in zip((1, 2, 3), found))
            + f" (clipped); unclipped, stage 2: ExactTrainer {exact_free:.1e}, stock Trainer {stock_free:.1e}")


def exact_trainer_empty_window():
    """A window with no target on either rank under ZeRO-2: no engine step (no momentum or weight-decay
    step, no scheduler step, global_step not advanced), and the next window exact: the engine's gradient
    was still zero. (SGD, not AdamW: Adam divides float32 rounding noise of near-zero gradients into
    steps of the learning rate's size.)"""
    from hf_helpers import gpt2

    S = _integrations()
    per_rank = [S.rank_micro_batches(r, S.SIZES[r] + [2]) for r in range(WORLD)]
    for r, empty in {0: {3, 4, 5, 6, 7}, 1: {3, 4, 5}}.items():
        for k in empty:
            per_rank[r][k]["labels"] = torch.full_like(per_rank[r][k]["labels"], -100)
    windows = S.stepped_windows(per_rank, S.ACCUM)
    model = gpt2().float()
    want = [p.detach().clone() for p in S.reference(copy.deepcopy(model).double(), windows,
                                                   optimizer=big_sgd).parameters()]
    got, trainer = hf_deepspeed(model, per_rank, 2, exact=True, clip=None, optimizer=big_sgd)
    counts = (trainer.state.global_step, trainer.skipped, trainer.model_wrapped.global_steps)
    assert counts == (2, 1, 2), f"global_step, windows skipped, engine steps {counts}; expected (2, 1, 2)"
    d = delta_from(got, want, model)
    assert d < 1e-6, f"delta {d:.2e}"
    return f"skipped, delta {d:.1e}"


def exact_trainer_nonfinite_window_skipped():
    """A window whose loss is not finite on rank 1 (one micro-batch's loss times nan) under ZeRO-2, fp32: the
    engine finds the gradient not finite and drops it, and ExactTrainer, which checks no loss, records the
    window as skipped with one warning (no engine, optimizer or scheduler step, global_step not advanced)
    instead of stopping the run; the other windows are within 1e-6 of the float64 big batch without it."""
    import warnings

    from hf_helpers import gpt2

    from gradaccum.integrations.hf_trainer import ExactTrainer

    S = _integrations()
    per_rank = [S.rank_micro_batches(r, S.SIZES[r]) for r in range(WORLD)]
    model = gpt2().float()
    want = [p.detach().clone() for p in S.reference(copy.deepcopy(model).double(), S.windows_of(per_rank, S.ACCUM)[1:],
                                                   optimizer=big_sgd).parameters()]

    class NanInTheFirstWindow(ExactTrainer):
        ran = 0

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.ran += 1
            if not (RANK == 1 and self.ran == 2):
                return super().training_step(model, inputs, num_items_in_batch)
            # the first window's second micro-batch on rank 1: its logits, and so its loss, nan
            hook = self.accelerator.unwrap_model(model).lm_head.register_forward_hook(lambda m, a, out: out * float("nan"))
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                hook.remove()

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got, trainer = hf_deepspeed(model, per_rank, 2, exact=True, clip=None, optimizer=big_sgd,
                                    trainer_cls_base=NanInTheFirstWindow)
    told = [str(w.message) for w in said if "took no step" in str(w.message)]
    engine = trainer.model_wrapped  # it counts the step it dropped in global_steps and in skipped_steps
    counts = (trainer.state.global_step, trainer.skipped, engine.global_steps - engine.skipped_steps, len(told))
    assert counts == (2, 1, 2, 1), (f"global_step, windows skipped, engine steps applied, warnings {counts}; "
                                    "expected (2, 1, 2, 1)")
    d = delta_from(got, want, model)
    assert d < 1e-6, f"delta {d:.2e}"
    return f"skipped with one warning, the others within {d:.1e}"


def exact_trainer_moe_refused():
    """An MoE model whose config turns its router's load-balancing loss on: ExactTrainer computes that term over
    the window with DDP or FSDP2 only, so under DeepSpeed it is refused when the Trainer is built, with the fix
    (it was refused only at the first window, naming an argument the user never passed)."""
    from gradaccum import NotExactError

    S = _integrations()  # tests/integrations on the path: moe_models too
    import moe_models as M
    per_rank = [S.rank_micro_batches(r, S.SIZES[r]) for r in range(WORLD)]
    try:
        hf_deepspeed(M.moe_model("mixtral").float(), per_rank, 2, exact=True, clip=None, optimizer=big_sgd)
    except NotExactError as error:
        assert "under DeepSpeed" in str(error) and "router_aux_loss_coef = 0.0" in str(error), error
        return "refused with the fix"
    raise AssertionError("ExactTrainer trained an MoE model's router loss under DeepSpeed")


def exact_trainer_resume():
    """ExactTrainer under ZeRO-2 checkpointed after every step (DeepSpeed's engine checkpoint, the Trainer's
    state and ExactTrainer's skipped-window count) and resumed from step 1 of 3: the same parameters, bit
    for bit, as the run that never stopped."""
    from hf_helpers import gpt2

    S = _integrations()
    per_rank = [S.rank_micro_batches(r, S.SIZES[r]) for r in range(WORLD)]
    model = gpt2().float()
    a, b = shared_folder("gradaccum-ds-hf-a-")[0], shared_folder("gradaccum-ds-hf-b-")[0]
    straight, _ = hf_deepspeed(model, per_rank, 2, exact=True, clip=TRAINER_CLIP, optimizer=big_sgd, out=a, save=True)
    resumed, trainer = hf_deepspeed(model, per_rank, 2, exact=True, clip=TRAINER_CLIP, optimizer=big_sgd, out=b,
                                    resume=os.path.join(a, "checkpoint-1"))
    assert trainer.state.global_step == 3, trainer.state.global_step
    assert all(torch.equal(x, y) for x, y in zip(straight, resumed)), "the resumed run differs"
    return "bit-identical after resume from checkpoint-1 of 3"


def exact_trl_trainers():
    """TRL's SFT (ZeRO-2) and DPO (ZeRO-3) through ExactSFTTrainer / ExactDPOTrainer under DeepSpeed, against
    TRL's own loss over one big batch (trl_data.reference; float32 models, TRL's bf16 and gradient
    checkpointing off): SFT within 1e-6, DPO within 2e-6 (its log-sigmoid of log-probability differences
    rounds more in float32)."""
    from trl import DPOTrainer, SFTTrainer

    from gradaccum.integrations.trl import ExactDPOTrainer, ExactSFTTrainer
    from hf_helpers import gpt2, llama

    _integrations()
    import trl_data as T

    common: Dict[str, Any] = dict(bf16=False, gradient_checkpointing=False)
    found = {}
    for name, model, data, stock, exact, stage, tol in (
            ("SFT", gpt2().float(), T.sft_examples(20), SFTTrainer, ExactSFTTrainer, 2, 1e-6),
            ("DPO", llama().float(), T.dpo_examples(20), DPOTrainer, ExactDPOTrainer, 3, 2e-6)):
        cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                               "managed_gradient_accumulation": False, "zero_optimization": {"stage": stage},
                               "zero_allow_untested_optimizer": True, "gradient_clipping": "auto",
                               "steps_per_print": 10 ** 9}
        with T.float64_log_probs():
            ref = T.reference(stock, copy.deepcopy(model).double(), data, window=8, optimizer=big_sgd, **common)
            _, trainer = T.fit(on_deepspeed(exact, big_sgd), model, data, optimizer=big_sgd, deepspeed=cfg, **common)
        d = delta_from(params(trainer.model_wrapped), [p.detach().clone() for p in ref.parameters()], model)
        assert trainer.state.global_step == 3 and d < tol, (name, trainer.state.global_step, d)
        found[name] = f"{name} (ZeRO-{stage}) {d:.1e}"
    return "delta " + ", ".join(found.values())


def delta_from(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], start_model) -> float:
    start = [p.detach().double() for p in start_model.parameters()]
    moved = max((w - s).abs().max().item() for w, s in zip(want, start))
    return max((g - w).abs().max().item() for g, w in zip(got, want)) / moved


SCENARIOS = [zero1_exact, zero2_exact, zero3_exact, zero2_cpu_offload_exact, resume_exact, refusals, guide_example,
             nonfinite_window_raises,
             low_precision_is_named_once, window_loss_refused, exact_trainer_stages, exact_trainer_empty_window,
             exact_trainer_resume, exact_trl_trainers, exact_trainer_moe_refused, exact_trainer_nonfinite_window_skipped]


@contextlib.contextmanager
def scenario_context() -> Iterator[None]:
    """DeepSpeed on the group the launcher joined (its CPU communication op built once per machine, at
    install), its logs quiet; at the end rank 0 removes the checkpoint folders the scenarios shared."""
    import logging

    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        yield
    finally:
        dist.barrier()
        if RANK == 0:
            for made in _FOLDERS:
                shutil.rmtree(made, ignore_errors=True)


if __name__ == "__main__":
    run_modules([sys.modules[__name__]], sys.argv[1:])
