"""Sequence parallelism the way axolotl does it with ring-flash-attention, on seqpar (CPU or GPU).

    torchrun --nproc-per-node 2 examples/axolotl_style.py

The model's attention implementation is "flash_attention_2"; ``substitute_hf_flash_attn`` makes it
context-parallel once, and every step ``update_ring_flash_attn_params`` passes the packed batch's
global ``cu_seqlens``. Each rank feeds its contiguous piece of the packed stream (``input_ids`` and
``position_ids`` restarting at every document); its loss is its tokens' loss sum over the batch's
label count, so the gradients summed over the ranks are the whole batch's mean-loss gradients.
Only the import differs from the ring-flash-attention version (no flash-attn build needed here).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from seqpar.compat.ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params
# was: from ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params

VOCAB = 128


def packed_batch(world_size, generator):
    """Documents of random lengths packed into one stream (padded to a multiple of the ranks), with
    restarting position ids and next-token labels inside each document."""
    lengths = torch.randint(1, 40, (6,), generator=generator).tolist()
    lengths.append(-sum(lengths) % world_size or world_size)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = torch.full_like(ids, -100)
    cu_seqlens = [0]
    for n in lengths:
        a = cu_seqlens[-1]
        labels[0, a:a + n - 1] = ids[0, a + 1:a + n]
        cu_seqlens.append(a + n)
    return ids, position_ids, labels, torch.tensor(cu_seqlens, dtype=torch.int32)


def main(steps=5):
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD  # the sequence-parallel group (here: every rank)
    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "flash_attention_2"
    substitute_hf_flash_attn(group, heads_k_stride=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)  # the same batches on every rank of the group
    for step in range(steps):
        ids, position_ids, labels, cu_seqlens = packed_batch(world_size, data)
        update_ring_flash_attn_params(cu_seqlens, group)
        t_local = ids.shape[1] // world_size
        mine = slice(rank * t_local, (rank + 1) * t_local)
        logits = model(input_ids=ids[:, mine], position_ids=position_ids[:, mine], use_cache=False).logits
        count = int((labels != -100).sum())
        loss = F.cross_entropy(logits[0], labels[0, mine], ignore_index=-100, reduction="sum") / count
        loss.backward()
        for p in model.parameters():  # every rank holds its tokens' share of each gradient
            dist.all_reduce(p.grad, group=group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        if rank == 0:
            print(f"step {step}: {ids.shape[1]} tokens in {len(cu_seqlens) - 1} documents, loss {total.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
