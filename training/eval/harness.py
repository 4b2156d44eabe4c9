"""`normlab evaluate --tasks ...`: downstream tasks through lm-evaluation-harness (the optional `[eval]` extra).

`NormlabLM` wraps a loaded normlab model as a harness `TemplateLM`, so the harness's own code turns each task
into requests (few-shot contexts, the split of context and continuation into tokens) exactly as for its Hugging
Face model `hf`; only the scoring is ours:
- `loglikelihood`: the requests sorted by length, right-padded into batches (causal attention: padding after a
  sequence cannot change its logits), log-softmax in fp32 over the continuation's positions;
- `loglikelihood_rolling`: the harness's rolling windows of `max_seq_len` tokens, scored the same way;
- `generate_until`: `model.generate` (KV cache), greedy unless the task asks to sample, cut at the first stop
  string.
Tokens are the run's sentencepiece ids, which `normlab export`'s `tokenizer.json` reproduces; an empty context
is conditioned on BOS (EOS when the tokenizer has none), as `hf` does.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import simple_evaluate, utils
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager
from tqdm import tqdm

from model.generate import generate
from training.checkpointing.layout import write_text_atomic
from training.checkpointing.load import CheckpointError, load_checkpoint
from training.loggers import write_scalars

log = logging.getLogger(__name__)

HARNESS_DIR = "lm_eval"  # runs/NAME/eval/lm_eval/step-XXXXXXXX.json


class NormlabLM(TemplateLM):
    """A normlab `Transformer` and its sentencepiece tokenizer as an lm-evaluation-harness model."""

    def __init__(self, model: torch.nn.Module, tokenizer_path: Path, batch_size: int = 8, device: str = "cpu") -> None:
        import sentencepiece as spm

        super().__init__()
        self.model, self.batch_size, self._device = model.eval(), batch_size, torch.device(device)
        self.sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
        self.max_length = model.cfg.max_seq_len

    @property
    def eot_token_id(self) -> int:
        return self.sp.eos_id()

    @property
    def prefix_token_id(self) -> int:
        return self.sp.bos_id() if self.sp.bos_id() >= 0 else self.sp.eos_id()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.sp.encode(string)  # no BOS/EOS added: the exported tokenizer.json adds none either

    def tok_decode(self, tokens: list[int]) -> str:
        return self.sp.decode(tokens)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        # Longest first, so each batch pads little (the order of the answers is restored below).
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        answers: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for b in tqdm(range(0, len(order), self.batch_size), desc="loglikelihood", disable=disable_tqdm):
            batch = order[b:b + self.batch_size]
            # As `hf`: the last max_length + 1 tokens of context + continuation, the last one only a target.
            inputs = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in batch]
            width = max(len(x) for x in inputs)
            padded = torch.tensor([x + [0] * (width - len(x)) for x in inputs], device=self._device)
            logprobs = F.log_softmax(self.model(padded).float(), dim=-1)
            for row, i in enumerate(batch):
                continuation = requests[i][2]
                end = len(inputs[row])
                lp = logprobs[row, end - len(continuation):end]
                target = torch.tensor(continuation, device=self._device)
                answer = (lp.gather(-1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all()))
                answers[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in tqdm([r.args for r in requests], desc="loglikelihood_rolling", disable=disable_tqdm):
            windows = [(None, *utils.make_disjoint_window(w)) for w in utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(ll for ll, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in tqdm([r.args for r in requests], desc="generate_until", disable=disable_tqdm):
            kwargs = dict(gen_kwargs)
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = min(int(kwargs.get("max_gen_toks", 256)), self.max_length - 1)
            prompt = self.tok_encode(context)[-(self.max_length - max_new):] or [self.prefix_token_id]
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            tokens = generate(self.model, torch.tensor([prompt], device=self._device), max_new,
                              temperature=temperature, eos_id=self.eot_token_id)
            text = self.tok_decode([t for t in tokens[0, len(prompt):].tolist() if t != self.eot_token_id])
            for stop in until:
                text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def default_output(checkpoint: str | Path, run_dir: Path | None, step: int | None) -> Path | None:
    """`runs/NAME/eval/lm_eval/step-XXXXXXXX.json` for a checkpoint of a run (beside the other results)."""
    if run_dir is None or step is None:
        return None
    return run_dir / "eval" / HARNESS_DIR / f"{Path(checkpoint).name}.json"


def run_tasks(checkpoint: str | Path, tasks: list[str], num_fewshot: int | None = None, limit: int | None = None,
              batch_size: int = 8, device: str | None = None, output: Path | None = None,
              include_path: str | None = None, log_samples: bool = False) -> dict[str, Any]:
    """Run harness `tasks` on a normlab checkpoint; writes the harness's results JSON to `output` (default:
    `default_output`) and returns the results (with per-item `samples` when `log_samples`)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise ValueError(f"--tasks: unknown task {unknown[0]!r}; `lm-eval ls tasks` lists the harness's tasks, and "
                         "--include-path DIR adds your own YAML task definitions")
    loaded = load_checkpoint(checkpoint, device=device)
    output = output or default_output(checkpoint, loaded.run_dir, loaded.step)
    if output is None:
        raise ValueError(f"--tasks: '{checkpoint}' is not a checkpoint of a run; say where the results go with "
                         "--output FILE.json")
    if loaded.tokenizer_path is None or not loaded.tokenizer_path.is_file():
        raise CheckpointError(f"'{checkpoint}': its tokenizer.model is not found (the run's data directory moved?); "
                              "evaluate an export of it (`normlab export`), which carries the tokenizer")
    lm = NormlabLM(loaded.model, loaded.tokenizer_path, batch_size, device)
    results = simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                              log_samples=log_samples, bootstrap_iters=0)
    summary = {k: v for k, v in results.items() if k != "samples"}
    summary["normlab"] = {"checkpoint": str(checkpoint), "step": loaded.step}
    output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output, json.dumps(summary, indent=2, default=utils.handle_non_serializable) + "\n")
    log.info("harness results: %s", output)
    if loaded.run_dir is not None and loaded.step is not None:
        _log_to_tensorboard(loaded.run_dir, loaded.step, results["results"])
    return results


def _log_to_tensorboard(run_dir: Path, step: int, task_results: dict[str, dict[str, Any]]) -> None:
    """`eval/lm_eval/<task>/<metric>` (e.g. `acc,none` → `acc`) at the checkpoint's step."""
    write_scalars(run_dir, {f"eval/lm_eval/{task}/{key.replace(',none', '').replace(',', '/')}": value
                            for task, metrics in task_results.items() for key, value in metrics.items()
                            if isinstance(value, (int, float)) and not isinstance(value, bool)
                            and "_stderr" not in key}, step)
