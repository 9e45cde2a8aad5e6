"""``ContextParallelTrainer``: transformers' ``Trainer`` with seqpar's context-parallel attention.

The world of ``W`` processes (torchrun or ``accelerate launch``; gloo on CPU, NCCL on GPUs) is a
``(dp, cp)`` device mesh, ``cp = context_parallel_size`` ranks per sequence and ``dp = W / cp``
data-parallel groups. What changes against the plain Trainer, and why the result is the same:

- **Data.** The Trainer's DataLoader is sharded over the ``dp`` groups instead of the ``W`` ranks:
  every rank of a context-parallel group loads the same batch (``per_device_train_batch_size``
  sequences per group), group ``g`` takes the batches ``g, g + dp, ...`` of the one sampler: a single
  process with ``dp`` times the batch sees the same examples in each optimizer step.
- **Inputs.** Each batch is packed into documents (``batches.pack_batch``: the position ids of
  ``DataCollatorWithFlattening``, rows, or right padding) and this rank's shard is taken with
  :func:`~seqpar.integrations.hf.shard_inputs`; the model's attention was converted over the ``cp``
  axis by :func:`~seqpar.integrations.parallelize.parallelize` (USP's groups built once).
- **Loss.** Every rank computes the cross-entropy *sum* of its own tokens and divides it by the
  global label count of the optimizer step (all micro-batches, all groups: one all-reduce per step),
  so the per-rank values add up to the global token mean. See :meth:`ContextParallelTrainer.compute_loss`
  for the factor that makes DDP's and FSDP2's averaging give sums, and the logged loss the global mean.
- **Wrapping.** Without ``fsdp``, the Trainer's own DDP (accelerate's) over all ``W`` ranks: the
  context-parallel ranks of a sequence hold the same weights and their gradients must be summed.
  With ``fsdp=True, fsdp_config={"version": 2}``, seqpar's :func:`~seqpar.integrations.parallelize.parallelize`
  shards the model with FSDP2 over the ``dp x cp`` ranks (gradient sums), on CPU as on GPUs
  (accelerate applies FSDP only to GPUs; it is kept out of the model here), and ``save_model``
  gathers the full state dict.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from ...methods import method as declared_method
from ..hf import IGNORE_INDEX, context_parallel_loss, shard_inputs
from ..hf.convert import _attention_options
from ..parallelize import parallelize
from .batches import agree_eval_loss, agree_label_count, count_labels, pack_batch
from .checkpoints import (check_layout, check_unsharded, commit, load_sharded, save_layout, save_sharded,
                          staging_dir)

__all__ = ["ContextParallelTrainer"]


def _check_arguments(context_parallel_size, cp_method, cp_options) -> dict:
    """Local validation of the three extra arguments (before any communication)."""
    if isinstance(context_parallel_size, bool) or not isinstance(context_parallel_size, int) \
            or context_parallel_size < 1:
        raise ValueError(f"context_parallel_size: expected an int >= 1 (ranks that share one sequence), got "
                         f"{context_parallel_size!r}")
    declared_method(cp_method, argument="cp_method", kind="softmax")
    options = dict(cp_options or {})
    allowed = _attention_options()
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"cp_options: unknown {', '.join(unknown)}; seqpar.attention takes {', '.join(allowed)} "
                         "here (e.g. cp_options={'ulysses_degree': 2} with cp_method='usp')")
    return options


def _check_training_arguments(args: TrainingArguments, cp: int) -> None:
    """What the context-parallel trainer cannot honour, refused the same way on every rank."""
    world = args.world_size  # initialises torch.distributed from the launcher's environment
    if world % cp:
        raise ValueError(f"context_parallel_size: {cp} does not divide the world of {world} processes; launch "
                         f"a multiple of {cp} processes (torchrun --nproc-per-node) or choose a divisor of {world}")
    fsdp_version = int((args.fsdp_config or {}).get("version", 1)) if args.fsdp else None
    refusals = {
        "fsdp_config": fsdp_version == 1 and "FSDP1 is not supported; pass fsdp_config={'version': 2}",
        "fp16": fsdp_version == 2 and args.fp16 and "FSDP2 here runs bf16 (bf16=True) or fp32, without a loss scaler",
        "activation_checkpointing": fsdp_version == 2 and args.activation_checkpointing and
        (args.fsdp_config or {}).get("activation_checkpointing") and
        "set both ways (fsdp_config['activation_checkpointing'] too); keep one",
        "load_best_model_at_end": fsdp_version == 2 and args.load_best_model_at_end and args.save_only_model and
        "under FSDP2 the best model is loaded from its checkpoint's shards, which save_only_model=True leaves out; "
        "set save_only_model=False",
        "deepspeed": args.deepspeed is not None and "DeepSpeed is not supported; use fsdp with version 2",
        "parallelism_config": args.parallelism_config is not None and
        "accelerate's parallelism_config would apply its own context or sequence parallelism; leave it unset",
        "label_smoothing_factor": args.label_smoothing_factor != 0 and
        "label smoothing is not supported; set it to 0",
        "train_sampling_strategy": args.train_sampling_strategy == "batch_rebalance" and cp > 1 and
        "'batch_rebalance' deals batches per rank, not per context-parallel group; use 'random' or 'group_by_length'",
        "n_gpu": args.n_gpu > 1 and "one process drives several GPUs (DataParallel); launch one process per GPU",
    }
    for name, why in refusals.items():
        if why:
            raise ValueError(f"{name}: {why} (ContextParallelTrainer)")


def _take_fsdp(args: TrainingArguments):
    """The FSDP2 request of ``args`` as :func:`parallelize` options, and a copy of ``args`` without it
    (accelerate must not shard the model a second time, nor put DDP around it)."""
    if not args.fsdp:
        return None, args
    config = args.fsdp_config or {}
    # fsdp_config's activation_checkpointing: parallelize's per-layer checkpointing; the training argument
    # (with its kwargs: use_reentrant, every_n_layers, offload) stays the Trainer's, as without FSDP
    options = {"reshard_after_forward": bool(config.get("reshard_after_forward", True)),
               "checkpointing": "layer" if config.get("activation_checkpointing") else "none",
               "compile": bool(args.torch_compile), "dtype": torch.bfloat16 if args.bf16 else None}
    args = copy.copy(args)
    args.fsdp, args.fsdp_plugin_args, args.torch_compile = False, None, False
    return options, args


def _counted(collate, features):
    """A collated batch with its number of examples (the plain Trainer weighs evaluation losses by it)."""
    return len(features), collate(features)


class _Sharded(torch.nn.Module):
    """The FSDP2-sharded model as the Trainer's ``model_wrapped`` (forward and parameters are the model's)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class ContextParallelTrainer(Trainer):
    """transformers' ``Trainer``, with each sequence split over ``context_parallel_size`` ranks.

    Used exactly like ``Trainer`` (same arguments, ``train()``, ``save_model()``, logging), plus:

    Args:
        context_parallel_size: ranks that share one sequence (``cp``); the ``W / cp`` groups are data
            parallel. Must divide the world size. 1 = plain data parallelism through the same code.
        cp_method: a softmax method of ``seqpar.METHODS`` (``"zigzag_ring"``, ``"ulysses"``, ``"usp"``, ...).
        cp_options: ``seqpar.attention`` options for every layer, e.g. ``{"ulysses_degree": 2}`` with
            ``"usp"``, ``{"backend": ...}``.

    Batches: ``DataCollatorWithFlattening`` (documents never attend to each other), dense rows, or
    right padding with an attention mask (packed here; left padding is refused). Shapes: a batch of
    ``T_total`` tokens gives each rank ``T_local = T_total / cp`` (plus the method's padding). Weight
    updates and the logged ``loss`` equal a single-process ``Trainer`` whose batch is ``dp`` times
    larger (the global token mean); DDP (the default) and FSDP2 (``fsdp=True``,
    ``fsdp_config={"version": 2}``; ``bf16=True`` is its mixed precision) both work, with gradient
    accumulation, ``torch_compile=True``, ``gradient_checkpointing`` and ``bf16``; ``save_model`` writes the
    full model; checkpoints (``save_strategy``) are atomic and resumable (:mod:`.checkpoints`).
    ``evaluate()`` gives the loss (as the plain Trainer weighs it); ``predict()`` and
    ``compute_metrics`` need gathered logits and are refused when ``context_parallel_size > 1``.
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, *rest, context_parallel_size: int = 1,
                 cp_method: str = "zigzag_ring", cp_options: dict | None = None, **kwargs):
        options = _check_arguments(context_parallel_size, cp_method, cp_options)
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        _check_training_arguments(args, context_parallel_size)
        self.context_parallel_size = context_parallel_size
        self.cp_method = cp_method
        self.cp_options = options
        self.fsdp_options, args = _take_fsdp(args)
        super().__init__(model, args, *rest, **kwargs)
        if self.compute_loss_func is not None:  # local, the same on every rank
            raise ValueError("compute_loss_func: a custom loss would see this rank's shard only; the context-parallel "
                             "trainer computes the token cross-entropy itself (ContextParallelTrainer)")
        # compute_loss normalises by the label count of the whole accumulation window itself
        self.loss_is_scaled_for_ga = True
        self.cp_mesh = self._build_mesh()
        self.model = self._convert(self.model)
        self.model_wrapped = self.model
        self.cp_group = self.model.seqpar_cp_group

    # ------------------------------------------------------------------------- set-up

    def _build_mesh(self):
        """The ``(dp, cp)`` DeviceMesh over the world (None in a single process)."""
        world = self.args.world_size
        if world == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if self.args.device.type == "cuda" else "cpu"
        return init_device_mesh(device, (world // self.context_parallel_size, self.context_parallel_size),
                                mesh_dim_names=("dp", "cp"))

    def _convert(self, model):
        """Context-parallel attention over the mesh's cp axis (USP's groups built once), and FSDP2 when asked."""
        fsdp = self.fsdp_options or {}
        return parallelize(model, self.cp_mesh, cp_method=self.cp_method, fsdp=bool(fsdp),
                           checkpointing=fsdp.get("checkpointing", "none"), compile=fsdp.get("compile", False),
                           dtype=fsdp.get("dtype"), reshard_after_forward=fsdp.get("reshard_after_forward", True),
                           **self.cp_options)

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        return self._convert(model) if hasattr(self, "cp_mesh") else model  # __init__ converts the first one

    def _wrap_model(self, model, training=True, dataloader=None):
        """FSDP2 (sharded by :meth:`_convert`): hand the Trainer a distinct wrapper object, so that it
        prepares only the optimizer with accelerate and no DDP is put around the sharded model."""
        if self.fsdp_options and training:
            return model if isinstance(model, _Sharded) else _Sharded(model)
        return super()._wrap_model(model, training, dataloader)

    def save_model(self, output_dir=None, _internal_call=False):
        """The full model (``from_pretrained`` loads it); under FSDP2 every rank joins the gather of
        the full state dict and the first one writes it."""
        if not self.fsdp_options:
            return super().save_model(output_dir, _internal_call)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state)

    # ------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model, trial):
        """The plain Trainer's checkpoint, written to ``.tmp-checkpoint-N`` and renamed to ``checkpoint-N``
        when complete (:mod:`.checkpoints`); under FSDP2 with the model's and optimizer's shards in DCP."""
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        run_dir = self._get_output_dir(trial=trial)
        final = Path(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        staging = staging_dir(final, writer=self.args.should_save)
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        self.save_model(str(staging), _internal_call=True)
        best = self.state.best_global_step
        if best and self.args.save_strategy in ("steps", "epoch", "best"):
            best_dir = Path(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
            if best_dir.exists() or best == self.state.global_step:
                self.state.best_model_checkpoint = str(best_dir)
        if not self.args.save_only_model:
            self._save_optimizer_and_scheduler(str(staging))
            self._save_scaler(str(staging))
            self._save_rng_state(str(staging))
        if self.args.should_save:
            for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
                saved = self.state.stateful_callbacks[type(cb).__name__]
                if isinstance(saved, list):
                    saved.append(cb.state())
                else:
                    self.state.stateful_callbacks[type(cb).__name__] = cb.state()
            self.state.save_to_json(str(staging / "trainer_state.json"))
            save_layout(staging, **self._layout(), fsdp=bool(self.fsdp_options))
        commit(staging, final, writer=self.args.should_save)
        if self.args.push_to_hub:
            self._push_from_checkpoint(str(final))
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _save_optimizer_and_scheduler(self, output_dir):
        """Under FSDP2 every rank writes its optimizer (and model) shards; the first writes the scheduler."""
        if not self.fsdp_options:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_sharded(output_dir, self.model, self.optimizer)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Under FSDP2 the model's shards come from the checkpoint's DCP files; without, a checkpoint
        saved under FSDP2 is refused (:func:`.checkpoints.check_unsharded`), and one saved with another
        number of sequences per micro-batch (:func:`.checkpoints.check_layout`; with ``ignore_data_skip`` the
        data starts again from the beginning, and any batch size may follow)."""
        if not self.args.ignore_data_skip:
            check_layout(resume_from_checkpoint, **self._layout(), auto_batch=self.args.auto_find_batch_size,
                         grouped=self.args.train_sampling_strategy == "group_by_length")
        if not self.fsdp_options:
            check_unsharded(resume_from_checkpoint)
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_sharded(resume_from_checkpoint, self.model)

    def _layout(self) -> dict:
        return dict(world=self.args.world_size, cp=self.context_parallel_size, batch=self._train_batch_size,
                    accumulation=self.args.gradient_accumulation_steps)

    def _load_best_model(self):
        if not self.fsdp_options:
            return super()._load_best_model()
        load_sharded(self.state.best_model_checkpoint, self.model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if not self.fsdp_options or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_sharded(checkpoint, self.model, self.optimizer)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))

    @property
    def data_parallel_size(self) -> int:
        """Groups that train on different batches: ``world_size / context_parallel_size``."""
        return self.args.world_size // self.context_parallel_size

    def get_cp_size(self) -> int:
        """The ranks that share one batch (the Trainer divides its world by this for its batch sizes)."""
        return self.context_parallel_size

    # ------------------------------------------------------------------------- data

    def _shard_over_groups(self, dataloader):
        """Re-point accelerate's per-rank sharding of ``dataloader`` at the data-parallel groups."""
        if self.args.world_size == 1:
            return dataloader
        from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

        dp = self.data_parallel_size
        dp_rank = self.args.process_index // self.context_parallel_size  # the mesh is (dp, cp), cp fastest
        for shard in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "sampler", None),
                      getattr(dataloader, "dataset", None)):
            if isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
                if shard.split_batches and shard.batch_size % dp:
                    raise ValueError(f"per_device_train_batch_size: split_batches needs a batch size divisible by "
                                     f"the {dp} data-parallel groups, got {shard.batch_size}")
                shard.num_processes, shard.process_index = dp, dp_rank
                return dataloader
        raise ValueError(f"train_dataset: accelerate prepared a {type(dataloader).__name__} that the context-parallel "
                         "trainer cannot deal per group (dispatch_batches, or a datasets.IterableDataset split by "
                         "shards); pass a map-style dataset or set accelerator_config={'dispatch_batches': False}")

    def get_train_dataloader(self):
        return self._shard_over_groups(super().get_train_dataloader())

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The next ``num_batches`` micro-batches, packed, and the label count of all of them over the
        data-parallel groups (every rank raises if any rank's batch was refused)."""
        packed, count, error = [], 0, None
        for _ in range(num_batches):
            try:
                batch = next(epoch_iterator)
            except StopIteration:
                break
            try:
                batch = pack_batch(batch)
                count += count_labels(batch)
            except ValueError as exc:
                error = error or str(exc)
            packed.append(batch)
        total = agree_label_count(count, error, world=self.args.world_size, cp=self.context_parallel_size,
                                  across_dp=self.args.average_tokens_across_devices, device=self.args.device)
        return packed, torch.tensor(float(total), device=self.args.device)

    def _track_num_input_tokens(self, inputs):
        """The Trainer sums every rank's tokens; the ranks of a context-parallel group hold the same batch."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        seen = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + seen // self.context_parallel_size

    # ------------------------------------------------------------------------- loss

    def _loss_scale(self) -> int:
        """The factor between this rank's share and what it back-propagates (and reports).

        A rank's share is ``c_r = (its token-loss sum) / N`` with ``N`` the label count of the step's
        whole batch (``average_tokens_across_devices``, the default) or of its group's batch. The
        single-process gradient is ``sum_r grad(c_r)`` (global counts) or ``(1/dp) sum_r grad(c_r)``
        (the Trainer's mean over data-parallel devices, per-group counts). DDP *averages* gradients
        over the ``W`` ranks, so a rank back-propagates ``W * c_r`` (resp. ``W/dp = cp``) and the
        average is exactly that sum. FSDP2 from :func:`parallelize` sums instead: there the gradient is
        taken of ``c_r`` (resp. ``c_r / dp``) and only the value keeps the factor. The factor makes the
        Trainer's logged loss right: it averages the ``W`` ranks' returned values,
        ``(1/W) sum_r W c_r`` = the global token mean (or the mean of the groups' token means).
        """
        return self.args.world_size if self.args.average_tokens_across_devices else self.context_parallel_size

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This rank's loss on its shard of ``inputs`` (a batch, packed here if it is not yet).

        Training: ``scale * (sum of this rank's token cross-entropies) / num_items_in_batch``
        (:meth:`_loss_scale`; ``num_items_in_batch`` from :meth:`get_batch_samples`). Evaluation
        (``context_parallel_size=1``; the model in eval mode): the batch's token mean.
        Outputs hold this rank's logits ``[1, T_local, V]`` only.
        """
        packed = pack_batch(inputs)
        shard = shard_inputs(packed["input_ids"], labels=packed["labels"], position_ids=packed["position_ids"],
                             cu_seqlens=packed["cu_seqlens"], group=self.cp_group, method=self.cp_method)
        outputs = model(**shard.model_kwargs())
        logits = outputs.logits
        if num_items_in_batch is None or not model.training:  # evaluation: the Trainer's count shifts rows,
            loss = context_parallel_loss(logits, shard.labels, group=self.cp_group)  # not documents: recount
        else:
            local = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shard.labels.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction="sum")
            count = torch.as_tensor(num_items_in_batch, dtype=local.dtype, device=local.device).clamp(min=1)
            loss = local * self._loss_scale() / count
            if self.fsdp_options:  # parallelize's FSDP2 sums the gradients: back-propagate the share itself
                share = loss / self.args.world_size
                loss = share + (loss - share).detach()
        return (loss, outputs) if return_outputs else loss

    def predict(self, *args, **kwargs):
        if self.context_parallel_size > 1:
            raise ValueError("predict: under context parallelism each rank holds a shard of the logits, so "
                             "predictions are not gathered; use evaluate() for the loss, or context_parallel_size=1")
        return super().predict(*args, **kwargs)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """``evaluate()`` under context parallelism: the loss only, as the plain Trainer weighs it.

        Batch ``i`` of the eval set (``per_device_eval_batch_size``, in order) goes to data-parallel
        group ``i mod dp``; its loss is the group's token mean (:func:`context_parallel_loss`), and
        ``eval_loss = sum(n_i * loss_i) / sum(n_i)`` over the whole set, ``n_i`` the batch's examples
        (one all-reduce): the plain Trainer's weighting. Metrics on predictions are refused (each
        rank holds a shard of the logits)."""
        if self.context_parallel_size == 1:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                           metric_key_prefix)
        from torch.utils.data import DataLoader
        from transformers.trainer_utils import EvalLoopOutput

        if self.compute_metrics is not None:
            raise ValueError("compute_metrics: under context parallelism each rank holds a shard of the logits; "
                             "evaluate the loss only (no compute_metrics), or use context_parallel_size=1")
        dataset = getattr(dataloader.dataset, "dataset", dataloader.dataset)  # accelerate's IterableDatasetShard
        plain = DataLoader(dataset, batch_size=self.args.eval_batch_size, drop_last=self.args.dataloader_drop_last,
                           collate_fn=functools.partial(_counted, dataloader.collate_fn))
        dp, dp_rank = self.data_parallel_size, self.args.process_index // self.context_parallel_size
        weighted, rows, error, samples = 0.0, 0, None, 0
        self.model.eval()
        with torch.no_grad():
            for i, (n, batch) in enumerate(plain):
                samples += n
                if i % dp != dp_rank:
                    continue
                try:
                    packed = self._prepare_inputs(pack_batch(batch))
                except ValueError as exc:
                    error = error or str(exc)
                    continue
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(self.model, packed)
                weighted, rows = weighted + float(loss) * n, rows + n
        total = agree_eval_loss(weighted, rows, error, world=self.args.world_size, cp=self.context_parallel_size,
                                device=self.args.device)
        return EvalLoopOutput(predictions=None, label_ids=None, metrics={f"{metric_key_prefix}_loss": total},
                              num_samples=samples)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation (``context_parallel_size=1``): the batch is packed on every rank first, and a
        refusal raises on every rank."""
        packed, error = inputs, None
        try:
            packed = pack_batch(inputs)
        except ValueError as exc:
            error = str(exc)
        agree_label_count(0, error, world=self.args.world_size, cp=1, across_dp=False, device=self.args.device)
        return super().prediction_step(model, packed, prediction_loss_only, ignore_keys)
