# Flags from the seeds that slimeflow does not take: the async buffer (slime-skill-en.md, Workflow 2), the
# multi-turn example's custom --max-turns, and older spellings (slime-quickstart-zh.md, "Multiturn").
--rollout-batch-size 8
--num-rollout 10
--async-buffer-size 4
--update-weights-interval 2
--max-turns 5
--prompt-key question
--rollout-generate-func-path your_module.multiturn_logic:generate
--reward-fn-path your_module.multiturn_logic:reward_func
