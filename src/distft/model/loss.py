"""Chunked cross-entropy: the loss head without the whole logits, for long-context finetuning.

The plain head (`distft.model.lm.summed_loss`) computes `lm_head(hidden).float()`, the (n, vocab)
logits of the n labelled positions, and autograd keeps them for backward, which allocates their
gradient too. With Qwen3's 151,936-token vocabulary a 32k-token row that carries loss on every token
(`text` rows) has 32k x 151,936 x 4 B = 20 GB of fp32 logits, several times over.

`chunked_cross_entropy` walks the n rows `chunk` at a time. For one chunk of hidden states h
(chunk, hidden), targets y and the head's weight W (vocab, hidden; Linear's weight is (out, in)):

    z = (h @ W.T).float()                      logits, matmul in the input dtype as lm_head runs it
    loss += logsumexp(z) - z[y]                summed over the chunk's rows
    d = softmax(z) - onehot(y)                 d loss / d z, known already: no need to wait
    grad_h[chunk] = d @ W                      (chunk, hidden)
    grad_W += d.T @ h                          (vocab, hidden), accumulated in fp32

and frees z before the next chunk, so only one chunk's logits ever exist. The gradients are computed
in forward ("fused forward+backward", the design of Liger Kernel's fused linear cross-entropy,
arXiv 2410.10989, and of Unsloth's fused loss); backward has nothing left to do but scale them by
grad_output. The FLOPs are those of the plain head's forward and backward; what it holds from forward
to backward is grad_h (n, hidden) and grad_W (vocab, hidden), not the logits. The price is traffic:
each chunk reads and writes the fp32 grad_W once more.

Measured on one H200 (torch 2.11, vocab 151,936, hidden 2,560, bf16, every position labelled, the
default budget), forward + backward of the head: 16k rows, plain 27.8 GiB and 82 ms, chunked 3.5 GiB
and 94 ms (frozen weight: 2.1 GiB, 67 ms against 65); 32k rows, plain 55.6 GiB and 170 ms, chunked
3.6 GiB and 187 ms. Loss within 1e-7 of the plain head's, gradients within 5e-4 norm-wise (1.4e-3
for fp32 weights under bf16 autocast, where the plain head rounds grad_W to bf16 and this one does not).

It is chosen automatically when the logits would be large: `loss_chunk` returns a chunk only when
the n x vocab fp32 logits exceed `LOGITS_BUDGET_BYTES`, since below that one matmul is faster than a
loop. It needs the head to be a plain `nn.Linear` without bias holding a plain tensor: a peft-wrapped
head or a sharded (DTensor) weight go the plain way (`summed_loss` decides).
"""

from __future__ import annotations

import torch

# One chunk's fp32 logits may take this much; above it the head is chunked (`loss_chunk`). A chunk
# also holds the logits in the matmul dtype for a moment (1.5x this in bf16), on top of the fp32 grad_W.
LOGITS_BUDGET_BYTES = 1 << 30  # 1 GiB: 1,766 rows of Qwen3's 151,936-token vocabulary


def loss_chunk(n_labelled: int, vocab: int, budget: int = LOGITS_BUDGET_BYTES) -> int | None:
    """Rows per chunk of the loss head, or None when the n_labelled x vocab fp32 logits fit `budget`
    (the plain head is then faster). A chunk's fp32 logits fit the budget; at least one row."""
    row_bytes = vocab * 4  # one row of fp32 logits
    if n_labelled * row_bytes <= budget:
        return None
    return max(1, budget // row_bytes)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T`, gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int):
        want_hidden, want_weight = ctx.needs_input_grad[:2]  # False for a frozen head (LoRA), or eval
        # The matmul dtype: what autocast would run lm_head in (bf16 on single / ddp / zero1), else
        # the inputs' own. Casts are explicit below and autocast is off, so every op's dtype is in view.
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        w = weight.to(dtype)  # no copy unless autocast casts (as it would for lm_head)

        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # fp32 whatever the weight's dtype: the sum over n rows would lose bits in bf16.
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        )
        with torch.autocast(device, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                h, y = hidden[rows].to(dtype), labels[rows]
                z = (h @ w.T).float()  # (chunk, vocab): lm_head(h).float(), as the plain head
                target = z.gather(1, y.unsqueeze(1)).squeeze(1)  # z[y], before z is overwritten
                # logsumexp and softmax in place on z: no second (chunk, vocab) buffer.
                top = z.amax(dim=1, keepdim=True)
                z.sub_(top).exp_()  # exp(z - max): at most 1, no overflow
                sumexp = z.sum(dim=1, keepdim=True)
                loss += (top + sumexp.log()).squeeze(1).sub(target).sum()
                if grad_hidden is None and grad_weight is None:
                    continue
                z.div_(sumexp)  # softmax(z)
                z[torch.arange(z.shape[0], device=z.device), y] -= 1  # softmax - onehot(y) = d loss / d z
                d = z.to(dtype)  # the plain head's backward also runs its matmuls in this dtype
                del z  # in bf16 the fp32 logits go before the matmuls below
                if grad_hidden is not None:
                    grad_hidden[rows] = d @ w
                if grad_weight is not None:
                    accumulate(grad_weight, d.T, h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)  # frees the fp32 copy unless weight is fp32
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        # Out of place: a retained graph (pipeline schedules split backward into an input pass and a
        # weight pass) may call this twice, so the stored gradients must stay unscaled.
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output
        if grad_weight is not None:
            grad_weight = grad_weight * grad_output
        return grad_hidden, grad_weight, None, None


def accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, total in fp32, a and b in the matmul dtype, with no (vocab, hidden) temporary
    where torch allows it."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    elif total.is_cuda:  # the GEMM adds into fp32 itself (cuBLAS; not on CPU in torch 2.13)
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:  # a product in `a.dtype`, then the add
        total += a @ b


def chunked_cross_entropy(
    hidden: torch.Tensor,  # (n, hidden): the labelled positions only
    weight: torch.Tensor,  # (vocab, hidden): the lm_head's weight
    labels: torch.Tensor,  # (n,): every one a token id (no -100: the caller gathered labelled positions)
    chunk: int,  # rows per chunk (`loss_chunk`)
) -> torch.Tensor:
    """Sum over the n rows of cross_entropy(hidden @ weight.T, labels): a 0-d fp32 tensor equal to
    `F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")`, with one chunk's
    logits alive at a time."""
    return ChunkedCrossEntropy.apply(hidden, weight, labels, chunk)
