"""ring-flash-attention code, unchanged but for one import, running on seqpar (CPU or GPU).

    torchrun --nproc-per-node 2 examples/ring_flash_attn_dropin.py

Before: ``import ring_flash_attn`` (CUDA and a flash-attn build only). After: the import below.
Each rank cuts the same global tensors the way ring-flash-attention's own tests do, calls the
zigzag ring and the llama3 (packed stream) functions forward and backward, and compares its local
output and gradients with single-process attention on the whole sequence.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpar.compat.ring_flash_attn as ring_flash_attn  # was: import ring_flash_attn


def zigzag(x, rank, world_size):
    """Chunks rank and 2N-1-rank of 2N along the sequence (dim 1): the zigzag layout."""
    chunks = x.chunk(2 * world_size, dim=1)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=1).detach().clone()


def main():
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    torch.manual_seed(0)  # the same global tensors on every rank
    B, T, Hq, Hkv, D = 1, 64 * world_size, 8, 2, 64  # GQA: 8 query heads share 2 K,V heads
    q, k, v, dout = (torch.randn(B, T, h, D, device=device) for h in (Hq, Hkv, Hkv, Hq))

    # dense zigzag ring: [B, T_local, H, D] per rank
    local = [zigzag(x, rank, world_size).requires_grad_() for x in (q, k, v)]
    out, lse, _ = ring_flash_attn.zigzag_ring_flash_attn_func(*local, causal=True, return_attn_probs=True)
    out.backward(zigzag(dout, rank, world_size))

    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in ref), is_causal=True,
                                             enable_gqa=True).transpose(1, 2)
    ref_out.backward(dout)
    errors = {name: (a - zigzag(b, rank, world_size)).abs().max().item()
              for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in local)),
                                    (ref_out, *(x.grad for x in ref)))}

    # the packed stream cut into contiguous pieces, documents crossing ranks (llama3_*)
    cu_seqlens = torch.tensor([0, 5, 70, T - 3, T], dtype=torch.int32, device=device)
    cu_q, cu_k, max_q, max_k, k_slice = ring_flash_attn.llama3_flash_attn_prepare_cu_seqlens(
        cu_seqlens, causal=True, rank=rank, world_size=world_size)
    t_local = T // world_size
    piece = slice(rank * t_local, (rank + 1) * t_local)
    packed = [x[0, piece].detach().clone().requires_grad_() for x in (q, k, v)]
    stream_out = ring_flash_attn.llama3_flash_attn_varlen_func(*packed, cu_q, cu_k, max_q, max_k, heads_k_stride=1,
                                                               local_k_slice=k_slice, causal=True)
    bounds = cu_seqlens.tolist()
    heads_first = [x.transpose(1, 2) for x in (q, k, v)]
    docs = [F.scaled_dot_product_attention(*(x[:, :, a:b] for x in heads_first), is_causal=True, enable_gqa=True)
            for a, b in zip(bounds, bounds[1:])]
    stream_ref = torch.cat(docs, dim=2).transpose(1, 2)[0, piece]
    errors["llama3 out"] = (stream_out - stream_ref).abs().max().item()

    if rank == 0:
        print(f"{world_size} ranks on {device}; max |local - single-process|: "
              + ", ".join(f"{name} {e:.1e}" for name, e in errors.items()) + f"; lse {tuple(lse.shape)}")
    assert max(errors.values()) < 1e-4, errors
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
