"""The train stage: slime's loop on Ray (loop.py, async_loop.py), its actors and placement, advantages, losses,
packing, the training backends (torch, megatron-core) and weight sync. Sample, rollout and rewards are the
rollout library's (slimeflow/rollout/), the engine the engine library's (slimeflow/engine/)."""
