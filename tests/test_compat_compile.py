"""The ring-flash-attention drop-in under ``torch.compile``: each call runs eagerly (a graph break
around it, ``torch.compiler.disable``), since its rank checks and llama3's offset all-gathers cannot
be traced. Without it Dynamo failed inside the rank agreement (fullgraph or not). A compiled
function that calls the drop-in must equal the eager one exactly; ``fullgraph=True`` must refuse
it with a message that names ``seqpar.attention`` (which compiles as one op)."""

from __future__ import annotations

import torch

import seqpar
import seqpar.compat.ring_flash_attn as rfa
from seqpar.testing import run_distributed

from dist_utils import world


def _llama3_args(rank: int, n: int):
    cu = torch.tensor([0, 5, 11, 8 * n], dtype=torch.int32)  # documents across the pieces
    cq, ck, mq, mk, ks = rfa.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, n)
    return (cq, ck, mq, mk, 1, ks)


def _compiled_dropin(fullgraph: bool):
    rank, n = world()
    gen = torch.Generator().manual_seed(2)
    dense = [seqpar.shard(torch.randn(2, 16, h, 8, generator=gen), method="zigzag_ring") for h in (4, 2, 2, 4)]
    stream = [torch.randn(8, h, 8, generator=gen) for h in (4, 2, 2, 4)]  # this rank's piece [T_local, H, D]
    args = _llama3_args(rank, n)

    def fn(q, k, v, qs, ks, vs):
        out, lse, _ = rfa.zigzag_ring_flash_attn_func(q * 1.0, k, v, causal=True, return_attn_probs=True)
        out2, lse2, _ = rfa.llama3_flash_attn_varlen_func(qs * 1.0, ks, vs, *args, causal=True, return_attn_probs=True)
        return out * 2.0, lse + 1.0, out2 * 2.0, lse2 - 1.0

    def run(f):
        leaves = [x.clone().requires_grad_() for x in dense[:3] + stream[:3]]
        out, lse, out2, lse2 = f(*leaves)
        ((out * dense[3]).sum() + (out2 * stream[3]).sum()).backward()
        return [out.detach(), lse, out2.detach(), lse2] + [x.grad for x in leaves]

    torch._dynamo.reset()
    eager = run(fn)
    try:
        compiled = run(torch.compile(fn, backend="aot_eager", fullgraph=fullgraph))
    except Exception as exc:  # noqa: BLE001 (fullgraph=True: Dynamo's Unsupported, with the reason)
        return str(exc)
    finally:
        torch._dynamo.reset()
    return [torch.equal(a, b) for a, b in zip(eager, compiled)]


def test_dropin_runs_eagerly_inside_a_compiled_function():
    for rank, same in enumerate(run_distributed(_compiled_dropin, 2, False, timeout=300)):
        assert same == [True] * 10, f"rank {rank}: compiled differs from eager in (out, lse, out2, lse2, grads): {same}"


def test_fullgraph_refuses_the_dropin_and_says_why():
    for rank, message in enumerate(run_distributed(_compiled_dropin, 2, True, timeout=300)):
        assert isinstance(message, str) and "seqpar.attention" in message, f"rank {rank}: {message}"
