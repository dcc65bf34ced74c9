"""slime's Megatron flags (model shape, parallelism, recompute): read by convert and by both training backends,
so it lives beside the stages' configs rather than inside one of them. `TrainConfig.megatron` is this group.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from slimeflow.config.base import ConfigModel, OptionalPositiveInt, PositiveInt


class MegatronConfig(ConfigModel):
    """Megatron parallelism and model-shape flags (slime's MODEL_ARGS); checked against the HF config."""

    tensor_model_parallel_size: PositiveInt = 1
    """Tensor parallel size."""
    pipeline_model_parallel_size: PositiveInt = 1
    """Pipeline parallel size."""
    context_parallel_size: PositiveInt = 1
    """Context parallel size."""
    expert_model_parallel_size: PositiveInt = 1
    """Expert parallel size."""
    expert_tensor_parallel_size: OptionalPositiveInt = None
    """Expert tensor parallel size (None: the tensor parallel size, as Megatron-LM's default)."""
    num_layers_per_virtual_pipeline_stage: OptionalPositiveInt = None
    """Layers per virtual pipeline stage: the interleaved 1F1B schedule, num_layers / (PP x this) model chunks per
    pipeline rank (None: one chunk, plain 1F1B)."""
    sequence_parallel: bool = False
    """Sequence parallelism (with tensor parallelism)."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recomputation granularity."""
    recompute_method: Literal["uniform", "block"] | None = None
    """Activation recomputation method."""
    recompute_num_layers: OptionalPositiveInt = None
    """Layers per recomputation unit."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state over the data-parallel ranks (megatron's DistributedOptimizer)."""
    num_layers: OptionalPositiveInt = None
    """Transformer layers."""
    hidden_size: OptionalPositiveInt = None
    """Hidden size."""
    ffn_hidden_size: OptionalPositiveInt = None
    """MLP intermediate size."""
    num_attention_heads: OptionalPositiveInt = None
    """Attention heads."""
    group_query_attention: bool = False
    """Grouped-query attention."""
    num_query_groups: OptionalPositiveInt = None
    """KV heads with group_query_attention."""
    kv_channels: OptionalPositiveInt = None
    """Head dimension."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Normalisation layer."""
    norm_epsilon: float | None = Field(None, gt=0)
    """Normalisation epsilon."""
    swiglu: bool = False
    """SwiGLU MLP."""
    disable_bias_linear: bool = False
    """No bias in linear layers."""
    add_qkv_bias: bool = False
    """Bias on QKV (Qwen2)."""
    qk_layernorm: bool = False
    """Norm on q and k (Qwen3)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer."""
    position_embedding_type: Literal["rope", "learned_absolute", "none"] = "rope"
    """Position embedding."""
    use_rotary_position_embeddings: bool = False
    """Rotary embeddings (Megatron's older spelling of position_embedding_type rope)."""
    rotary_base: float | None = Field(None, gt=0)
    """RoPE theta."""
    rotary_percent: float = Field(1.0, gt=0, le=1)
    """Fraction of the head dimension that is rotated."""
    vocab_size: OptionalPositiveInt = None
    """True vocabulary size (before padding)."""
    make_vocab_size_divisible_by: PositiveInt = 128
    """Pad the vocabulary to a multiple of this times the tensor parallel size."""
    seq_length: OptionalPositiveInt = None
    """Sequence length."""
    max_position_embeddings: OptionalPositiveInt = None
    """Maximum positions."""
    attention_dropout: float = Field(0.0, ge=0, lt=1)
    """Attention dropout."""
    hidden_dropout: float = Field(0.0, ge=0, lt=1)
    """Hidden dropout."""
    # Mixture of experts and multi-latent attention (slime's Qwen3-MoE, DeepSeek-V3, GLM-4.5 scripts); checked
    # against the HF config like the fields above (slimeflow/config/model_args.py).
    num_experts: OptionalPositiveInt = None
    """Routed experts per MoE layer."""
    moe_ffn_hidden_size: OptionalPositiveInt = None
    """Each expert's MLP intermediate size."""
    moe_router_topk: OptionalPositiveInt = None
    """Experts per token."""
    moe_layer_freq: str | None = None
    """Which layers are MoE layers: an integer N (every N-th) or a list such as [0]*3+[1]*58 (0: dense)."""
    moe_shared_expert_intermediate_size: OptionalPositiveInt = None
    """Shared experts' MLP intermediate size."""
    moe_router_score_function: Literal["softmax", "sigmoid"] | None = None
    """Router score."""
    moe_router_pre_softmax: bool = False
    """Score all experts before the top-k."""
    moe_router_enable_expert_bias: bool = False
    """Expert-score correction bias (sigmoid routers)."""
    moe_router_num_groups: OptionalPositiveInt = None
    """Expert groups for group-limited routing."""
    moe_router_group_topk: OptionalPositiveInt = None
    """Groups chosen per token."""
    moe_router_topk_scaling_factor: float | None = Field(None, gt=0)
    """Routed experts' weight scale."""
    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek)."""
    q_lora_rank: OptionalPositiveInt = None
    """MLA query LoRA rank."""
    kv_lora_rank: OptionalPositiveInt = None
    """MLA key/value LoRA rank."""
    qk_head_dim: OptionalPositiveInt = None
    """MLA query/key head part without RoPE."""
    qk_pos_emb_head_dim: OptionalPositiveInt = None
    """MLA query/key head part with RoPE."""
    v_head_dim: OptionalPositiveInt = None
    """MLA value head dimension."""
    rotary_scaling_factor: float | None = Field(None, gt=0)
    """YaRN RoPE scaling factor (1: none)."""
    mscale: float | None = Field(None, gt=0)
    """YaRN mscale."""
    mscale_all_dim: float | None = Field(None, ge=0)
    """YaRN mscale_all_dim."""
    # MoE runtime flags (how experts are fed and trained, not their shape): read by the Megatron backend only.
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "allgather"
    """How tokens reach the experts of other expert-parallel ranks."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"] = \
        "aux_loss"
    """The router's load-balancing loss (weighted by --moe-aux-loss-coeff; 0 leaves it out)."""
    moe_aux_loss_coeff: float = Field(0.0, ge=0)
    """Weight of the load-balancing loss."""
    moe_z_loss_coeff: float | None = Field(None, ge=0)
    """Weight of the routers' z-loss (ST-MoE: their logits' squared log-sum-exp; None leaves it out)."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """Precision of the router's scores (None: the model's dtype)."""
    moe_router_bias_update_rate: float = Field(1e-3, ge=0)
    """Step of the expert-score correction bias update (--moe-router-enable-expert-bias)."""
    moe_grouped_gemm: bool = False
    """Experts as one grouped GEMM (Transformer Engine / CUTLASS on GPUs)."""
    moe_permute_fusion: bool = False
    """Fused token permutation (Transformer Engine, GPUs)."""

    # Precision and kernels (Megatron-LM's flags that slime's scripts pass): read by the Megatron backend only, as
    # megatron-core's TransformerConfig / DDP config fields (slimeflow/train/backends/megatron/kernels.py).
    attention_softmax_in_fp32: bool = False
    """Attention softmax in fp32 under --bf16 (TransformerConfig's; torch's fused attention, the CPU path, always
    computes it in fp32)."""
    accumulate_allreduce_grads_in_fp32: bool = False
    """Under --bf16, accumulate and reduce gradients in fp32 buffers (bf16 ones otherwise)."""
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = "auto"
    """Attention kernel: Transformer Engine's flash, fused (cuDNN) or unfused attention (auto: TE picks); without TE,
    torch's fused attention (flash or auto only)."""
    no_rope_fusion: bool = False
    """Do not fuse the rotary embedding (fused: Transformer Engine's kernel, GPUs)."""
    no_masked_softmax_fusion: bool = False
    """Do not fuse scale, mask and softmax (fused: a CUDA kernel)."""
    no_gradient_accumulation_fusion: bool = False
    """Do not fuse the weight-gradient GEMM with its accumulation into main_grad (fused: Transformer Engine)."""

    # Determinism and the optimizer's memory (Megatron-LM's flags that slime's scripts pass): read by the Megatron
    # backend only, as megatron-core's TransformerConfig / OptimizerConfig fields; what needs a GPU or Transformer
    # Engine is refused at start where they are missing (slimeflow/train/backends/megatron/kernels.py).
    deterministic_mode: bool = False
    """megatron-core's deterministic code paths and torch.use_deterministic_algorithms for the trainers' lifetime;
    on GPUs also deterministic NCCL, cuBLAS and Transformer Engine attention (their environment variables)."""
    use_precision_aware_optimizer: bool = False
    """megatron-core's precision-aware optimizer (Transformer Engine's FusedAdam keeps the main parameters; with
    --optimizer-cpu-offload the hybrid optimizer); needs --use-distributed-optimizer, a GPU and Transformer Engine."""
    optimizer_cpu_offload: bool = False
    """Step (part of) the optimizer on the host: megatron-core's HybridDeviceOptimizer, its Adam state in host memory
    (GPUs only; needs --use-precision-aware-optimizer, as Megatron-LM)."""
    optimizer_offload_fraction: float = Field(1.0, ge=0, le=1)
    """With --optimizer-cpu-offload: the fraction of the parameters (by element count) stepped on the host."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """With --optimizer-cpu-offload: copy gradients to the host and parameters back on their own CUDA streams,
    one host optimizer per parameter, overlapping the copies with the host's Adam steps."""

    @model_validator(mode="after")
    def _check_recompute(self) -> MegatronConfig:
        """megatron-core's rules for the recompute flags, at parse time: full recomputation names its method and
        unit, selective neither; neither without a granularity (it would be ignored)."""
        granularity, method, layers = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        problems = []
        if granularity == "full" and (method is None or layers is None):
            problems.append("--recompute-granularity full needs --recompute-method (uniform or block) and "
                            "--recompute-num-layers N (layers per recomputed unit, or recomputed per pipeline stage)")
        if granularity != "full" and (method is not None or layers is not None):
            given = " and ".join(flag for flag, value in (("--recompute-method", method),
                                                          ("--recompute-num-layers", layers)) if value is not None)
            problems.append(f"{given} without --recompute-granularity full: they choose which layers full "
                            "recomputation recomputes" + ("; selective recomputation recomputes the core attention "
                                                          "of every layer" if granularity else "")
                            + f"; add --recompute-granularity full or drop {given}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _check_optimizer_offload(self) -> MegatronConfig:
        """Megatron-LM's rule (the hybrid optimizer runs the precision-aware optimizer's code path), and the offload
        options only with the offload they tune (they would be ignored)."""
        problems = []
        if self.optimizer_cpu_offload and not self.use_precision_aware_optimizer:
            problems.append("--optimizer-cpu-offload needs --use-precision-aware-optimizer (Megatron-LM's rule: the "
                            "hybrid device optimizer runs that optimizer's code path); add it")
        if not self.optimizer_cpu_offload:
            given = [flag for flag, value in (("--optimizer-offload-fraction", self.optimizer_offload_fraction != 1.0),
                                              ("--overlap-cpu-optimizer-d2h-h2d", self.overlap_cpu_optimizer_d2h_h2d))
                     if value]
            if given:
                problems.append(f"{' and '.join(given)} without --optimizer-cpu-offload: they tune the host optimizer "
                                f"that flag turns on; add --optimizer-cpu-offload or drop {' and '.join(given)}")
        if problems:
            raise ValueError("; ".join(problems))
        return self
