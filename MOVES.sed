s/slimeflow\.stages\.rl\.slime_rollout_hooks\b/slimeflow.rollout.slime_rollout_hooks/g
s/slimeflow\.stages\.preprocess\.prepare\b/slimeflow.preprocess.prepare/g
s/slimeflow\.stages\.preprocess\.sources\b/slimeflow.preprocess.sources/g
s/slimeflow\.stages\.preprocess\.staging\b/slimeflow.preprocess.staging/g
s/slimeflow\.stages\.preprocess\.config\b/slimeflow.preprocess.config/g
s/slimeflow\.stages\.preprocess\.inline\b/slimeflow.preprocess.inline/g
s/slimeflow\.stages\.preprocess\.tokens\b/slimeflow.preprocess.tokens/g
s/slimeflow\.stages\.preprocess\.writer\b/slimeflow.preprocess.writer/g
s/slimeflow\.stages\.rl\.slime_plugins\b/slimeflow.rollout.slime_plugins/g
s/slimeflow\.stages\.rl\.rule_rewards\b/slimeflow.rollout.rule_rewards/g
s/slimeflow\.stages\.preprocess\.rows\b/slimeflow.preprocess.rows/g
s/slimeflow\.stages\.rl\.data_source\b/slimeflow.rollout.data_source/g
s/slimeflow\.stages\.rl\.math_grader\b/slimeflow.rollout.math_grader/g
s/slimeflow\.stages\.rl\.evaluation\b/slimeflow.rollout.evaluation/g
s/slimeflow\.stages\.rl\.raw_data\b/slimeflow.rollout.raw_data/g
s/slimeflow\.stages\.rl\.offload\b/slimeflow.offload/g
s/slimeflow\.stages\.rl\.rollout\b/slimeflow.rollout.rollout/g
s/slimeflow\.stages\.rl\.rewards\b/slimeflow.rollout.rewards/g
s/slimeflow\.stages\.rl\.answers\b/slimeflow.rollout.answers/g
s/slimeflow\.stages\.rl\.plugins\b/slimeflow.rollout.plugins/g
s/slimeflow\.stages\.rl\.filters\b/slimeflow.rollout.filters/g
s/slimeflow\.stages\.rl\.engine\b/slimeflow.engine/g
s/slimeflow\.stages\.rl\.config\b/slimeflow.config.train/g
s/slimeflow\.stages\.rl\.types\b/slimeflow.rollout.types/g
s#\bstages/rl/slime_rollout_hooks\.py#slimeflow/rollout/slime_rollout_hooks.py#g
s#\bstages/preprocess/prepare\.py#slimeflow/preprocess/prepare.py#g
s#\bstages/preprocess/sources\.py#slimeflow/preprocess/sources.py#g
s#\bstages/preprocess/staging\.py#slimeflow/preprocess/staging.py#g
s#\bstages/preprocess/config\.py#slimeflow/preprocess/config.py#g
s#\bstages/preprocess/inline\.py#slimeflow/preprocess/inline.py#g
s#\bstages/preprocess/tokens\.py#slimeflow/preprocess/tokens.py#g
s#\bstages/preprocess/writer\.py#slimeflow/preprocess/writer.py#g
s#\bstages/rl/slime_plugins\.py#slimeflow/rollout/slime_plugins.py#g
s#\bstages/rl/rule_rewards\.py#slimeflow/rollout/rule_rewards.py#g
s#\bstages/preprocess/rows\.py#slimeflow/preprocess/rows.py#g
s#\bstages/rl/data_source\.py#slimeflow/rollout/data_source.py#g
s#\bstages/rl/math_grader\.py#slimeflow/rollout/math_grader.py#g
s#\bstages/rl/evaluation\.py#slimeflow/rollout/evaluation.py#g
s#\bstages/rl/raw_data\.py#slimeflow/rollout/raw_data.py#g
s#\bstages/rl/offload\.py#slimeflow/offload.py#g
s#\bstages/rl/rollout\.py#slimeflow/rollout/rollout.py#g
s#\bstages/rl/rewards\.py#slimeflow/rollout/rewards.py#g
s#\bstages/rl/answers\.py#slimeflow/rollout/answers.py#g
s#\bstages/rl/plugins\.py#slimeflow/rollout/plugins.py#g
s#\bstages/rl/filters\.py#slimeflow/rollout/filters.py#g
s#\bstages/rl/config\.py#slimeflow/config/train.py#g
s#\bstages/rl/types\.py#slimeflow/rollout/types.py#g
s#\bstages/rl/engine/#slimeflow/engine/#g
s/from slimeflow\.stages\.rl import answers\b/from slimeflow.rollout import answers/g
s/from slimeflow\.stages\.rl\.actors import call$/from slimeflow.stages.rl.remote import call/g
s/from slimeflow\.stages\.rl\.actors import LoopError$/from slimeflow.stages.rl.remote import LoopError/g
s/from slimeflow\.stages\.rl\.actors import LoopError, call$/from slimeflow.stages.rl.remote import LoopError, call/g
s/from slimeflow\.stages\.rl\.backend\.torch_backend import rng_state, set_rng_state$/from slimeflow.stages.rl.backend.rng import rng_state, set_rng_state/g
s/from slimeflow\.rollout\.filters import load_group_filter$/from slimeflow.rollout.slime_plugins import load_group_filter/g
s/from slimeflow\.rollout\.slime_rollout_hooks import run_rollout_function$/from slimeflow.rollout.slime_rollout_functions import run_rollout_function/g
s/from slimeflow\.rollout\.slime_rollout_hooks import run_eval_function$/from slimeflow.rollout.slime_rollout_functions import run_eval_function/g
s/from slimeflow\.stages\.preprocess\.stage import \(MANIFEST, \)\?preprocess$/from slimeflow.preprocess.pipeline import \1preprocess/g
