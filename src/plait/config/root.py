"""The root of a run's configuration: :class:`Config`, one section per concern, and the
checks of the sections against each other (:meth:`Config.validate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.config.data import DataConfig
from plait.config.launch import LaunchConfig
from plait.config.log import LogConfig
from plait.config.lora import LoraConfig
from plait.config.model import ModelConfig
from plait.config.optim import OptimConfig
from plait.config.parallel import ParallelConfig
from plait.config.precision import PrecisionConfig
from plait.config.rules.activation_offload import check_activation_offload
from plait.config.rules.features import (
    check_compression,
    check_document_mask,
    check_generation_layout,
    check_offload,
    check_optimizer,
    check_sample_length,
)
from plait.config.rules.layout import (
    check_batch,
    check_cp_sequence,
    check_expert_parallel,
    check_pipeline,
    check_shard_size,
    check_sp_under_cp,
    check_ulysses_heads,
    check_world,
)
from plait.config.rules.model import check_moe_aux_scope, check_seq_len, check_tokenizer_vocab
from plait.config.train import TrainConfig


@dataclass
class Config:
    """A whole run: one section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The built-in transformer's shape."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation and evaluation."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Muon's and Adafactor's hyper-parameters (train.optimizer picks one)."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Mixed precision and loss scaling."""
    data: DataConfig = field(default_factory=DataConfig)
    """The corpus and tokenizer."""
    log: LogConfig = field(default_factory=LogConfig)
    """Metrics and progress."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Local process start-up."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters on a frozen base (off unless lora.rank is set)."""

    def validate(self, world_size: int) -> None:
        """Check the sections against each other for a world of ``world_size`` ranks.

        Raises :class:`ConfigError` with one paragraph saying what is wrong and what
        would work. Runs before any process starts and needs no torch; each rule is a
        function of :mod:`plait.config.rules`. A run also needs the parallel layer's
        checks (tensor-parallel divisibility, the pipeline schedule, the device's
        dtypes): :func:`plait.parallel.checks.validate_run` runs this and then those,
        once per process.
        """
        p, t, m = self.parallel, self.train, self.model
        dp = p.resolved_dp(world_size)
        check_world(dp, p.tp, p.pp, p.cp, world_size)
        if p.cp > 1:
            check_cp_sequence(t.seq_len, p.cp, p.cp_attention)
            if p.cp_attention == "ulysses":
                check_ulysses_heads(m.n_heads, p.tp, p.cp)
            if p.sequence_parallel:
                check_sp_under_cp(t.seq_len, p.cp, p.tp, p.cp_attention)
        if p.pp > 1:
            m_pp = self.pipeline_microbatches(world_size)
            check_pipeline(
                m.n_layers,
                p.pp,
                p.chunks,
                p.pipeline_schedule,
                m_pp,
                t.global_batch,
                dp,
                t.micro_batch,
            )
        # ZeRO shards over dp x cp (the ranks that hold the same parameters)
        check_shard_size(p.zero_shard_size, p.zero, dp * p.cp)
        check_offload(p.offload, p.zero)
        check_compression(
            p.compression,
            p.zero,
            self.precision.dtype,
            self.precision.reduce_dtype,
            p.compression_adam,
            self.precision.nonfinite,
        )
        check_optimizer(t.optimizer, p.tp, p.ep, p.offload, p.compression, p.compression_adam)
        offload = t.activation_offload
        check_activation_offload(offload, t.activation_offload_blocks, m.n_layers, p.pp)
        check_batch(t.global_batch, dp, self.micro_batch(world_size))
        check_seq_len(t.seq_len, m.max_seq_len)
        check_tokenizer_vocab(self.data.tokenizer, m.vocab_size)
        check_expert_parallel(p.ep, dp, p.cp, m.moe_experts, p.compression)
        check_moe_aux_scope(m.moe_aux_loss_scope, m.moe_aux_loss_coef, m.moe_experts, p.pp)
        if self.log.sample_every:
            check_generation_layout(
                p.pp, p.cp, p.tp, p.sequence_parallel, m.family, m.factory, "log.sample_every"
            )
            prompt = len(self.log.sample_prompt.encode("utf-8"))
            check_sample_length(prompt, self.log.sample_tokens, m.max_seq_len)
        if self.data.mask_documents:
            check_document_mask(p.pp, m.family, m.factory, self.data.restart_positions)

    def micro_batch(self, world_size: int) -> int:
        """Per-rank micro-batch (sequences) with the default applied (pp > 1: the per-rank
        batch divided into the pipeline micro-batches)."""
        if self.train.micro_batch is not None:
            return self.train.micro_batch
        dp = self.parallel.resolved_dp(world_size)
        if self.parallel.pp > 1:
            return max(1, self.train.global_batch // dp // self.pipeline_microbatches(world_size))
        return max(1, self.train.global_batch // dp)

    def pipeline_microbatches(self, world_size: int) -> int:
        """Pipeline micro-batches per step and dp rank (see ``parallel.microbatches``)."""
        p = self.parallel
        if p.microbatches is not None:
            return p.microbatches
        if self.train.micro_batch is not None:
            dp = p.resolved_dp(world_size)
            return max(1, self.train.global_batch // (dp * self.train.micro_batch))
        return 2 * p.pp

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-steps per optimizer step: global_batch / (dp · micro_batch)."""
        dp = self.parallel.resolved_dp(world_size)
        return self.train.global_batch // (dp * self.micro_batch(world_size))
