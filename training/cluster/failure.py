"""The one line for a rank that ended because another rank stopped responding in a collective (a hung process,
a lost node): which rank this is (and its node), which collective, and what to do."""
from __future__ import annotations

import os
import traceback

from training.cluster.rank import launcher_rank
from training.cluster.signals import StopSignals

# In a run's log: a rank ended because another rank stopped responding (a hung process or a lost node). The
# sweep's Slurm task requeues such a run (training/sweep/slurm.py).
LOST_RANK = "another rank stopped responding"


def _rank() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return str(launcher_rank())


# What gloo says when a peer rank is gone or silent (NCCL's watchdog ends the process with its own line, naming
# the rank, the collective and the timeout).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed")
_TIMED_OUT = ("Timed out", "timed out", "Timeout")


def collective_failure(err: BaseException, timeout_s: float | None = None) -> str | None:
    """The one line for an error raised because another rank stopped responding in a collective — which rank
    this is (and its node), which collective, and what to do — or None for any other error."""
    chain, seen = [], err
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(e) for e in chain)
    gone, timed_out = any(m in text for m in _PEER_GONE), any(m in text for m in _TIMED_OUT)
    if not (gone or timed_out) or not any(type(e).__name__ in ("DistBackendError", "RuntimeError", "DistError")
                                          for e in chain):
        return None
    # The collective: the outermost torch.distributed call on the stack (what normlab, Lightning or DeepSpeed
    # called), or the stop-signal flags' all-reduce (found by its code, so a move or rename cannot lose it).
    collective = "a collective"
    for e in chain:
        for frame, _ in traceback.walk_tb(e.__traceback__):
            code = frame.f_code
            if code.co_filename.endswith(os.path.join("distributed", "distributed_c10d.py")):
                collective = f"the {code.co_name} collective"
                break
            if code is StopSignals.agreed.__code__:
                collective = "the stop-signal all_reduce"
        else:
            continue
        break
    node = os.environ.get("SLURMD_NODENAME")
    where = f"rank {_rank()}" + (f" (node {node})" if node else "")
    how = (f"waited {timeout_s:g} s (cluster.timeout_s)" if timed_out and timeout_s else
           "timed out" if timed_out else "lost its connection to a peer")
    return (f"{where}: {collective} {how}: {LOST_RANK} (a hung process or a lost node); the run ends here — "
            "resume it with --ckpt_path last (a Slurm job with --requeue comes back by itself when its node failed)")
