# slime's scripts/models/qwen3-4B.sh MODEL_ARGS (the Megatron model shape a slime user sources), with the
# required batch flags of a run script.
--swiglu
--num-layers 36
--hidden-size 2560
--ffn-hidden-size 9728
--num-attention-heads 32
--group-query-attention
--num-query-groups 8
--use-rotary-position-embeddings
--disable-bias-linear
--normalization "RMSNorm"
--norm-epsilon 1e-6
--rotary-base 1000000
--vocab-size 151936
--kv-channels 128
--qk-layernorm
--rollout-batch-size 8
--num-rollout 10
