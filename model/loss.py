"""Cross-entropy fused with the LM head, in chunks of tokens: the full [N, vocab] logits never exist.

For N tokens and a vocabulary V, plain `F.cross_entropy(h @ Wᵀ, y)` keeps N·V fp32 logits (and their
log-softmax) alive until backward — for 8 × 2048 tokens and V = 128k that is 8 GB. Here each chunk of
`chunk_size` tokens computes its logits, its loss and, right away, its gradients with respect to the hidden
states and the head weight (dlogits = softmax − onehot), then drops the logits. Backward only scales the stored
gradients by the incoming grad. The same idea as Liger-Kernel's fused linear cross-entropy, in plain PyTorch.

Two logit-stability terms live inside the same loop, so they never need the full logits either:
- final-logit soft-capping (Gemma 2): the logits are c · tanh(x / c), bounded by ±c; the chain rule adds a
  factor 1 − tanh²(x / c) to dlogits;
- z-loss (PaLM, OLMo): w · log²Z per token, Z the softmax normalizer, which pulls log Z towards 0 and so
  keeps the logits from drifting; its gradient is 2w · log Z · softmax, added to dlogits.
"""
from __future__ import annotations

import torch


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                ignore_index: int, z_loss: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        needs_grad = h.requires_grad or weight.requires_grad
        grad_h = torch.empty_like(h) if needs_grad else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if needs_grad else None
        valid = targets != ignore_index
        count = valid.sum().clamp_min(1)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        z_total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, n, chunk_size):
            h_c, y_c, v_c = h[s:s + chunk_size], targets[s:s + chunk_size], valid[s:s + chunk_size]
            logits = (h_c @ weight.t()).float()  # [c, V], the only logits alive at a time
            if softcap is not None:
                tanh = torch.tanh(logits / softcap)
                logits = softcap * tanh
            lse = logits.logsumexp(-1)
            safe_y = y_c.masked_fill(~v_c, 0)
            target_logit = logits.gather(1, safe_y[:, None]).squeeze(1)
            total += ((lse - target_logit) * v_c).sum()
            if z_loss:
                z_total += (lse.square() * v_c).sum()
            if needs_grad:
                dlogits = (logits - lse[:, None]).exp_()  # softmax, in place of the logits
                if z_loss:
                    dlogits *= (1.0 + 2.0 * z_loss * lse)[:, None]  # d(w · lse²) = 2w · lse · softmax
                dlogits[torch.arange(len(y_c), device=h.device), safe_y] -= 1.0
                dlogits *= (v_c.float() / count)[:, None]  # d(mean loss)/dlogits
                if softcap is not None:
                    dlogits *= 1.0 - tanh.square()  # through c · tanh(x / c)
                grad_h[s:s + chunk_size] = (dlogits.to(h.dtype) @ weight).to(h.dtype)
                grad_w.addmm_(dlogits.t(), h_c.float())
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if grad_w is not None else None)
        z_term = z_loss * z_total / count
        ctx.mark_non_differentiable(z_term)  # a diagnostic: its gradient is already part of the loss's
        return total / count + z_term, z_term

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_z: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype),
                None, None, None, None, None)


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               chunk_size: int = 1024, ignore_index: int = -100, *, z_loss: float = 0.0,
                               softcap: float | None = None, return_z_loss: bool = False):
    """Mean cross-entropy of `h @ weight.T` against `targets`, computed `chunk_size` tokens at a time.

    h [..., dim], weight [vocab, dim], targets [...] (entries equal to `ignore_index` are skipped).
    Equals `F.cross_entropy(h @ weight.T, targets)` to fp32 rounding, with peak extra memory chunk_size·vocab.
    `softcap` c: the logits are c · tanh(h @ weight.T / c) (Gemma 2). `z_loss` w > 0 adds w · mean(log²Z)
    (PaLM) to the loss; `return_z_loss` returns (loss, that term), the term detached, for logging.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be positive")
    if z_loss < 0 or (softcap is not None and softcap <= 0):
        raise ValueError(f"z_loss={z_loss} must be >= 0 and softcap={softcap} positive or None")
    loss, z_term = _FusedLinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1),
                                                  chunk_size, ignore_index, float(z_loss), softcap)
    return (loss, z_term) if return_z_loss else loss


def softcap_logits(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """c · tanh(logits / c) (Gemma 2's soft-capping), or the logits unchanged when `softcap` is None."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)
