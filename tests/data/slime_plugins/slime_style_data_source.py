"""A data source and pg-loss reducers written against slime's API (slime.rollout.data_source.DataSource; the
reducer signature of slime's --custom-pg-loss-reducer-function-path)."""

import json
import os

import torch
from slime.rollout.data_source import DataSource
from slime.utils.types import Sample


class ListDataSource(DataSource):
    """The prompts of args.data_source_prompts (a --custom-config-path key) in order, round after round; groups given
    back are handed out first. Its position and buffer are saved as JSON under args.save/rollout/, as slime's
    RolloutDataSource saves its state there."""

    def __init__(self, args):
        self.args = args
        self.prompts = list(args.data_source_prompts)
        self.offset = 0
        self.group_index = 0
        self.buffer = []

    def get_samples(self, num_samples):
        groups = self.buffer[:num_samples]
        del self.buffer[:num_samples]
        n = self.args.n_samples_per_prompt
        while len(groups) < num_samples:
            prompt = self.prompts[self.offset % len(self.prompts)]
            self.offset += 1
            groups.append([Sample(group_index=self.group_index, index=self.group_index * n + i, prompt=prompt,
                                  label=prompt[-1]) for i in range(n)])
            self.group_index += 1
        return groups

    def add_samples(self, samples):
        self.buffer.extend(samples)

    def _path(self, root, rollout_id):
        return os.path.join(root, f"rollout/list_source_{rollout_id}.json")

    def save(self, rollout_id):
        path = self._path(self.args.save, rollout_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"offset": self.offset, "group_index": self.group_index,
                       "buffer": [[s.to_dict() for s in group] for group in self.buffer]}, f)

    def load(self, rollout_id=None):
        path = self._path(self.args.load, rollout_id)
        if not os.path.exists(path):
            return
        with open(path) as f:
            state = json.load(f)
        self.offset, self.group_index = state["offset"], state["group_index"]
        self.buffer = [[Sample.from_dict(s) for s in group] for group in state["buffer"]]

    def __len__(self):
        return len(self.prompts)


class NoSave(DataSource):
    """Forgets to define save and load (abstract): refused at start-up."""

    def __init__(self, args):
        pass

    def get_samples(self, num_samples):
        return []

    def add_samples(self, samples):
        pass

    def __len__(self):
        return 0


def sum_of_sample_mean(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """slime's default reduction, rewritten: each sample's masked mean, summed (per token: the masked sum)."""

    def reduce(x):
        parts = x.split(response_lengths, dim=0)
        if calculate_per_token_loss:
            return sum((x_i * m).sum() for x_i, m in zip(parts, loss_masks, strict=True))
        return sum((x_i * m).sum() / torch.clamp_min(m.sum(), 1) for x_i, m in zip(parts, loss_masks, strict=True))

    return reduce


DR_GRPO_CONSTANT = 4.0


def dr_grpo(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """Dr.GRPO: each sample's masked sum over a constant instead of its token count."""

    def reduce(x):
        parts = x.split(response_lengths, dim=0)
        return sum((x_i * m).sum() / DR_GRPO_CONSTANT for x_i, m in zip(parts, loss_masks, strict=True))

    return reduce
