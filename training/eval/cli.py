"""`normlab evaluate`: loss, perplexity and bits per byte of saved checkpoints on held-out tokens, or
lm-evaluation-harness tasks.

`--checkpoint` takes one checkpoint (scored by `training/eval/heldout.py`), a run directory `runs/NAME` (every
checkpoint of the run: `training/eval/history.py`), and `--tasks` runs harness tasks on either
(`training/eval/tasks.py`). The numbers go into the run's TensorBoard (`eval/<set>/loss|ppl|bpb`,
`eval/<task>/acc|acc_norm|bpb` at the checkpoint's step).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from data.atomic import write_text_atomic
from training.errors import UserError
from training.eval import require_harness
from training.eval.heldout import evaluate_sets, split_line
from training.eval.history import evaluate_run
from training.run.dir import RunDir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="normlab evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True,
                    help="a step directory, a .ckpt/.pt/.safetensors file, an export, or a run directory "
                         "runs/NAME (every complete checkpoint, results in runs/NAME/eval/)")
    ap.add_argument("--data", nargs="+", default=None, metavar="[NAME=]DIR",
                    help="prepared data directories, optionally named (default: the run's own validation set)")
    ap.add_argument("--split", default="val", help="which split to evaluate (default: val)")
    ap.add_argument("--max_tokens", type=int, default=None,
                    help="evaluate about this many tokens, spread over the split (default: the run's validation set)")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    ap.add_argument("--output", type=Path, default=None,
                    help="write the numbers to this JSON file (one checkpoint: a dict for one set, {'sets': {name: "
                         "dict}} for several)")
    harness = ap.add_argument_group("downstream tasks (lm-evaluation-harness, `pip install -e \".[eval]\"`)")
    harness.add_argument("--tasks", default=None,
                         help="comma-separated harness tasks, e.g. hellaswag,arc_easy (instead of held-out loss)")
    harness.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    harness.add_argument("--limit", type=int, default=None, help="at most this many examples per task")
    harness.add_argument("--include_path", default=None,
                         help="a directory of your own YAML task definitions. They are code: a task's `!function` "
                              "imports Python from that directory and runs it, so pass only tasks you wrote or "
                              "trust; a run or checkpoint directory is refused")
    args = ap.parse_args(argv)

    if args.tasks:
        return _run_tasks(args, RunDir(args.checkpoint).is_run())
    if RunDir(args.checkpoint).is_run():
        if args.output is not None:
            raise UserError("--output: a run's results go to <run>/eval/; leave --output out, or evaluate one "
                            "checkpoint directory")
        evaluate_run(args.checkpoint, args.data, args.split, args.max_tokens, args.batch_size, args.device)
        return 0
    results = evaluate_sets(args.checkpoint, args.data, args.split, args.max_tokens, args.batch_size, args.device)
    if args.output:
        out = results[0] if len(results) == 1 else {"sets": {r["set"]: r for r in results}}
        write_text_atomic(args.output, json.dumps(out, indent=2) + "\n")
    for result in results:
        print(f"step {result['step']}: {split_line(result)}")
    return 0


def _run_tasks(args: argparse.Namespace, run_dir: bool) -> int:
    """`--tasks`: the harness on one checkpoint, or on every checkpoint of a run not yet scored with the same
    settings."""
    require_harness("--tasks")
    from training.eval.tasks import evaluate_run_tasks, run_tasks, summary_line

    if args.data:
        raise UserError("--tasks scores harness tasks and takes no --data")
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    options = {"num_fewshot": args.num_fewshot, "limit": args.limit, "batch_size": args.batch_size,
               "device": args.device, "include_path": args.include_path}
    if run_dir:
        if args.output is not None:
            raise UserError("--output: a run's results go to <run>/eval/lm_eval/; leave --output out, or evaluate "
                            "one checkpoint directory")
        for step, metrics in evaluate_run_tasks(args.checkpoint, names, **options).items():
            print(f"step {step}: {summary_line(metrics)}")
        return 0
    results = run_tasks(args.checkpoint, names, output=args.output, **options)
    print(summary_line(results["metrics"]))
    return 0
