"""Checkpoints, on top of the run directory's format (training/run/): saving one atomically (save.py, with
held_writes.py for DeepSpeed's writes), what a run starts from (plan.py), what a resume checks (resume.py), cooldown
branches (branch.py), starting from other weights (init_from.py, surgery.py), reading without running code
(safe.py, remote_code.py), DeepSpeed's universal format for another world size (universal.py), and loading a saved
model for evaluation, export and generation (load.py)."""
