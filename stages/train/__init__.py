"""The train stage: slime's loop on Ray (loop.py, async_loop.py), its actors (rollout_manager.py, train_actor.py) and
their placement, the engines with their health checks and weight sync, and the debug-rollout files. The RL math and
the training backends are the train library's (slimeflow/train/), Sample, rollout and rewards the rollout library's
(slimeflow/rollout/), the engine the engine library's (slimeflow/engine/)."""
