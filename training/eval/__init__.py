"""Evaluation: held-out loss/ppl/bpb (heldout.py), a run's history (history.py), harness tasks (harness.py),
the `normlab evaluate` command (cli.py)."""
