"""Pipeline parallelism inside a replica: the Llama split into stages, and one rank's runner.

A replica of ``P`` pipeline stages holds its model in ``P`` pieces, one per rank of the
replica's pp group. :func:`stage_layers` says which blocks each stage holds (contiguous
runs, as even as possible); :class:`LlamaStage` is one stage of the built-in Llama over the
model's own parameter tensors (nothing is copied, and every parameter keeps the name it has
in the whole model); :class:`PipelineRunner` drives one rank's stage through a
``torch.distributed.pipelining`` schedule (GPipe or 1F1B) so that a training step gives
every stage's parameters the gradients the unpipelined model's backward of the mean loss
over the whole batch gives.

With the sync engine: ``editrain.init_mesh(shard_size, pp_size=P)`` builds the
``("sync", "pp", "shard", "tp")`` mesh; each rank takes its stage
(``LlamaStage(model, info.stage, P)``), runs ``editrain.parallelize`` and ``editrain.edit``
on it (the engine syncs the stage's own units with the same stage of every other replica,
and agrees A-EDiT's clock over every stage of its replica), and trains with
``PipelineRunner(stage, ..., group=info.pp_mesh.get_group())``. ``editrain train
--dist.pp_size P`` does all of this (:mod:`editrain.train`; docs/decisions.md, "Pipeline
parallelism"), and evaluates through :func:`pipeline_eval_loss`, which takes batches of
any shape (the validation split's last batch is smaller).

Stage boundaries carry one activation, the residual stream ``[microbatch, T, dim]``; the
first stage takes token ids, the last returns logits. The runner gives torch's
``PipelineStage`` example tensors of those shapes (static shapes: runtime shape inference
was seen to hang here), and the activation examples require grad (a later stage's input,
an earlier stage's output): torch builds the receive buffers and the gradients' metadata
from the examples, flags included. With examples that do not require grad the first stage
gets no gradient for its output and its backward fails ("grad can be implicitly created
only for scalar outputs"). The examples are on the meta device: the last stage's logits
example costs no memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from editrain.models import Llama, causal_lm_loss

__all__ = [
    "SCHEDULES",
    "LlamaStage",
    "PipelineRunner",
    "check_microbatches",
    "pipeline_eval_loss",
    "stage_layers",
]

SCHEDULES: dict[str, str] = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
"""The schedules by the name ``dist.pp_schedule`` takes (-> their class in
``torch.distributed.pipelining``): GPipe runs every microbatch's forward, then every
backward (activations of all microbatches held at once); 1F1B starts backwards as soon as
the last stage has a loss (at most ``pp_size`` microbatches in flight) and needs at least
``pp_size`` microbatches. ``torch.distributed.pipelining`` is imported only when a runner is
built: it imports torch's compiler stack (about 2.6 s, 90 modules), which every process
importing the trainer would otherwise pay (and a restarted ``--ft`` group's start with it)."""


def stage_layers(n_layers: int, pp_size: int) -> list[range]:
    """The blocks each pipeline stage holds: contiguous runs in forward order, as even as
    possible, the earlier stages holding one block more where the split is uneven.

    Args:
        n_layers: the model's number of transformer blocks.
        pp_size: the number of pipeline stages (``dist.pp_size``).

    Returns:
        ``pp_size`` ranges of block indices covering ``range(n_layers)`` in order, none empty.

    Raises:
        ValueError: ``pp_size`` is not an integer from 1 to ``n_layers``.
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
    if (isinstance(pp_size, bool) or not isinstance(pp_size, int)
            or not 1 <= pp_size <= n_layers):
        raise ValueError(f"dist.pp_size must be an integer from 1 to the model's number of "
                         f"layers ({n_layers}): every stage holds at least one block; "
                         f"got {pp_size!r}")
    base, extra = divmod(n_layers, pp_size)
    runs, start = [], 0
    for stage in range(pp_size):
        size = base + (1 if stage < extra else 0)
        runs.append(range(start, start + size))
        start += size
    return runs


def check_microbatches(batch_size: int, n_microbatches: int, schedule: str,
                       pp_size: int) -> None:
    """Check a pipeline's microbatch count against the batch and the schedule.

    Args:
        batch_size: the sequences one step of one replica takes (split into microbatches).
        n_microbatches: ``dist.pp_microbatches``.
        schedule: ``dist.pp_schedule``, a key of :data:`SCHEDULES`.
        pp_size: the number of pipeline stages.

    Raises:
        ValueError: an unknown schedule, a microbatch count that is not a positive divisor
            of the batch size, or fewer microbatches than stages under 1F1B.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"dist.pp_schedule must be one of {', '.join(SCHEDULES)}; "
                         f"got {schedule!r}")
    if (isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int)
            or n_microbatches < 1):
        raise ValueError(f"dist.pp_microbatches must be a positive integer, "
                         f"got {n_microbatches!r}")
    if batch_size % n_microbatches:
        raise ValueError(f"dist.pp_microbatches ({n_microbatches}) must divide the batch "
                         f"size ({batch_size}): every microbatch has the same number of "
                         f"sequences")
    if schedule == "1f1b" and n_microbatches < pp_size:
        raise ValueError(f"dist.pp_schedule = '1f1b' needs dist.pp_microbatches >= "
                         f"dist.pp_size ({pp_size}), got {n_microbatches}; use more "
                         f"microbatches or dist.pp_schedule = 'gpipe'")


class LlamaStage(nn.Module):
    """One pipeline stage of the built-in Llama, over the model's own parameters.

    The stage holds the blocks :func:`stage_layers` gives it; the first stage also the
    token embeddings, the last the final norm and the output head. The modules are the
    model's (no copy), registered under the names they have in the model
    (``layers.<index in the model>``, ``tok_embeddings``, ``norm``, ``output``), so the same
    initialisation gives the same parameters as the whole model and the stage's parameter
    names are the model's. The RoPE tables are the model's buffers too.

    Tied embeddings (the output head reading ``tok_embeddings.weight``) are refused for
    more than one stage: the first and last stage would each need the matrix and their
    gradients summed between them, which this split does not do.

    Args:
        model: the whole model (its modules are shared, not copied).
        stage: this stage's index, 0 to ``pp_size - 1``.
        pp_size: the number of stages.

    Raises:
        ValueError: a bad ``pp_size`` or ``stage``, or tied embeddings with ``pp_size > 1``.
    """

    def __init__(self, model: Llama, stage: int, pp_size: int) -> None:
        super().__init__()
        cfg = model.config
        runs = stage_layers(cfg.n_layers, pp_size)
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp_size:
            raise ValueError(f"stage must be an integer from 0 to {pp_size - 1} "
                             f"(dist.pp_size = {pp_size}), got {stage!r}")
        if cfg.tie_embeddings and pp_size > 1:
            raise ValueError(f"dist.pp_size = {pp_size} needs untied embeddings "
                             f"(model.tie_embeddings = false): with tied embeddings the "
                             f"first and last stage would share the embedding matrix")
        self.config = cfg
        self.stage = stage
        self.pp_size = pp_size
        self.is_first = stage == 0
        self.is_last = stage == pp_size - 1
        self.layer_ids = runs[stage]
        self.block_offset = self.layer_ids.start
        """The model's index of the stage's first block: the engine names the stage's
        blocks ``block<index in the model>`` (:func:`editrain.sync.setup.unit_modules`)."""
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        # Keyed by the block's index in the whole model: parameter names stay the model's.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in self.layer_ids})
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last and not cfg.tie_embeddings else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def blocks(self) -> list[nn.Module]:
        """The stage's transformer blocks in forward order (a new list)."""
        return list(self.layers.values())

    def forward(self, x: Tensor) -> Tensor:
        """Run the stage.

        Args:
            x: token ids ``[B, T]`` (int64) on the first stage, else the residual stream
                ``[B, T, dim]`` the previous stage returned.

        Returns:
            The residual stream ``[B, T, dim]``, or on the last stage the logits
            ``[B, T, vocab]``.

        Raises:
            ValueError: the first stage's tokens are not 2-D or longer than max_seq_len.
        """
        if self.is_first:
            if x.dim() != 2:
                raise ValueError(f"tokens must have shape [B, T], got {tuple(x.shape)}")
            h = self.tok_embeddings(x)
        else:
            h = x
        t = h.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len "
                             f"({self.config.max_seq_len})")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if not self.is_last:
            return h
        h = self.norm(h)
        if self.output is None:  # one stage of a tied model: the whole model
            return nn.functional.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    def _dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def example_inputs(self, microbatch_size: int, seq_len: int,
                       dtype: torch.dtype | None = None) -> Tensor:
        """A tensor shaped like one microbatch's input to this stage (on the meta device;
        an activation requires grad, see the module docstring), in ``dtype``: the
        activations' (under FSDP2's mixed precision the compute dtype; default the
        parameters')."""
        if self.is_first:
            return torch.empty(microbatch_size, seq_len, dtype=torch.long, device="meta")
        return torch.empty(microbatch_size, seq_len, self.config.dim,
                           dtype=dtype or self._dtype(), device="meta", requires_grad=True)

    def example_outputs(self, microbatch_size: int, seq_len: int,
                        dtype: torch.dtype | None = None) -> Tensor:
        """A tensor shaped like one microbatch's output of this stage (meta device,
        requiring grad), in ``dtype`` (see :meth:`example_inputs`)."""
        width = self.config.vocab_size if self.is_last else self.config.dim
        return torch.empty(microbatch_size, seq_len, width, dtype=dtype or self._dtype(),
                           device="meta", requires_grad=True)


class PipelineRunner:
    """One rank's pipeline stage and its schedule: a training step and an evaluation.

    The stage's index is this rank's rank in ``group`` (torch's pipelining maps stage
    ``i`` to group rank ``i``), and the group has one rank per stage.

    Losses: ``loss_fn(logits, targets)`` of each microbatch, a mean over its tokens
    (:func:`editrain.models.causal_lm_loss`), and the step's loss is their mean. Torch's
    schedule divides each microbatch's gradients by the number of microbatches, so the
    gradients are those of that mean. It equals the whole batch's mean loss (and the
    gradients the unpipelined model's) when every microbatch has the same number of
    counted targets, as with packed sequences; targets equal to ``ignore_index`` spread
    unevenly over microbatches weigh tokens of different microbatches differently.

    Args:
        module: this rank's stage (e.g. :class:`LlamaStage`), with ``stage``, ``pp_size``,
            ``is_first``, ``is_last``, ``example_inputs(mb, T, dtype)`` and
            ``example_outputs(mb, T, dtype)``.
        batch_size: the sequences of one step (the batch given to :meth:`train_step`).
        seq_len: their length.
        n_microbatches: ``dist.pp_microbatches``; divides ``batch_size``.
        schedule: ``dist.pp_schedule``, a key of :data:`SCHEDULES`.
        group: the pp group (one rank per stage, in stage order); None: the default group.
        device: where the stage computes; by default its parameters' device.
        activation_dtype: the dtype of the activations crossing stages and of the logits
            (torch builds its receive buffers from it): with FSDP2's mixed precision the
            compute dtype (bf16); None: the stage's parameters' dtype.
        loss_fn: the loss of one microbatch, ``loss_fn(logits, targets)``.

    Raises:
        ValueError: bad microbatches or schedule (:func:`check_microbatches`), or a group
            whose size or this rank's place in it does not match the stage.
    """

    def __init__(self, module: nn.Module, *, batch_size: int, seq_len: int,
                 n_microbatches: int, schedule: str = "1f1b",
                 group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 loss_fn: Callable[[Tensor, Tensor], Tensor] = causal_lm_loss,
                 activation_dtype: torch.dtype | None = None) -> None:
        check_microbatches(batch_size, n_microbatches, schedule, module.pp_size)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size != module.pp_size or rank != module.stage:
            raise ValueError(f"the pp group has {size} ranks and this is its rank {rank}, "
                             f"but the stage is stage {module.stage} of dist.pp_size = "
                             f"{module.pp_size}: stage i runs on rank i of a group of "
                             f"pp_size ranks")
        if device is None:
            device = next(module.parameters()).device
        self.module = module
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.n_microbatches = n_microbatches
        self.schedule_name = schedule
        microbatch = batch_size // n_microbatches
        from torch.distributed import pipelining  # deferred: see SCHEDULES

        self.stage = pipelining.PipelineStage(
            module, module.stage, module.pp_size, torch.device(device),
            input_args=module.example_inputs(microbatch, seq_len, activation_dtype),
            output_args=module.example_outputs(microbatch, seq_len, activation_dtype),
            group=group)
        self.schedule = getattr(pipelining, SCHEDULES[schedule])(
            self.stage, n_microbatches, loss_fn=loss_fn, scale_grads=True)

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (the one that has the losses)."""
        return bool(self.module.is_last)

    def _check(self, tokens: Tensor | None, targets: Tensor | None) -> None:
        if self.module.is_first:
            if tokens is None or tuple(tokens.shape) != (self.batch_size, self.seq_len):
                raise ValueError(f"the first stage needs tokens of shape "
                                 f"{(self.batch_size, self.seq_len)} (the runner's batch "
                                 f"size and sequence length), got "
                                 f"{None if tokens is None else tuple(tokens.shape)}")
        if self.module.is_last:
            if targets is None or tuple(targets.shape) != (self.batch_size, self.seq_len):
                raise ValueError(f"the last stage needs targets of shape "
                                 f"{(self.batch_size, self.seq_len)}, got "
                                 f"{None if targets is None else tuple(targets.shape)}")

    def train_step(self, tokens: Tensor | None, targets: Tensor | None) -> Tensor | None:
        """Forward and backward of one batch through the pipeline.

        Gradients are added to the stage's parameters' ``.grad`` (zero them before, as
        with a plain backward); they are those of the mean loss over the microbatches.
        Every rank of the pp group must call it together.

        Args:
            tokens: the batch's token ids ``[batch_size, seq_len]``; read on the first
                stage only (others may pass None).
            targets: the next-token ids, same shape; read on the last stage only.

        Returns:
            On the last stage the mean of the microbatches' losses (a detached scalar),
            elsewhere None.
        """
        return self._run(self.schedule.step, tokens, targets)

    @torch.no_grad()
    def eval_loss(self, tokens: Tensor | None, targets: Tensor | None) -> Tensor | None:
        """Forward only (no gradients, no autograd graph) of one batch: its loss.

        Same arguments and the same loss as :meth:`train_step`: on the last stage the mean
        over the microbatches of their mean losses (the batch's mean loss when the
        microbatches count as many targets), elsewhere None.
        """
        return self._run(self.schedule.eval, tokens, targets)

    def _run(self, run: Callable[..., object], tokens: Tensor | None,
             targets: Tensor | None) -> Tensor | None:
        """One batch through the schedule's ``step`` or ``eval``: the mean of the
        microbatches' losses on the last stage, None elsewhere."""
        self._check(tokens, targets)
        losses: list[Tensor] = []
        args = (tokens,) if self.module.is_first else ()
        run(*args, target=targets if self.module.is_last else None, losses=losses,
            return_outputs=False)
        if not self.module.is_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).mean()


@torch.no_grad()
def pipeline_eval_loss(module: nn.Module, tokens: Tensor, targets: Tensor,
                       group: dist.ProcessGroup | None = None) -> Tensor | None:
    """One batch of any shape forward through the pipeline, stage after stage (no
    schedule, no microbatches, no autograd): the batch's mean loss on the last stage.

    Every stage passes the same ``tokens`` and ``targets`` (the stages of a pipeline read
    the same batches; only their shapes matter to the stages in between): the shape of
    the residual stream each stage receives is known from them, so batches of any size and
    length go through, unlike :class:`PipelineRunner`'s fixed shapes. Activations cross
    stages in float32 with point-to-point sends over ``group`` (any backend).

    Args:
        module: this rank's stage (e.g. :class:`LlamaStage`); its index is its rank in
            ``group``.
        tokens: token ids ``[B, T]``.
        targets: target ids ``[B, T]``.
        group: the pp group (one rank per stage, in stage order); None: the default group.

    Returns:
        On the last stage ``causal_lm_loss(logits, targets)`` (a scalar), elsewhere None.
    """
    device = tokens.device
    b, t = tokens.shape
    if module.is_first:
        h = module(tokens)
    else:
        h = torch.empty(b, t, module.config.dim, dtype=torch.float32, device=device)
        dist.recv(h, src=dist.get_global_rank(group, module.stage - 1)
                  if group is not None else module.stage - 1, group=group)
        h = module(h)
    if not module.is_last:
        dst = module.stage + 1
        dist.send(h.float().contiguous(), dst=dist.get_global_rank(group, dst)
                  if group is not None else dst, group=group)
        return None
    return causal_lm_loss(h, targets)
