"""The rollout library the train and evaluate stages share: Sample and TrainBatch, the data source and buffer,
the rollout function, rewards (rule-based, remote, custom), dynamic-sampling filters, eval sets, slime's plug-in
contracts, and raw data sets preprocessed in place (docs/rl-api.md). It drives the engine library over HTTP."""
