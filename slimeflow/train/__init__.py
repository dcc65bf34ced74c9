"""The train library: slime's RL math (algorithms, advantages, loss, packing), the train step over one rollout, and
the training backends (backends/torch/, backends/megatron/). The train stage (slimeflow.stages.train) runs it in
its TrainActors."""
