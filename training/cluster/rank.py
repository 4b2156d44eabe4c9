"""The launcher's rank of this process, read once and the same way everywhere: before any process group exists
(the run lock, the log filter of `normlab`'s first lines, the lost-rank line of a rank that never connected)."""
from __future__ import annotations

import os

# The variables a launcher sets to a process's rank, a global rank first: torchrun and DeepSpeed set RANK, srun
# SLURM_PROCID, jsrun JSM_NAMESPACE_RANK; Lightning's own launcher sets NODE_RANK and LOCAL_RANK (global rank
# NODE_RANK × devices + LOCAL_RANK). The job's first rank has 0 in every one of them that is set.
RANK_VARS = ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK", "NODE_RANK", "LOCAL_RANK")


def launcher_rank() -> int:
    """0 for the job's first rank — every rank variable the launcher set is 0, or a plain process that sets none —
    else the first non-zero one of RANK_VARS (the global rank, where the launcher sets one)."""
    for var in RANK_VARS:
        value = os.environ.get(var, "").strip()
        if value not in ("", "0"):
            return int(value) if value.isdigit() else 1
    return 0


def is_first_rank() -> bool:
    """Whether this process is its job's rank 0, from the launcher's environment alone."""
    return launcher_rank() == 0
