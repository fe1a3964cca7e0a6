"""Launch torchrun (2 gloo processes on the CPU) from tests."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), e.get("PYTHONPATH", "")])
    return e


def torchrun_args(nproc: int = 2, *, nnodes: int = 1, node_rank: int = 0, port: int = 0) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--nnodes={nnodes}", f"--node_rank={node_rank}", "--master_addr=127.0.0.1",
            f"--master_port={port or free_port()}"]


def torchrun(script_args: Sequence[str], *, timeout: int = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_args() + list(script_args), cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=timeout)


def two_agents(script_args: Sequence[str], *, timeout: int = 300, cwd: Path = ROOT):
    """Two torchrun agents on 127.0.0.1, one process each: the --nnodes=2 launch across machines."""
    port = free_port()
    procs = [subprocess.Popen(torchrun_args(1, nnodes=2, node_rank=r, port=port) + list(script_args),
                              cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return [p.returncode for p in procs], outs
