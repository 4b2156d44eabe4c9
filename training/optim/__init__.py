"""The optimizer, one subsystem (laid out as OLMo-core's `optim/`): the `optim.*` config (config.py), the
parameter groups (groups.py), the LR schedule and the optimizer built with it (schedule.py), the optimizers
`optim.name` chooses from (registry.py; Muon with AdamW as one optimizer, muon.py), and one update of a plain loop
outside Lightning (step.py). The names other packages use are importable from here."""
from training.optim.config import (
           DECAY_SHAPES,
           KIND_PARENT,
           PARAM_KINDS,
           SCHEDULES,
           GroupSpec,
           OptimConfig,
           renamed_option,
)
from training.optim.groups import check_group_names, named_kinds, param_groups, param_kind
from training.optim.registry import OPTIMIZERS, Optimizer
from training.optim.schedule import GROUP_HPARAMS, build_optimizer, lr_factor, restart_schedule
from training.optim.step import plain_update

__all__ = ["DECAY_SHAPES", "GROUP_HPARAMS", "KIND_PARENT", "OPTIMIZERS", "PARAM_KINDS", "SCHEDULES", "GroupSpec",
           "OptimConfig", "Optimizer", "build_optimizer", "check_group_names", "lr_factor", "named_kinds",
           "param_groups", "param_kind", "plain_update", "renamed_option", "restart_schedule"]
