"""Run `normlab` as real processes — Lightning-spawned ranks, or torchrun "nodes" on loopback — on CPU.

Every process gets one intra-op thread: two ranks then share the two cores without oversubscription, and
the arithmetic (and so every loss bit) does not depend on how a run was launched.
"""
from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                    "NODE_RANK", "GROUP_RANK", "SLURM_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fail(what: str, output: str) -> None:
    raise AssertionError(f"{what} failed:\n{output[-6000:]}")


def run_normlab(args: list[str], cwd: Path, timeout: float = 300, expect_ok: bool = True,
                **env: str) -> subprocess.CompletedProcess:
    """`python -m training.cli <args>` in `cwd`; raises with the output's tail if it fails (unless told not to)."""
    proc = subprocess.run([sys.executable, "-m", "training.cli", *args], cwd=cwd, env=cpu_env(**env),
                          capture_output=True, text=True, timeout=timeout)
    if expect_ok and proc.returncode != 0:
        _fail(f"normlab {' '.join(args)}", proc.stdout + proc.stderr)
    return proc


def run_here(args: list[str]) -> None:
    """`normlab <args>` in this process, through the console script's entry point (`training.cli.main`): for
    one-process runs whose output the test does not read — the seconds of a process start-up are most of a tiny
    fit's time. Raises if it does not exit 0."""
    from training.cli import main

    code = main(args)
    assert code == 0, f"normlab {' '.join(args)} exited {code}"


def _run_nodes(commands: list[list[str]], cwd: Path, what: str, timeout: float) -> None:
    """Start one launcher per "node" at once and wait for all; raise with the output of any that failed."""
    procs = [subprocess.Popen(cmd, cwd=cwd, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        if p.returncode != 0:
            _fail(f"{what}, node {node}", out)


def run_torchrun(args: list[str], cwd: Path, nnodes: int = 1, nproc_per_node: int = 2, timeout: float = 300) -> None:
    """`normlab <args>` under `nnodes` torchrun launchers (one per "node", all started here), meeting on
    127.0.0.1 — with nnodes > 1, what separate machines would do, with the loopback interface as the network."""
    port = free_port()
    _run_nodes([[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                 "--nproc-per-node", str(nproc_per_node), "--node-rank", str(node), "--master-addr", "127.0.0.1",
                 "--master-port", str(port), "-m", "training.cli", *args] for node in range(nnodes)],
               cwd, f"torchrun normlab {' '.join(args)}", timeout)


def run_deepspeed_nodes(args: list[str], cwd: Path, nnodes: int = 2, timeout: float = 300) -> None:
    """`normlab <args>` on `nnodes` one-process "nodes" started the way the `deepspeed` launcher starts them:
    its runner ssh-es `deepspeed.launcher.launch --world_info=... --node_rank=i` into host i; here each of those
    per-node launchers runs locally and they meet on 127.0.0.1."""
    world_info = base64.urlsafe_b64encode(json.dumps({f"node{i}": [0] for i in range(nnodes)}).encode()).decode()
    port = free_port()
    _run_nodes([[sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
                 f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", "--no_local_rank",
                 "--module", "training.cli", *args] for node in range(nnodes)],
               cwd, f"deepspeed launcher normlab {' '.join(args)}", timeout)
