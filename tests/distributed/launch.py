"""Launch torchrun (2 gloo processes on the CPU) from tests, and end its workers.

Every worker ends through :func:`finish_worker`: its process group destroyed once nothing holds it,
then ``os._exit``, without the interpreter's teardown, where gloo can abort a finished run ("terminate
called without an active exception", docs/measurements.md). A launch that fails says why at the end
of its stderr (:func:`torchrun`): the failed ranks, their exit codes or signals, and the workers' own
error lines, so that a test's ``proc.stderr[-3000:]`` names a flake instead of showing the agent's
traceback alone.

One node: ``--standalone`` lets torchrun bind a free port itself, so no port is chosen here and none
can be taken in between. Two agents (``--nnodes=2``) must share a rendezvous address: the port is
picked free, and the launch is retried when another process took it first.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, NoReturn, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]
PORT_TAKEN = ("Address already in use", "EADDRINUSE", "address already in use")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), e.get("PYTHONPATH", "")])
    return e


def torchrun_args(nproc: int = 2, *, extra: Sequence[str] = ()) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *extra]


def torchrun(script_args: Sequence[str], *, nproc: int = 2, timeout: int = 300, cwd: Path = ROOT,
             extra: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """torchrun to the end; past ``timeout`` the agent *and its workers* are killed (a plain
    ``subprocess.run`` timeout kills the agent alone, and workers left waiting in a collective would
    load the machine under every later test) before ``TimeoutExpired`` is raised."""
    proc = subprocess.Popen(torchrun_args(nproc, extra=extra) + list(script_args), cwd=cwd, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
    except BaseException:  # Ctrl-C in pytest, or any other way out: nothing is left running
        kill_tree(proc)
        raise
    if proc.returncode != 0:
        err += failure_summary(proc.returncode, out + "\n" + err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# a worker's own words for dying: a C++ abort, a crash, a Python error's last line, the agent's summary
_WORKER_ERRORS = ("terminate called", "Fatal Python error", "Segmentation fault", "core dumped", "Aborted",
                  "Error:", "Error(", "error:", "Timeout", "timed out")
_SUMMARY_FIELDS = ("[0]:", "[1]:", "rank", "exitcode", "error_file", "time", "host", "traceback :", "Root Cause",
                   "Failures:")


def failure_summary(returncode: int, output: str) -> str:
    """A few lines that say why a launch failed, to append to its stderr: torchrun's table of the
    failed ranks (rank, exit code or signal), and every line of the workers' output that reads as an
    error (gloo's 'terminate called', a Python exception's last line, a timeout). Exit code -6 or 134
    is SIGABRT (gloo's abort at exit), -9 or 137 SIGKILL (memory, or a kill from outside)."""
    lines = output.splitlines()
    table, inside = [], False
    for line in lines:
        if "Root Cause" in line or line.strip() == "Failures:":
            inside = True
        if inside and any(line.strip().startswith(f) for f in _SUMMARY_FIELDS):
            table.append(line.strip())
    errors = [line.strip() for line in lines if any(e in line for e in _WORKER_ERRORS)
              and "torch/distributed/elastic" not in line and "ChildFailedError" not in line]
    seen: List[str] = []
    for line in errors:
        if line not in seen:
            seen.append(line)
    # each line quoted ("  | "), so that a test reading the workers' own lines (a usage error said once,
    # from rank 0) never counts the summary's copy of them
    quoted = lambda rows: "\n".join("  | " + row for row in rows)  # noqa: E731
    return ("\n== torchrun exited " + str(returncode) + ": the failed ranks ==\n" + quoted(table[-12:] or ["(no table)"])
            + "\n== the workers' error lines ==\n" + quoted(seen[-12:] or ["(none)"]) + "\n")


def freeze_the_living() -> None:
    """Collect the garbage, then move every object still alive (the imported modules of torch,
    transformers, TRL, DeepSpeed...) into the collector's permanent generation (``gc.freeze``), before
    a test or a scenario. Accelerate's ``free_memory``, which every ``Trainer.train()`` calls, runs a
    full ``gc.collect()``: over those modules' millions of objects that took 0.2-0.3 s a call, a third
    of an in-process GRPO test and half of the torchrun scenario launch (docs/measurements.md). The
    garbage a test leaves is freed by the next call, which collects first; what the test makes is
    collected as before. Only an object alive at a call and part of a cycle once dropped later (a
    module-scoped fixture's) is kept for the rest of the process: about 1,500 objects after the Hugging
    Face test files. No result can depend on it: a collection frees only unreachable objects."""
    import gc

    gc.collect()
    gc.freeze()


def finish_worker(code: int = 0) -> NoReturn:
    """How every torchrun test worker ends, after its last collective: reference cycles collected (DDP's
    reducer, FSDP2's DTensors and module hooks hold the group; frozen ones too, :func:`freeze_the_living`),
    the group destroyed, output flushed, and ``os._exit(code)``. The interpreter's teardown is skipped: that
    is where a gloo group, or a C++ object still holding one, could abort a worker whose work was done
    (exit 134), which failed a suite run now and then. Call it from the script's top level, once the
    scenarios' frames are gone."""
    import gc

    import torch.distributed as dist

    gc.unfreeze()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Skip(Exception):
    """A scenario that cannot run on this machine (inductor without a C++ compiler): reported as SKIP."""


#: what rank 0 prints (to stdout and stderr) before a worker module's lines in a launch that runs several
#: (:func:`run_workers`), and after them once every rank has finished the module in step
WORKER_HEADER = "== scenarios of "
WORKER_FOOTER = "== done: scenarios of "
_STATUS = ("PASS", "SKIP", "FAIL")


def run_each(scenarios, names: Sequence[str] = ()) -> int:
    """Run ``scenarios`` (those named in ``names``; all when empty) on this rank, one line each on rank 0,
    and return how many ran. A scenario passes only where every rank passed (each verdict all-reduced):

    * a list of functions returning a note: ``PASS``/``SKIP``/``FAIL <name>: <note>`` (:class:`Skip` is a
      SKIP, an exception a FAIL);
    * a dict of name -> function returning its own ``PASS <name>: ...`` or ``FAIL <name>: ...`` line (an
      exception is a FAIL line); where a rank's line is worse than rank 0's, that rank's line is printed."""
    import traceback

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    ran = 0
    if isinstance(scenarios, dict):
        for name in names or list(scenarios):
            freeze_the_living()
            try:
                line = scenarios[name]()
            except Exception:  # noqa: BLE001 - report and go on to the next scenario
                line = f"FAIL {name}: {traceback.format_exc()[-1500:]}"
            status = line.partition(" ")[0]
            lines = [None] * dist.get_world_size()
            dist.all_gather_object(lines, (_STATUS.index(status) if status in _STATUS else 2, line))
            worst = max(range(len(lines)), key=lambda r: (lines[r][0], -r))  # rank 0's line unless another is worse
            if rank == 0:
                code, said = lines[worst]
                if worst != 0:
                    head, _, note = said.partition(": ")
                    said = f"{_STATUS[code]} {name}: rank {worst}: {note or head}"
                print(said, flush=True)
            ran += 1
        dist.barrier()
        return ran
    for scenario in scenarios:
        if names and scenario.__name__ not in names:
            continue
        freeze_the_living()
        try:
            note = scenario()
            verdict = torch.tensor([0])
        except Skip as e:
            note, verdict = str(e), torch.tensor([1])
        except Exception:  # noqa: BLE001 - reported per scenario
            note = traceback.format_exc().strip().splitlines()[-1]
            verdict = torch.tensor([2])
            traceback.print_exc()
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"{_STATUS[int(verdict.item())]} {scenario.__name__}: {note}", flush=True)
        dist.barrier()
        ran += 1
    return ran


def _say(line: str) -> None:
    """Rank 0's marker, on stdout (where the verdicts are read) and stderr (where a module's traceback is)."""
    print(line, flush=True)
    print(line, file=sys.stderr, flush=True)


def run_modules(modules: Sequence, names: Sequence[str] = ()) -> NoReturn:
    """Join the group (gloo, 2 processes: a collective that waits 2 minutes is an error, not a hang), then
    each worker module's scenarios in turn (:func:`run_each`), with its ``RANK`` and ``WORLD`` set and
    inside its ``scenario_context()`` where it has one (a worker's own set-up: DeepSpeed joining the group,
    a float64 stand-in patched in). Rank 0 prints :data:`WORKER_HEADER` and the module's file before its
    lines, and :data:`WORKER_FOOTER` once every rank has run as many of its scenarios (ranks out of step
    end the launch: every later collective would pair with the wrong one). An entry of ``modules`` that is
    an exception (a worker that failed to import) is reported and skipped. Between modules the state a
    worker may leave in the process is reset: the default dtype, the seeds (torch's, Python's), and
    Accelerate's singletons. The process ends through :func:`finish_worker`."""
    import datetime
    import random

    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "run with --nproc_per_node=2 (or two agents of one process)"
    dtype = torch.get_default_dtype()
    for index, module in enumerate(modules):
        path = module.args[0] if isinstance(module, BaseException) else module.__file__
        if rank == 0:
            _say(f"{WORKER_HEADER}{path}")
        if isinstance(module, BaseException):
            print(f"FAIL {path}: the worker did not import: {module.args[1]}", file=sys.stderr, flush=True)
            continue
        module.RANK, module.WORLD = rank, world
        with getattr(module, "scenario_context", contextlib.nullcontext)():
            ran = run_each(module.SCENARIOS, names)
        every = [None] * world
        dist.all_gather_object(every, (index, ran))
        if len(set(every)) != 1:
            print(f"the ranks are out of step after {path}: (module, scenarios run) per rank {every}",
                  file=sys.stderr, flush=True)
            finish_worker(1)
        if rank == 0:
            _say(f"{WORKER_FOOTER}{path}")
        torch.set_default_dtype(dtype)
        torch.manual_seed(0)
        random.seed(0)
        if "accelerate" in sys.modules:  # a Trainer's Accelerator settings live on in a process-wide singleton
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state()
            GradientState._reset_state()
    finish_worker(0)


def run_workers(paths: Sequence[str]) -> NoReturn:
    """The worker scripts at ``paths`` in this process (each rank's), imported as modules and run by
    :func:`run_modules`: the suite's scenario workers in one torchrun launch, so that torch, transformers,
    Lightning, sentence-transformers and DeepSpeed import once per rank instead of once per worker. A
    worker that fails to import is reported in its place; the others run."""
    import importlib.util
    import traceback

    modules: List[Any] = []
    for path in paths:
        spec = importlib.util.spec_from_file_location(f"scenario_worker_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - reported in its place by run_modules
            modules.append(ImportError(path, traceback.format_exc()[-1500:]))
        else:
            modules.append(module)
    run_modules(modules)


#: the HTML comment before a guide's block that runs under torchrun (tests/test_guides.py reads it too)
GUIDE_TORCHRUN = "run under torchrun"


def run_guide_torchrun_blocks(guide: str) -> List[Tuple[Dict[str, Any], str]]:
    """A guide's ``<!-- run under torchrun -->`` blocks (docs/guides/GUIDE), as written, on this rank of a
    launch, each in a namespace of its own: each block's namespace and what it printed. The group is
    already joined, so the block's ``init_process_group`` and ``destroy_process_group`` stand aside;
    everything between runs as a reader's ``torchrun --nproc_per_node=2`` runs it (tests/test_guides.py
    checks that every such block of a guide is run by a scenario)."""
    import contextlib
    import io
    import re
    from unittest import mock

    import torch.distributed as dist

    text = (ROOT / "docs" / "guides" / guide).read_text()
    said = []
    for m in re.finditer(rf"<!-- {GUIDE_TORCHRUN} -->\n```python\n(.*?)^```", text, re.M | re.S):
        where = f"docs/guides/{guide}:{text.count(chr(10), 0, m.start(1))}"
        namespace: Dict[str, Any] = {"__name__": "guide"}
        printed, here = io.StringIO(), os.getcwd()
        with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(printed), \
                mock.patch.object(dist, "init_process_group", autospec=True), \
                mock.patch.object(dist, "destroy_process_group", autospec=True):
            os.chdir(folder)  # as a reader runs it: in a folder of its own
            try:
                exec(compile(m.group(1), where, "exec"), namespace)  # noqa: S102 - our own guide
            except Exception as e:
                raise AssertionError(f"{where} raised {e!r}; it printed:\n{printed.getvalue()[-2000:]}") from e
            finally:
                os.chdir(here)
        said.append((namespace, printed.getvalue()))
    return said


def _agent_args(node_rank: int, port: int) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--nnodes=2",
            f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}"]


def two_agents(script_args: Sequence[str], *, timeout: int = 300, cwd: Path = ROOT, tries: int = 3,
               grace: float = 30.0):
    """Two torchrun agents on 127.0.0.1, one process each: the --nnodes=2 launch across machines.

    Each agent runs in a session of its own, its output in a file. When one fails (its port was taken
    between free_port() and the launch), the other would wait for its peer until torchrun's own
    rendezvous timeout: after ``grace`` seconds it is stopped with its workers, and the launch is
    retried on a new port."""
    for attempt in range(tries):
        port = free_port()
        logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
        procs = [subprocess.Popen(_agent_args(r, port) + list(script_args), cwd=cwd, env=env(), stdout=logs[r],
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for r in range(2)]
        try:
            _wait_both(procs, timeout, grace)
        finally:
            for q in procs:
                kill_tree(q)
        outs = []
        for log in logs:
            log.seek(0)
            outs.append(log.read())
            log.close()
        codes = [p.returncode for p in procs]
        if codes != [0, 0] and attempt + 1 < tries and any(s in o for o in outs for s in PORT_TAKEN):
            continue  # another process bound the port between free_port() and the launch
        return codes, outs
    raise AssertionError("unreachable")


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill a launch and everything it started: torchrun starts each worker in a session of its own,
    so the workers would outlive the agent's process group, waiting in a collective. The workers are
    listed first, the agent's group killed (no new worker can start after), then the listed ones."""
    if proc.poll() is not None:
        return  # ended by itself: its agent took its workers down with it
    try:
        import psutil
    except ImportError:
        psutil = None
    children = []
    if psutil is not None:
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(proc.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # started in a session of its own: its group is its pid
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    proc.wait()


def _wait_both(procs: Sequence[subprocess.Popen], timeout: float, grace: float) -> None:
    """Until both exit, ``timeout`` passes, or one has failed ``grace`` seconds ago."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            return
        time.sleep(0.1)


def start_torchrun(script_args: Sequence[str], *, nproc: int = 2, log: Path, cwd: Path = ROOT,
                   extra: Sequence[str] = ()) -> subprocess.Popen:
    """torchrun in a session of its own, output to ``log``: a test can send the whole process group a
    signal, as a terminal's Ctrl-C does (the agent and every worker receive it)."""
    with open(log, "w") as f:
        return subprocess.Popen(torchrun_args(nproc, extra=extra) + list(script_args), cwd=cwd, env=env(),
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def start_cli(cli_args: Sequence[str], *, log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    """``python -m gradaccum ...`` as one process, in a session of its own, output to ``log``."""
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "gradaccum", *cli_args], cwd=cwd, env=env(),
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def run_cli(cli_args: Sequence[str], *, timeout: int = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m gradaccum ...`` as one process (world size 1), with the suite's environment."""
    return subprocess.run([sys.executable, "-m", "gradaccum", *cli_args], cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=timeout)


def run_cli_here(cli_args: Sequence[str], *, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``gradaccum ...`` in this process (world size 1, rank 0; or this rank of a launch: cli_runs.py),
    returned as :func:`run_cli` returns the finished process: exit code, stdout, stderr. For a run whose process is not what a test is about
    (what it says, records, writes, trains); it saves a process's imports (torch, and torch._dynamo,
    which the optimizer's constructor pulls in: about 4 CPU seconds). Tests about the process itself
    (signals, exit status, a closed pipe, torchrun) run :func:`run_cli` or :func:`start_cli`.
    ``cwd``: the folder it runs in (default: the repository, as :func:`run_cli`)."""
    import io

    from gradaccum.cli import main

    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(cli_args))
            except SystemExit as e:  # argparse's own refusals
                code = e.code
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(list(cli_args), code, out.getvalue(), err.getvalue())


#: the runner of every scenario worker in one launch (:func:`run_workers`)
ALL_SCENARIOS = ROOT / "tests" / "distributed" / "all_scenarios.py"
#: the worker scripts of the scenario modules collected in this process: their timeouts and test modules
_WORKERS: Dict[str, Tuple[int, str]] = {}
#: the launches made, by the worker scripts they ran: ({script: {name: (status, line)}}, proc)
_LAUNCHES: Dict[Tuple[str, ...], Tuple[Dict[str, Dict[str, Tuple[str, str]]], subprocess.CompletedProcess]] = {}
#: run last in a shared launch: DeepSpeed's engine changes process-wide state (its communication layer)
_LAST = ("deepspeed_worker.py",)


def shared_verdicts(session, script: str):
    """The verdicts of ``script``'s scenarios, from the one torchrun launch that runs every scenario worker
    whose test module has a test in this session (tests/conftest.py keeps those modules on one pytest-xdist
    worker under --dist loadscope, so the launch is made once; under another --dist each xdist worker
    launches only the worker it asks for): ``({name: (status, line)}, proc)``, ``proc`` this worker's part
    of the launch: its stderr section where every rank finished this worker in step, and the launch's exit
    code unless a later worker is what failed. A launch that failed or timed out is kept too, so that the
    next module reads it instead of launching again."""
    worker = getattr(session.config, "workerinput", None)  # a pytest-xdist worker: the mode from tests/conftest.py
    if worker is not None and worker.get("gradaccum_dist") != "loadscope":
        scripts = [script]
    else:
        ran = {str(getattr(item, "path", item.fspath)) for item in session.items}
        scripts = [s for s, (_, module) in _WORKERS.items() if module in ran or s == script]
        scripts.sort(key=lambda s: Path(s).name in _LAST)
    key = tuple(scripts)
    if key not in _LAUNCHES:
        args = [str(ALL_SCENARIOS), *scripts]
        try:
            proc = torchrun(args, timeout=sum(_WORKERS[s][0] for s in scripts))
        except subprocess.TimeoutExpired as e:
            said = (e.stderr or "") if isinstance(e.stderr, str) else ""
            proc = subprocess.CompletedProcess(args, -9, e.output if isinstance(e.output, str) else "",
                                               said + f"\n== the launch was killed after {e.timeout} s ==\n")
        _LAUNCHES[key] = (verdict_lines(proc.stdout), proc)
    by_script, proc = _LAUNCHES[key]
    lines, finished = by_script.get(script, ({}, False))
    every = all(by_script.get(s, ({}, False))[1] for s in key)  # then a failed exit is every worker's defect
    code = proc.returncode if every or not finished else 0
    said = proc.stderr if not finished else _section(proc.stderr, script) + (
        "" if code == 0 else "\n== the end of the launch ==\n" + proc.stderr[-3000:])
    part = subprocess.CompletedProcess(proc.args, code, proc.stdout, said)
    return lines, part


def verdict_lines(stdout: str) -> Dict[str, Tuple[Dict[str, Tuple[str, str]], bool]]:
    """Rank 0's ``PASS``/``FAIL``/``SKIP <name>: <note>`` lines by the worker script whose
    :data:`WORKER_HEADER` came before them, and whether its :data:`WORKER_FOOTER` came after them."""
    by_script: Dict[str, Tuple[Dict[str, Tuple[str, str]], bool]] = {}
    lines: Dict[str, Tuple[str, str]] = {}
    for line in stdout.splitlines():
        if line.startswith(WORKER_HEADER):
            script = line[len(WORKER_HEADER):].strip()
            lines = {}
            by_script[script] = (lines, False)
        elif line.startswith(WORKER_FOOTER):
            script = line[len(WORKER_FOOTER):].strip()
            by_script[script] = (by_script.get(script, ({}, False))[0], True)
        else:
            status, _, rest = line.partition(" ")
            if status in _STATUS:
                lines[rest.split(":")[0]] = (status, line)
    return by_script


def _section(stderr: str, script: str) -> str:
    """The part of a launch's stderr between ``script``'s header and footer (both ranks' output then)."""
    start = stderr.find(f"{WORKER_HEADER}{script}")
    end = stderr.find(f"{WORKER_FOOTER}{script}", max(start, 0))
    return stderr[max(start, 0):end if end >= 0 else len(stderr)]


def assert_scenario(verdicts, name: str) -> None:
    """The scenario reported and passed (a SKIP skips the test, with the worker's reason)."""
    import pytest

    lines, proc = verdicts
    assert name in lines, f"scenario {name} did not report (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    status, line = lines[name]
    if status == "SKIP":
        pytest.skip(line)
    assert status == "PASS", f"{line}\n{proc.stderr[-4000:]}"
    # every scenario reported, and then a worker died on its way out: a defect of its own, named here
    assert proc.returncode == 0, f"the workers exited {proc.returncode} after the scenarios:\n{proc.stderr[-3000:]}"


def scenario_tests(worker: str, scenarios: Sequence[str], *, timeout: int = 300,
                   gaps: Optional[Mapping[str, str]] = None, doc: Optional[str] = None) -> Tuple[Callable, Callable]:
    """The fixture and the test of a scenario module, written once: ``verdicts`` holds the verdicts of
    ``worker``'s scenarios (a path from the repository's root), from the one torchrun launch of every
    scenario worker the session runs (:func:`shared_verdicts`; ``timeout``: this worker's part of its
    limit), and ``test_scenario`` asserts one scenario's verdict, parametrized over ``scenarios``. A scenario named in
    ``gaps`` (name: the library gap it shows) is a strict xfail until the library is fixed. ``doc``: what
    the scenarios assert, shown as the test's docstring. A module binds both names at its top level,
    where pytest finds them::

        verdicts, test_scenario = scenario_tests("tests/distributed/cached_worker.py", SCENARIOS)
    """
    import pytest

    gaps = dict(gaps or {})
    unknown = sorted(set(gaps) - set(scenarios))
    if unknown:
        raise ValueError(f"gaps={unknown} names no scenario of {worker}: list the scenario in scenarios, or drop the gap")
    script = str(ROOT / worker)
    _WORKERS[script] = (timeout, sys._getframe(1).f_globals["__file__"])

    @pytest.fixture(scope="module")
    def verdicts(request):
        return shared_verdicts(request.session, script)

    @pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=gaps[n]))
                                      if n in gaps else n for n in scenarios])
    def test_scenario(verdicts, name):
        assert_scenario(verdicts, name)

    test_scenario.__doc__ = doc or f"The scenario reported PASS from {worker} under torchrun (2 gloo processes)."
    return verdicts, test_scenario
