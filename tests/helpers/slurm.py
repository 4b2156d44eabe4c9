"""A real two-node Slurm cluster on this host for the tests: munged, slurmctld and two slurmd daemons (nodes `n1`
and `n2`, one CPU each, each on its own port with its own spool, pid and log files), as root.

`srun -N2 -n2` runs one task on each node (SLURM_NODEID 0 and 1): that is how the tests run a 2-node job on one
machine. The node names do not resolve, so a job that connects its ranks exports `MASTER_ADDR=127.0.0.1`
(Lightning's SLURMEnvironment reads it before the node list).

Everything belongs to one cluster instance, so that several can run on one machine at once: a fresh directory
holding the munge key, socket and seed, the slurm.conf (clients find it through SLURM_CONF), state, spools,
pid and log files; free TCP ports; a unique cluster name. The daemons run in the foreground as our children and
are stopped by their own pids, never by name. Timing knobs, for tests that wait on Slurm: `AuthInfo=cred_expire`
is how long a requeued job is held before it may start again (default 120 s; 5 s here), `sched_interval` and
`bf_interval` how often the schedulers look at pending jobs (60 s and 30 s; 2 s here), `KillWait` the grace
between SIGTERM and SIGKILL when a job ends (30 s; 10 s here).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGES = ("slurm-wlm", "munge")
REQUEUE_HOLD_S = 5
NODES = ("n1", "n2")


@dataclass
class Cluster:
    root: Path
    conf: Path

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), capture_output=True, text=True, env={**os.environ, **self.env}, timeout=60)


def _installed() -> bool:
    return all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch"))


def ensure_packages() -> None:
    """Install slurm-wlm and munge when missing (as root, with apt); skip the test otherwise."""
    if _installed():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"the Slurm tests need {' and '.join(PACKAGES)} (as root: apt-get install -y "
                    f"{' '.join(PACKAGES)})")
    out = subprocess.run(["apt-get", "install", "-y", *PACKAGES], capture_output=True, text=True,
                         env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if out.returncode != 0 or not _installed():
        pytest.skip(f"apt-get install {' '.join(PACKAGES)} failed: {out.stderr.strip()[-300:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _conf(root: Path, host: str) -> str:
    return "\n".join([
        f"ClusterName=nl{uuid.uuid4().hex[:8]}", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge' / 'munge.socket'},cred_expire={REQUEUE_HOLD_S}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2",
        f"SlurmctldPort={free_port()}",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool_%n'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd.%n.log'}",
        "SchedulerParameters=defer_batch=0,sched_interval=2,bf_interval=2", "MinJobAge=600", "KillWait=10",
        *(f"NodeName={node} NodeHostname={host} Port={free_port()} CPUs=1 RealMemory=1000 State=UNKNOWN"
          for node in NODES),
        f"PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n"


def _start_munge(root: Path) -> subprocess.Popen:
    munge = root / "munge"
    munge.mkdir()
    munge.chmod(0o755)  # munged wants its socket directory open to all (the key stays 0400)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for path in (munge, key):
        shutil.chown(path, "munge", "munge")
    return subprocess.Popen(
        ["munged", "-F", f"--socket={munge / 'munge.socket'}", f"--key-file={key}", f"--pid-file={munge / 'pid'}",
         f"--log-file={munge / 'log'}", f"--seed-file={munge / 'seed'}"], user="munge", group="munge",
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait(check: callable, what: str, root: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    logs = {p.name: p.read_text()[-800:] for p in root.glob("*.log")}
    raise RuntimeError(f"Slurm test cluster: {what} within {timeout:.0f} s; logs: {logs}")


@contextlib.contextmanager
def running_cluster() -> Iterator[Cluster]:
    """Start the cluster (as root), yield it once its nodes are idle, stop its daemons and delete it."""
    root = Path(tempfile.mkdtemp(prefix="normlab-slurm-"))
    root.chmod(0o755)  # munged (the munge user) must reach its own directory inside
    for d in ("state", *(f"spool_{node}" for node in NODES)):
        (root / d).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, socket.gethostname()))
    cluster = Cluster(root=root, conf=conf)
    env = {**os.environ, **cluster.env}
    daemons: list[subprocess.Popen] = []
    try:
        daemons.append(_start_munge(root))
        _wait(lambda: (root / "munge" / "munge.socket").exists(), "munged did not start", root)
        daemons.append(subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        daemons += [subprocess.Popen(["slurmd", "-D", "-N", node, "-f", str(conf)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for node in NODES]
        _wait(lambda: cluster.run("sinfo", "-h", "-N", "-o", "%t").stdout.split() == ["idle"] * len(NODES),
              "the nodes are not idle", root)
        yield cluster
    finally:
        for proc in reversed(daemons):  # by pid: other clusters on this machine are left alone
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    ensure_packages()
    if os.geteuid() != 0:
        pytest.skip("the Slurm tests start slurmctld and slurmd, which needs root")
    with running_cluster() as cluster:
        yield cluster
