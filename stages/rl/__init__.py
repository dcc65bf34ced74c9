"""The RL core: Sample and TrainBatch, the data source and buffer, rewards, dynamic sampling, advantages, losses
and packing, as plain torch/Python (docs/rl-api.md). The train stage's engines and backends build on it."""
