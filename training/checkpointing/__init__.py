"""Checkpoints: the layout and manifest (layout.py), resume checks (resume.py), cooldown branches (branch.py),
loading a saved model for evaluation, export and generation (load.py)."""
