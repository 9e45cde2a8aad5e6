"""The language-model loss without the full-vocabulary logits of every token at once.

``loss = sum over labelled tokens t of  logsumexp_v(z[t, v]) - z[t, label[t]]``, with
``z = softcap(hidden @ weight.T + bias)``, computed over chunks of ``chunk_size`` tokens: only one
chunk's logits (``[chunk_size, V]`` fp32, plus one temporary of that size) exist at a time, instead
of ``[N, V]`` logits, their fp32 copy and their gradient. At 128K local tokens and a 128K vocabulary
that is 2 x 256 MiB per chunk of 512 tokens instead of ~190 GiB.

Gradients are exact and computed in the forward pass, chunk by chunk (the softmax minus the
one-hot target, times ``weight`` for the hidden states and times the hidden states for the
weight), so nothing is recomputed in backward; backward only scales them by the incoming gradient.
When no gradient is needed (``torch.no_grad()``, or no input requires one) only the loss is
computed.

Backends: ``"torch"`` (above; any device), ``"liger"`` (liger-kernel's fused linear cross entropy,
CUDA only, ``pip install 'seqpar[liger]'``), ``"auto"``: liger on CUDA tensors when it is installed,
torch otherwise.

:func:`causal_lm_loss` applies it to a transformers ``*ForCausalLM``, also when FSDP2 shards it
(``fully_shard`` on the root, as :func:`seqpar.integrations.parallelize.parallelize` does): it runs
the decoder for the final hidden states and the chunked loss with the output embedding inside one
FSDP-registered forward method, so the (possibly tied) ``lm_head`` weight is the unsharded one.
In a context-parallel training step::

    shard = shard_inputs(ids, cu_seqlens=cu, group=model.seqpar_cp_group, method=cp_method)
    loss_sum = causal_lm_loss(model, labels=shard.labels, **shard.model_kwargs())
    (loss_sum / global_label_count).backward()   # parallelize sums the ranks' gradients
"""

from __future__ import annotations

import types

import torch

__all__ = ["DEFAULT_CHUNK_BYTES", "causal_lm_loss", "chunked_cross_entropy", "default_chunk_size"]

DEFAULT_CHUNK_BYTES = 256 * 2**20  # one chunk's fp32 logits
BACKENDS = ("auto", "torch", "liger")
_METHOD = "seqpar_causal_lm_loss"


def default_chunk_size(vocab_size: int, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take at most ``budget_bytes``
    (512 tokens at a 128K vocabulary, 2048 at 32K), at least 1."""
    return max(1, budget_bytes // (4 * vocab_size))


def _chunk_logits(h, weight, bias, softcap):
    """Logits of one chunk in fp32 (float64 for float64 inputs), and tanh(z / softcap) when capped."""
    z = h @ weight.t()
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if bias is not None:
        z += bias.to(z.dtype)
    if softcap is None:
        return z, None
    t = torch.tanh(z / softcap)
    return t * softcap, t


def _forward(hidden, weight, bias, labels, chunk_size, ignore_index, softcap, grads):
    """The summed loss, and when ``grads`` the gradients of the sum for hidden, weight and bias."""
    n, dtype = hidden.shape[0], hidden.dtype
    acc = torch.promote_types(dtype, torch.float32)
    loss = torch.zeros((), dtype=acc, device=hidden.device)
    gh = torch.zeros_like(hidden) if grads[0] else None
    gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grads[1] else None
    gb = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if grads[2] else None
    for lo in range(0, n, chunk_size):
        h, y = hidden[lo:lo + chunk_size], labels[lo:lo + chunk_size]
        valid = y != ignore_index
        target = torch.where(valid, y, 0)
        z, t = _chunk_logits(h, weight, bias, softcap)
        lse = torch.logsumexp(z, dim=-1)
        picked = z.gather(1, target[:, None])[:, 0]
        loss += torch.where(valid, lse - picked, 0.0).sum()
        if gh is None and gw is None and gb is None:
            continue
        g = z.sub_(lse[:, None]).exp_()  # softmax, in z's memory
        g[torch.arange(len(y), device=g.device), target] -= 1.0
        g *= valid[:, None]
        if t is not None:  # d softcap*tanh(x/softcap) / dx = 1 - tanh^2
            g *= 1.0 - t * t
        if gb is not None:
            gb += g.sum(0)
        g = g.to(dtype)
        if gh is not None:
            gh[lo:lo + chunk_size] = g @ weight
        if gw is not None and gw.dtype == dtype:
            gw.addmm_(g.t(), h)  # in place: no second weight-sized buffer
        elif gw is not None:
            gw += g.t() @ h  # bf16/fp16 product summed in fp32
    return loss, gh, gw, gb


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, ignore_index, softcap):
        grads = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        loss, gh, gw, gb = _forward(hidden, weight, bias, labels, chunk_size, ignore_index, softcap, grads)
        ctx.save_for_backward(*(x for x in (gh, gw, gb) if x is not None))
        ctx.present = tuple(x is not None for x in (gh, gw, gb))
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # The gradients are scaled in place (no second weight-sized buffer), so a second backward
        # through the same graph (retain_graph=True) would scale them twice: refuse it.
        if getattr(ctx, "done", False):
            raise RuntimeError("chunked_cross_entropy: backward through the same loss twice is not supported; "
                               "compute the loss again")
        ctx.done = True
        saved = iter(ctx.saved_tensors)
        out = []
        for present, dtype in zip(ctx.present, ctx.dtypes):
            out.append(next(saved).mul_(grad_loss).to(dtype) if present else None)
        return out[0], out[1], out[2], None, None, None, None


def _check(hidden, weight, labels, bias, chunk_size, backend) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden: expected [N, d] against weight [V, d], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}; flatten the batch (hidden.reshape(-1, d))")
    if labels.shape != hidden.shape[:1] or labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels: expected integer [N] = [{hidden.shape[0]}], got {labels.dtype} "
                         f"{tuple(labels.shape)}; flatten and align them with the hidden states")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias: expected [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive int (tokens per chunk) or None, got {chunk_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


def _liger(backend: str, hidden: torch.Tensor):
    """liger-kernel's fused loss class when it should be used, else None."""
    if backend == "torch" or (backend == "auto" and not hidden.is_cuda):
        return None
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        if backend == "liger":
            raise ValueError("backend='liger' needs liger-kernel: pip install 'seqpar[liger]' "
                             "(or use backend='torch')") from None
        return None
    if not hidden.is_cuda:
        raise ValueError("backend='liger' runs on CUDA tensors only; use backend='torch' on this device")
    return LigerFusedLinearCrossEntropyLoss


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          chunk_size: int | None = None, ignore_index: int = -100,
                          bias: torch.Tensor | None = None, softcap: float | None = None,
                          backend: str = "auto") -> torch.Tensor:
    """Summed cross entropy of ``hidden @ weight.T (+ bias)`` against ``labels``: an fp32 scalar
    (float64 for float64 inputs).

    ``hidden`` [N, d] (this rank's tokens, any float dtype), ``weight`` [V, d] (the full output
    embedding; under FSDP2 the unsharded one, see :func:`causal_lm_loss`), ``labels`` [N] (int;
    ``ignore_index`` marks tokens without a target; targets must lie in ``[0, V)``). ``softcap``
    caps the logits as ``softcap * tanh(z / softcap)`` (Gemma-2's final_logit_softcapping).
    ``chunk_size`` tokens per chunk (default :func:`default_chunk_size`: 256 MiB of fp32 logits).
    Logits are computed in the inputs' dtype and taken to fp32 before the softmax, as transformers'
    models do; the weight's gradient is summed over chunks in fp32. Divide by the (global) label
    count for the mean. See the module doc for memory and backends.
    """
    _check(hidden, weight, labels, bias, chunk_size, backend)
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0])
    labels = labels.long()
    fused = _liger(backend, hidden)
    if fused is not None:
        out = fused(ignore_index=ignore_index, reduction="sum", softcap=softcap)(weight, hidden, labels, bias)
        out = getattr(out, "loss", out)  # newer releases return a CrossEntropyOutput, older a tensor or tuple
        return (out[0] if isinstance(out, tuple) else out).float()
    need = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    if not need:
        return _forward(hidden, weight, bias, labels, chunk_size, ignore_index, softcap, (False,) * 3)[0]
    return _ChunkedCrossEntropy.apply(hidden, weight, bias, labels, chunk_size, ignore_index, softcap)


def _loss_forward(self, input_ids, labels, chunk_size, ignore_index, backend, kwargs):
    """Bound to a ``*ForCausalLM`` as ``seqpar_causal_lm_loss``: decoder, then the chunked loss."""
    config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
    hidden = self.base_model(input_ids=input_ids, **kwargs).last_hidden_state
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies the logits
    if scale is not None and scale != 1:
        hidden = hidden * scale
    divide = getattr(config, "logits_scaling", None)  # Granite divides them
    if divide is not None and divide != 1:
        hidden = hidden / divide
    head = self.get_output_embeddings()
    return chunked_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, labels.reshape(-1),
                                 chunk_size=chunk_size, ignore_index=ignore_index,
                                 bias=getattr(head, "bias", None),
                                 softcap=getattr(config, "final_logit_softcapping", None), backend=backend)


def causal_lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, *, chunk_size: int | None = None,
                   ignore_index: int = -100, backend: str = "auto", **model_kwargs) -> torch.Tensor:
    """This rank's summed token loss of a transformers ``*ForCausalLM``, without its full logits.

    ``input_ids`` [B, T] (this rank's tokens, e.g. a context-parallel shard), ``labels`` [B, T]
    *already aligned*: ``labels[b, t]`` is the target of position ``t`` (the next token, shifted
    before sharding, as :func:`seqpar.integrations.hf.shift_labels` gives), ``ignore_index`` where
    there is none. ``model_kwargs`` (``position_ids``, ...) go to the decoder (``model.base_model``).
    Returns the fp32 sum over labelled tokens (the trainer divides by the global label count).

    Equal to ``F.cross_entropy(model(input_ids).logits.float().flatten(0, 1), labels.flatten(),
    reduction="sum")`` for models whose logits are ``lm_head(final hidden)``, optionally scaled
    (``logit_scale``, ``logits_scaling``) and soft-capped (``final_logit_softcapping``).

    Under FSDP2 (``fully_shard`` on the root) the computation runs as a forward method registered
    with ``torch.distributed.fsdp.register_fsdp_forward_method`` (installed on the model at the
    first call, as ``model.seqpar_causal_lm_loss``), so the root's parameters, the output
    embedding included, are all-gathered for it and its gradients reduce-scattered like forward's.
    """
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    sharded = isinstance(model, FSDPModule)
    if getattr(model, _METHOD + "_sharded", None) is not sharded:  # first call, or sharded since
        setattr(model, _METHOD, types.MethodType(_loss_forward, model))
        register_fsdp_forward_method(model, _METHOD)  # a no-op when the model is not FSDP-sharded
        setattr(model, _METHOD + "_sharded", sharded)
    return getattr(model, _METHOD)(input_ids, labels, chunk_size, ignore_index, backend, model_kwargs)
