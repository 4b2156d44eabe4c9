"""A run directory's format and its one reader, at the ground of training/: the name of every file of a run
(layout.py), the checkpoint manifest (manifest.py), `RunDir` (dir.py), a run's place in a sweep (membership.py)
and the locks (lock.py). Nothing here imports the trainer, the checkpoint code or the sweep."""
