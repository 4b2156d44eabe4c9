"""A run on a cluster: stop requests and the ranks' agreement on them (signals.py, stop.py), the collective timeout
(config.py, timeout.py), the line for a lost rank (failure.py), requeueing a Slurm job (requeue.py) and the
launcher's rank (rank.py). Nothing is imported here: `normlab` installs the signal handlers before any heavy import.
"""
