"""lm-evaluation-harness's model interface for normlab: `NormlabLM` wraps a normlab model (a loaded checkpoint,
or the live model of a training run) as a harness `TemplateLM`, so the harness's own code turns each task into
requests (few-shot contexts, the split of context and continuation into tokens) exactly as for its Hugging Face
model `hf`; only the scoring is ours:
- `loglikelihood`: the requests sorted by length, right-padded into batches (causal attention: padding after a
  sequence cannot change its logits), log-softmax in fp32 over the continuation's positions. Inside a training
  run on several ranks, the batches are dealt out to the ranks (each scores its share; every rank runs the same
  number of forwards, which ZeRO-3's collective parameter gathers need) and the answers are gathered once per
  call, so every rank ends with all of them;
- `loglikelihood_rolling`: the harness's rolling windows of `max_seq_len` tokens, scored the same way;
- `generate_until`: `model.generate` (KV cache), greedy unless the task asks to sample, cut at the first stop
  string (one process only).
Tokens are the run's own tokenizer's ids, which `normlab export`'s `tokenizer.json` reproduces; an empty context
is conditioned on BOS (EOS when the tokenizer has none), as `hf` does. Which tasks, how they are scored and where
the numbers go: `training/eval/tasks.py`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from data.layout import load_tokenizer
from model.generate import generate


class NormlabLM(TemplateLM):
    """A normlab `Transformer` and its tokenizer as an lm-evaluation-harness model. `distributed`: split the
    scoring across the ranks of the initialized process group (in a training run); the harness itself sees one
    process, so every rank builds the same requests and gets the same results."""

    def __init__(self, model: torch.nn.Module, tokenizer_path: Path, batch_size: int = 8, device: str = "cpu",
                 distributed: bool = False) -> None:
        super().__init__()
        self.model, self.batch_size, self._device = model, batch_size, torch.device(device)
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.max_length = model.cfg.max_seq_len
        self._ranks = (dist.get_rank(), dist.get_world_size()) if distributed and dist.is_initialized() else (0, 1)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id if self.tokenizer.bos_id >= 0 else self.tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode_batch([string])[0]  # no BOS/EOS added: the exported tokenizer adds none

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        # Longest first, so each batch pads little (the order of the answers is restored below).
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        batches = [order[b:b + self.batch_size] for b in range(0, len(order), self.batch_size)]
        rank, world = self._ranks
        mine = batches[rank::world]
        rounds = -(-len(batches) // world)  # every rank runs this many forwards (ZeRO-3 gathers are collective)
        scored: dict[int, tuple[float, bool]] = {}
        for r in tqdm(range(rounds), desc="loglikelihood", disable=disable_tqdm or world > 1):
            batch = mine[r] if r < len(mine) else batches[0]  # a rank with no batch left repeats one, unused
            answers = self._score_batch([requests[i] for i in batch])
            if r < len(mine):
                scored.update(zip(batch, answers, strict=True))
        if world > 1:
            shares: list[Any] = [None] * world
            dist.all_gather_object(shares, scored)
            scored = {i: answer for share in shares for i, answer in share.items()}
        answers_in_order = [scored[i] for i in range(len(requests))]
        for request, answer in zip(requests, answers_in_order, strict=True):
            if request[0] is not None:
                self.cache_hook.add_partial("loglikelihood", request[0], answer)
        return answers_in_order

    def _score_batch(self, requests: list[tuple[Any, list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation, whether it is the greedy one) for each request of one batch."""
        # As `hf`: the last max_length + 1 tokens of context + continuation, the last one only a target.
        inputs = [(context + continuation)[-(self.max_length + 1):][:-1] for _, context, continuation in requests]
        width = max(len(x) for x in inputs)
        padded = torch.tensor([x + [0] * (width - len(x)) for x in inputs], device=self._device)
        logprobs = F.log_softmax(self.model(padded).float(), dim=-1)
        answers = []
        for row, (_, _, continuation) in enumerate(requests):
            end = len(inputs[row])
            lp = logprobs[row, end - len(continuation):end]
            target = torch.tensor(continuation, device=self._device)
            answers.append((lp.gather(-1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())))
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
        if self._ranks[1] > 1:
            raise ValueError("generation tasks are not scored inside a multi-rank training run; evaluate them on a "
                             "checkpoint with `normlab evaluate --tasks`")
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
