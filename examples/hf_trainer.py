"""A plain transformers Trainer script, context-parallel: the only change is the Trainer class.

    torchrun --nproc-per-node 4 examples/hf_trainer.py --cp 2                   # 2 x cp 2, CPU or GPUs
    torchrun --nproc-per-node 8 examples/hf_trainer.py --cp 8 --model my_llama/ --text-file corpus.txt \\
        --method usp --ulysses-degree 2 --fsdp --bf16

Without ``--model`` it trains a tiny random Llama (GQA) on bytes of ``--text-file`` (or of a built-in
paragraph), so it runs anywhere without downloads. The documents are packed by transformers'
``DataCollatorWithFlattening`` (no padding; documents never attend to each other); each sequence is
split over ``--cp`` ranks, the rest of the world is data parallel. The logged loss is the global
token mean, as with one process; ``save_model`` writes a folder ``from_pretrained`` loads.
"""

import argparse

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening, LlamaConfig,
                          LlamaForCausalLM, TrainingArguments)

from seqpar.integrations.hf_trainer import ContextParallelTrainer   # was: from transformers import Trainer

TEXT = ("The river ran past the old station, and the morning train carried letters to the village. "
        "A curious student walked across the narrow bridge; the teacher explained the pattern again. "
        "In winter the harbour was quiet, in summer the market opened early and closed late. ")


def documents(args):
    """Examples ``{"input_ids": [...]}`` of awkward lengths: the text cut into pieces of 37 to 1000 units."""
    text = open(args.text_file).read() if args.text_file else TEXT * 40
    if args.model:
        ids = AutoTokenizer.from_pretrained(args.model)(text)["input_ids"]
    else:  # bytes as tokens: no tokenizer needed for the tiny model
        ids = list(text.encode())
    out, start, k = [], 0, 0
    while start < len(ids):
        n = 37 + (k * 263) % (args.max_doc - 36)
        out.append({"input_ids": ids[start:start + n]})
        start, k = start + n, k + 1
    return out


def model_for(args):
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model)
    torch.manual_seed(0)  # the same weights on every rank
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=2, help="ranks per sequence (context_parallel_size)")
    p.add_argument("--method", default="zigzag_ring", help="seqpar softmax method (cp_method)")
    p.add_argument("--ulysses-degree", type=int, default=None, help="usp: ranks of the all-to-all axis")
    p.add_argument("--model", default=None, help="a model folder or hub id (default: a tiny random Llama)")
    p.add_argument("--text-file", default=None)
    p.add_argument("--max-doc", type=int, default=1000, help="longest document, in tokens")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4, help="documents per step and context-parallel group")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 over all ranks")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch_compile=True")
    p.add_argument("--output", default="hf_trainer_out")
    args = p.parse_args()

    training = TrainingArguments(
        output_dir=args.output, per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(), torch_compile=args.compile, remove_unused_columns=False,
        ddp_find_unused_parameters=False,  # every parameter is used (the Trainer's default warns at every step)
        **(dict(fsdp=True, fsdp_config={"version": 2}) if args.fsdp else {}))
    options = {"ulysses_degree": args.ulysses_degree} if args.ulysses_degree else None
    trainer = ContextParallelTrainer(
        model=model_for(args), args=training, train_dataset=documents(args),
        data_collator=DataCollatorWithFlattening(),
        context_parallel_size=args.cp, cp_method=args.method, cp_options=options)   # the two extra arguments
    trainer.train()
    trainer.save_model(args.output)
    if torch.distributed.is_initialized():  # before exit: gloo's threads can otherwise abort a rank (SIGABRT)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
