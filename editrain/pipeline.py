"""Pipeline parallelism inside a replica: the model split into stages, and one rank's runner.

A replica of ``P`` pipeline stages holds its model in ``P`` pieces, one per rank of the
replica's pp group. :func:`stage_layers` says which blocks each stage holds (contiguous
runs, as even as possible); :class:`LlamaStage` is one stage of the built-in Llama over the
model's own parameter tensors (nothing is copied, and every parameter keeps the name it has
in the whole model), :class:`HFStage` the same for a Hugging Face Llama-family model
(:data:`HF_PIPELINE_TYPES`), and :func:`build_stage` picks one by the model's type;
:class:`PipelineRunner` drives one rank's stage through a
``torch.distributed.pipelining`` schedule (GPipe or 1F1B) so that a training step gives
every stage's parameters the gradients the unpipelined model's backward of the mean loss
over the whole batch gives.

With the sync engine: ``editrain.init_mesh(shard_size, pp_size=P)`` builds the
``("sync", "pp", "shard", "tp")`` mesh; each rank takes its stage
(``build_stage(model, info.stage, P)``), runs ``editrain.parallelize`` and ``editrain.edit``
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

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from editrain.errors import plain_count, plain_scalar, require, spelled
from editrain.models import Llama, causal_lm_loss
from editrain.models.hf import HFCausalLM
from editrain.safe_io import quote

__all__ = [
    "HF_PIPELINE_TYPES",
    "SCHEDULES",
    "HFStage",
    "LlamaStage",
    "PipelineRunner",
    "build_stage",
    "check_hf_pipeline",
    "check_microbatches",
    "pipeline_eval_loss",
    "stage_layers",
]

SCHEDULES: dict[str, str] = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                             "interleaved-1f1b": "ScheduleInterleaved1F1B"}
"""The schedules by the name ``dist.pp_schedule`` takes (-> their class in
``torch.distributed.pipelining``): GPipe runs every microbatch's forward, then every
backward (activations of all microbatches held at once); 1F1B starts backwards as soon as
the last stage has a loss (at most ``pp_size`` microbatches in flight) and needs at least
``pp_size`` microbatches; interleaved 1F1B runs ``V = dist.pp_stages_per_rank >= 2``
chunks of blocks on every rank (rank ``r`` holds chunks ``r, r + P, ...`` of ``P x V``),
so the pipeline's bubble shrinks ``V``-fold, and needs the microbatch count to be a
multiple of its rounds (``max(1, microbatches // P)``, torch's rule).
``torch.distributed.pipelining`` is imported only when a runner is
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
        ConfigError: (a ``ValueError``) ``pp_size`` is not an integer from 1 to
            ``n_layers`` (numpy integers are taken, as ``init_mesh`` takes them).
    """
    n_layers = plain_count(n_layers, "n_layers")
    pp_size = plain_count(pp_size, "dist.pp_size")
    require(pp_size <= n_layers, "dist.pp_size",
            f"must be at most the model's number of layers ({n_layers}): every stage "
            f"holds at least one block; got {pp_size}")
    base, extra = divmod(n_layers, pp_size)
    runs, start = [], 0
    for stage in range(pp_size):
        size = base + (1 if stage < extra else 0)
        runs.append(range(start, start + size))
        start += size
    return runs


def check_microbatches(batch_size: int, n_microbatches: int, schedule: str,
                       pp_size: int, stages_per_rank: int = 1, *,
                       accumulation: int = 1) -> None:
    """Check a pipeline's microbatch count against the batch and the schedule.

    Args:
        batch_size: the sequences one step of one replica takes (split into microbatches).
        n_microbatches: ``dist.pp_microbatches``.
        schedule: ``dist.pp_schedule``, a key of :data:`SCHEDULES`.
        pp_size: the number of pipeline ranks.
        stages_per_rank: ``dist.pp_stages_per_rank``, the chunks of blocks each rank holds
            (at least 2 for interleaved 1F1B, 1 for the others).
        accumulation: ``train.gradient_accumulation_steps``: the trainer runs a step's
            micro-batches through the schedule as one batch of ``accumulation x
            n_microbatches`` microbatches, the count interleaved 1F1B's rule applies to.

    Raises:
        ValueError: an unknown schedule, a microbatch count that is not a positive divisor
            of the batch size (numpy integers are taken, as the config takes them; a
            bool or float is refused as the config option refuses it), fewer microbatches
            than stages under 1F1B, a microbatch count interleaved 1F1B cannot split into
            rounds, or a ``stages_per_rank`` that does not suit the schedule.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"dist.pp_schedule must be one of {', '.join(SCHEDULES)}; "
                         f"got {spelled(schedule)}")
    n_microbatches = plain_count(n_microbatches, "dist.pp_microbatches")
    if batch_size % n_microbatches:
        raise ValueError(f"dist.pp_microbatches ({n_microbatches}) must divide the batch "
                         f"size ({batch_size}): every microbatch has the same number of "
                         f"sequences")
    if schedule == "1f1b" and n_microbatches < pp_size:
        raise ValueError(f"dist.pp_schedule = '1f1b' needs dist.pp_microbatches >= "
                         f"dist.pp_size ({pp_size}), got {n_microbatches}; use more "
                         f"microbatches or dist.pp_schedule = 'gpipe'")
    interleaved = schedule == "interleaved-1f1b"
    stages_per_rank = plain_scalar(stages_per_rank, int, "dist.pp_stages_per_rank")
    if interleaved:
        require(stages_per_rank >= 2, "dist.pp_stages_per_rank",
                f"must be >= 2 with dist.pp_schedule = 'interleaved-1f1b' (each rank holds "
                f"that many chunks of blocks), got {stages_per_rank}")
    else:
        plain_count(stages_per_rank, "dist.pp_stages_per_rank")
        if stages_per_rank != 1:
            raise ValueError(f"dist.pp_stages_per_rank = {stages_per_rank} needs "
                             f"dist.pp_schedule = 'interleaved-1f1b' (gpipe and 1f1b run "
                             f"one stage per rank: 1)")
    total = n_microbatches * accumulation
    rounds = max(1, total // pp_size)
    if interleaved and total % rounds:
        fits = [n for n in range(1, batch_size + 1) if batch_size % n == 0
                and (n * accumulation) % max(1, n * accumulation // pp_size) == 0]
        what = (f"train.gradient_accumulation_steps x dist.pp_microbatches = {accumulation} "
                f"x {n_microbatches} = {total}" if accumulation > 1 else
                f"dist.pp_microbatches = {n_microbatches}")
        raise ValueError(f"dist.pp_schedule = 'interleaved-1f1b' needs the microbatches of "
                         f"a step to be a multiple of its rounds, max(1, microbatches // "
                         f"dist.pp_size ({pp_size})) = {rounds}; got {what} (dist."
                         f"pp_microbatches that fit: {', '.join(map(str, fits))})")


class _Stage(nn.Module, ABC):
    """What every stage module has: its place in the pipeline, its blocks, and the shapes
    of one microbatch's input and output (for torch's ``PipelineStage``)."""

    def _place(self, n_layers: int, stage: int, pp_size: int, tied: bool,
               tied_option: str, stages_per_rank: int = 1) -> None:
        # The sizes come from Python callers (``build_stage(model, info.stage, P)``): numpy
        # integers are taken as init_mesh takes them, and stored as plain ints.
        v = plain_count(stages_per_rank, "dist.pp_stages_per_rank")
        pp_size = plain_count(pp_size, "dist.pp_size")
        if v > 1 and pp_size * v > n_layers:
            raise ValueError(f"dist.pp_size x dist.pp_stages_per_rank ({pp_size} x {v}) must "
                             f"be at most the model's number of layers ({n_layers}): every "
                             f"chunk holds at least one block")
        runs = stage_layers(n_layers, pp_size * v)
        stage = plain_scalar(stage, int, "stage")
        require(0 <= stage < pp_size, "stage",
                f"must be in [0, {pp_size - 1}] (dist.pp_size = {pp_size}), got {stage}")
        if tied and pp_size * v > 1:
            raise ValueError(f"dist.pp_size = {pp_size} needs untied embeddings "
                             f"({tied_option} = false): with tied embeddings the first and "
                             f"last stage would share the embedding matrix")
        self.stage = stage
        """This rank's place in the pp group, 0 to ``pp_size - 1``."""
        self.pp_size = pp_size
        self.stages_per_rank = v
        self.chunks = [stage + k * pp_size for k in range(v)]
        """The indices, among all ``pp_size x stages_per_rank`` stages, of the chunks this
        rank holds, in forward order (just ``[stage]`` without interleaving)."""
        self.chunk_layers = [runs[c] for c in self.chunks]
        self.is_first = stage == 0  # holds the embeddings (chunk 0 of the pipeline)
        self.is_last = stage == pp_size - 1  # holds the norm and head (its last chunk)
        self.layer_ids = [i for run in self.chunk_layers for i in run]
        self.block_ids = list(self.layer_ids)
        """The model's index of each of the stage's blocks: the engine names them
        ``block<index in the model>`` (:func:`editrain.sync.setup.unit_modules`)."""
        self.block_offset = self.layer_ids[0]
        """The model's index of the stage's first block."""
        self._chunk_modules: list[nn.Module] | None = None

    def _chunk_ends(self, chunk: int) -> tuple[bool, bool]:
        """Whether ``chunk`` is the pipeline's first (embeddings) and its last (head)."""
        chunk = plain_scalar(chunk, int, "chunk")
        require(0 <= chunk < self.stages_per_rank, "chunk",
                f"must be in [0, {self.stages_per_rank - 1}] (dist.pp_stages_per_rank = "
                f"{self.stages_per_rank}), got {chunk}")
        index = self.chunks[chunk]
        return index == 0, index == self.pp_size * self.stages_per_rank - 1

    @abstractmethod
    def _ends(self) -> tuple[nn.Module | None, list[nn.Module | None]]:
        """(the token embeddings, [the final norm, the head]) where this stage holds them."""

    def _chunk_parts(self, chunk: int) -> list[nn.Module]:
        """The modules of ``chunk``: embeddings, blocks, final norm and head, as it holds."""
        first, last = self._chunk_ends(chunk)
        embeddings, tail = self._ends()
        layers = self._layers()
        return (([embeddings] if first else [])
                + [layers[str(i)] for i in self.chunk_layers[chunk]]
                + ([m for m in tail if m is not None] if last else []))

    def _begin(self, x: Tensor, chunk: int) -> tuple[Tensor, bool]:
        """The input of ``chunk`` as hidden states (token ids ``[B, T]`` embedded on the
        pipeline's first chunk), and whether the chunk is the pipeline's last."""
        first, last = self._chunk_ends(chunk)
        if not first:
            return x, last
        if x.dim() != 2:
            raise ValueError(f"tokens must have shape [B, T], got {tuple(x.shape)}")
        return self._ends()[0](x), last

    def chunk_modules(self) -> list[nn.Module]:
        """One module per chunk (:attr:`chunks`), each owning exactly that chunk's
        parameters (what torch's ``PipelineStage`` scales and backpropagates through) and
        running ``self(x, chunk=k)``: every chunk's forward enters this module's forward,
        so forward pre-hooks on it (the sync engine's root unit) fire. They are not
        submodules: parameter names, ``parameters()`` and ``state_dict()`` stay the
        stage's."""
        if self._chunk_modules is None:
            self._chunk_modules = [_Chunk(self, k) for k in range(self.stages_per_rank)]
        return list(self._chunk_modules)

    hidden_size: int
    """The width of the residual stream that crosses stage boundaries."""
    vocab_size: int
    """The width of the last stage's logits."""

    def blocks(self) -> list[nn.Module]:
        """The stage's transformer blocks in forward order (a new list)."""
        return list(self._layers().values())

    @abstractmethod
    def _layers(self) -> nn.ModuleDict:
        """The stage's blocks, keyed by their index in the whole model."""

    def _dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def example_inputs(self, microbatch_size: int, seq_len: int,
                       dtype: torch.dtype | None = None, chunk: int = 0) -> Tensor:
        """A tensor shaped like one microbatch's input to this stage's ``chunk`` (on the
        meta device; an activation requires grad, see the module docstring), in ``dtype``:
        the activations' (under FSDP2's mixed precision the compute dtype; default the
        parameters')."""
        if self._chunk_ends(chunk)[0]:
            return torch.empty(microbatch_size, seq_len, dtype=torch.long, device="meta")
        return torch.empty(microbatch_size, seq_len, self.hidden_size,
                           dtype=dtype or self._dtype(), device="meta", requires_grad=True)

    def example_outputs(self, microbatch_size: int, seq_len: int,
                        dtype: torch.dtype | None = None, chunk: int = 0) -> Tensor:
        """A tensor shaped like one microbatch's output of this stage's ``chunk`` (meta
        device, requiring grad), in ``dtype`` (see :meth:`example_inputs`)."""
        width = self.vocab_size if self._chunk_ends(chunk)[1] else self.hidden_size
        return torch.empty(microbatch_size, seq_len, width, dtype=dtype or self._dtype(),
                           device="meta", requires_grad=True)


class _Chunk(nn.Module):
    """One chunk of an interleaved stage, for torch's ``PipelineStage``: it owns the
    chunk's modules (their parameters, nothing else) and its forward is the stage's
    ``forward(x, chunk=index)``. The stage is held outside the module tree."""

    def __init__(self, stage: _Stage, index: int) -> None:
        super().__init__()
        self.parts = nn.ModuleList(stage._chunk_parts(index))
        self.index = index
        self._stage = [stage]  # a list: not a submodule

    def forward(self, x: Tensor) -> Tensor:
        return self._stage[0](x, chunk=self.index)


class LlamaStage(_Stage):
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

    With ``stages_per_rank = V > 1`` (interleaved 1F1B) the model is split into
    ``pp_size x V`` chunks and this stage holds chunks ``stage, stage + pp_size, ...``
    (:attr:`chunks`); ``forward(x, chunk=k)`` runs its ``k``-th, and
    :meth:`chunk_modules` gives the modules torch's schedule drives.

    Args:
        model: the whole model (its modules are shared, not copied).
        stage: this stage's index (its rank in the pp group), 0 to ``pp_size - 1``.
        pp_size: the number of stages (pp ranks).
        stages_per_rank: the chunks each rank holds (``dist.pp_stages_per_rank``).

    Raises:
        ValueError: a bad ``pp_size``, ``stage`` or ``stages_per_rank``, or tied embeddings
            with ``pp_size > 1``.
    """

    def __init__(self, model: Llama, stage: int, pp_size: int,
                 stages_per_rank: int = 1) -> None:
        super().__init__()
        cfg = model.config
        self._place(cfg.n_layers, stage, pp_size, cfg.tie_embeddings,
                    "model.tie_embeddings", stages_per_rank)
        self.config = cfg
        self.hidden_size = cfg.dim
        self.vocab_size = cfg.vocab_size
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        # Keyed by the block's index in the whole model: parameter names stay the model's.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in self.layer_ids})
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last and not cfg.tie_embeddings else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def _layers(self) -> nn.ModuleDict:
        return self.layers

    def _ends(self) -> tuple[nn.Module | None, list[nn.Module | None]]:
        return self.tok_embeddings, [self.norm, self.output]

    def forward(self, x: Tensor, chunk: int = 0) -> Tensor:
        """Run the stage (its ``chunk``-th chunk with ``stages_per_rank > 1``).

        Args:
            x: token ids ``[B, T]`` (int64) on the first stage, else the residual stream
                ``[B, T, dim]`` the previous stage returned.
            chunk: which of the stage's chunks to run (0 without interleaving).

        Returns:
            The residual stream ``[B, T, dim]``, or on the last stage the logits
            ``[B, T, vocab]``.

        Raises:
            ValueError: the first stage's tokens are not 2-D or longer than max_seq_len.
        """
        h, last = self._begin(x, chunk)
        t = h.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len "
                             f"({self.config.max_seq_len})")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for i in self.chunk_layers[chunk]:
            h = self.layers[str(i)](h, cos, sin)
        if not last:
            return h
        h = self.norm(h)
        if self.output is None:  # one stage of a tied model: the whole model
            return nn.functional.linear(h, self.tok_embeddings.weight)
        return self.output(h)


HF_PIPELINE_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
"""The Hugging Face ``model_type`` values :class:`HFStage` splits (``model.embed_tokens``,
``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``; decoder layers called
with the causal mask, the rotary tables and the positions, as their own ``forward`` does).
Each is checked to give the whole model's logits in tests/test_pipeline.py."""


class HFStage(_Stage):
    """One pipeline stage of a Hugging Face Llama-family causal LM (:class:`HFCausalLM`
    over a ``model_type`` of :data:`HF_PIPELINE_TYPES`), over the model's own parameters.

    As :class:`LlamaStage`: the blocks of :func:`stage_layers`, the token embeddings on the
    first stage, the final norm and ``lm_head`` on the last, every module the model's own
    and under its name in the whole model (``hf.model.embed_tokens``,
    ``hf.model.layers.<index>``, ``hf.model.norm``, ``hf.lm_head``). Every stage holds the
    rotary embedding module (buffers only) and computes the position tables itself, and
    builds the attention mask the way the model's own forward does (a causal mask, or the
    sliding-window mask for the layers or models that use one) from its input's shape.

    The arguments and interleaving (``stages_per_rank > 1``) are :class:`LlamaStage`'s;
    it also refuses (ValueError) a ``model_type`` not in :data:`HF_PIPELINE_TYPES`, and
    tied embeddings are ``tie_word_embeddings``.
    """

    def __init__(self, model: HFCausalLM, stage: int, pp_size: int,
                 stages_per_rank: int = 1) -> None:
        super().__init__()
        cfg = model.config
        check_hf_pipeline(cfg.model_type)
        self._place(cfg.num_hidden_layers, stage, pp_size,
                    bool(getattr(cfg, "tie_word_embeddings", False)),
                    "tie_word_embeddings in model.hf_config", stages_per_rank)
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        inner = model.hf.model
        # The model's own module paths, holding only this stage's parts.
        self.hf = nn.Module()
        self.hf.model = nn.Module()
        self.hf.model.embed_tokens = inner.embed_tokens if self.is_first else None
        self.hf.model.layers = nn.ModuleDict({str(i): inner.layers[i]
                                              for i in self.layer_ids})
        self.hf.model.norm = inner.norm if self.is_last else None
        self.hf.model.rotary_emb = inner.rotary_emb
        self.hf.lm_head = model.hf.lm_head if self.is_last else None
        self._kinds = {i: _mask_kind(cfg, i) for i in self.layer_ids}

    def _layers(self) -> nn.ModuleDict:
        return self.hf.model.layers

    def _ends(self) -> tuple[nn.Module | None, list[nn.Module | None]]:
        return self.hf.model.embed_tokens, [self.hf.model.norm, self.hf.lm_head]

    def forward(self, x: Tensor, chunk: int = 0) -> Tensor:
        """Run the stage's ``chunk`` as :meth:`LlamaStage.forward` does: token ids on the
        first stage, else hidden states ``[B, T, hidden_size]``; returns hidden states,
        or on the last stage the logits ``[B, T, vocab_size]``."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        inner = self.hf.model
        layer_ids = self.chunk_layers[chunk]
        h, last = self._begin(x, chunk)
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        makers = {"full_attention": create_causal_mask,
                  "sliding_attention": create_sliding_window_causal_mask}
        masks = {kind: makers[kind](config=self.config, inputs_embeds=h, attention_mask=None,
                                    cache=None, position_ids=positions)
                 for kind in {self._kinds[i] for i in layer_ids}}
        rotary = inner.rotary_emb(h, position_ids=positions)
        for i in layer_ids:
            h = inner.layers[str(i)](h, attention_mask=masks[self._kinds[i]],
                                     position_embeddings=rotary, position_ids=positions,
                                     cache=None, use_cache=False)
        if not last:
            return h
        return self.hf.lm_head(inner.norm(h))


def _mask_kind(cfg: object, layer: int) -> str:
    """The attention mask block ``layer`` of a Hugging Face model reads, as the model's
    forward picks it: by ``config.layer_types`` where the model has them (Qwen2, Qwen3),
    the sliding window of a Mistral with ``sliding_window`` set, else the causal mask."""
    kinds = getattr(cfg, "layer_types", None)
    if kinds:
        return kinds[layer]
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def check_hf_pipeline(model_type: str) -> None:
    """Pipeline stages of a ``model.hf_config`` model need one of :data:`HF_PIPELINE_TYPES`.

    Raises:
        ValueError: naming the option and the types allowed.
    """
    if model_type not in HF_PIPELINE_TYPES:
        raise ValueError(f"dist.pp_size > 1 splits model.hf_config models of model_type "
                         f"{', '.join(HF_PIPELINE_TYPES)}; this config has "
                         f"model_type {quote(model_type)} (use dist.pp_size = 1)")


def build_stage(model: nn.Module, stage: int, pp_size: int,
                stages_per_rank: int = 1) -> LlamaStage | HFStage:
    """This rank's stage of ``model``: a :class:`LlamaStage` of the built-in Llama, an
    :class:`HFStage` of a Hugging Face model (:class:`HFCausalLM`).

    Raises:
        TypeError: another kind of model.
        ValueError: as the stage classes.
    """
    if isinstance(model, Llama):
        return LlamaStage(model, stage, pp_size, stages_per_rank)
    if isinstance(model, HFCausalLM):
        return HFStage(model, stage, pp_size, stages_per_rank)
    raise TypeError(f"pipeline stages split editrain's Llama or a Hugging Face model "
                    f"(HFCausalLM), got {type(model).__name__}")


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
        schedule: ``dist.pp_schedule``, a key of :data:`SCHEDULES`; ``interleaved-1f1b``
            takes a stage built with ``stages_per_rank >= 2`` and drives one torch
            ``PipelineStage`` per chunk (:meth:`LlamaStage.chunk_modules`).
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
        chunks = int(getattr(module, "stages_per_rank", 1))
        check_microbatches(batch_size, n_microbatches, schedule, module.pp_size, chunks)
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

        # One torch stage per chunk: without interleaving the stage module itself (with
        # FSDP2 torch then drives its gradient reduction), else each chunk's module.
        if chunks == 1:  # any stage module (its example methods take no chunk)
            parts = [(module, module.stage, (microbatch, seq_len, activation_dtype))]
        else:
            parts = [(part, module.chunks[k], (microbatch, seq_len, activation_dtype, k))
                     for k, part in enumerate(module.chunk_modules())]
        self.stages = [
            pipelining.PipelineStage(
                part, index, module.pp_size * chunks, torch.device(device),
                input_args=module.example_inputs(*shape),
                output_args=module.example_outputs(*shape), group=group)
            for part, index, shape in parts]
        self.stage = self.stages[0]
        self.schedule = getattr(pipelining, SCHEDULES[schedule])(
            self.stages if chunks > 1 else self.stage, n_microbatches, loss_fn=loss_fn,
            scale_grads=True)

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
            ``group``. With interleaved chunks each goes in turn (chunk ``i`` of the
            pipeline on rank ``i mod pp_size``).
        tokens: token ids ``[B, T]``.
        targets: target ids ``[B, T]``.
        group: the pp group (one rank per stage, in stage order); None: the default group.

    Returns:
        On the last stage ``causal_lm_loss(logits, targets)`` (a scalar), elsewhere None.
    """
    device = tokens.device
    b, t = tokens.shape
    size = module.pp_size
    chunks = module.chunks if hasattr(module, "chunks") else [module.stage]
    last = size * len(chunks) - 1

    def peer(index: int) -> int:  # the global rank holding chunk ``index`` of the pipeline
        return dist.get_global_rank(group, index % size) if group is not None else index % size

    h: Tensor | None = None
    for k, index in enumerate(chunks):
        if index == 0:
            h = module(tokens, chunk=k) if len(chunks) > 1 else module(tokens)
        else:
            h = torch.empty(b, t, module.hidden_size, dtype=torch.float32, device=device)
            dist.recv(h, src=peer(index - 1), group=group)
            h = module(h, chunk=k) if len(chunks) > 1 else module(h)
        if index != last:
            dist.send(h.float().contiguous(), dst=peer(index + 1), group=group)
    if not module.is_last:
        return None
    return causal_lm_loss(h, targets)
