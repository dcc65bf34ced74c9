# Flags from the seeds that slimeflow does not take: the multi-turn example's custom --max-turns, and older
# spellings (slime-quickstart-zh.md, "Multiturn").
--rollout-batch-size 8
--num-rollout 10
--update-weights-interval 2
--max-turns 5
--prompt-key question
--rollout-generate-func-path your_module.multiturn_logic:generate
--reward-fn-path your_module.multiturn_logic:reward_func
