"""slime's --megatron-config-path: a YAML of per-role Megatron overrides, read into the train config.

slime's format (slime/utils/arguments.py, parse_megatron_role_args): a top-level `megatron` list of entries
`{name, role: actor | critic, overrides: {flag: value}}` (`args:` is accepted for `overrides:`), at most one per
role. The actor entry's overrides replace the command line's values for the actor (slime deep-copies its args and
sets them on the copy); slimeflow has one train config, so they replace them for the run: keys are slime's flag
names (snake or kebab), each taken exactly as the flag would be, a flag slimeflow refuses is refused by name with
its reason. A critic entry needs a critic, which slimeflow does not train (--use-critic is refused).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from slimeflow.config.flags import nest_keys
from slimeflow.errors import ConfigError

GPU_ALLOCATION = ("num_nodes", "num_gpus_per_node")
"""Keys slime skips in a role entry (its GPU allocation always follows the command line)."""


def actor_overrides(path: str, index: Any) -> dict[str, Any]:
    """The actor entry's overrides of the YAML at `path`, nested as the train config's groups (`index`: its
    FlagIndex). Raises ConfigError naming the file and every key or entry it cannot take."""
    where = f"--megatron-config-path {path}"
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except OSError as err:
        raise ConfigError([f"{where}: cannot read it: {err}"]) from None
    except yaml.YAMLError as err:
        raise ConfigError([f"{where}: not YAML: {err}"]) from None
    entries = raw.get("megatron") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError([f"{where}: it needs a top-level 'megatron' list of role entries, e.g. megatron: [{{name: "
                           "default, role: actor, overrides: {lr: 1.0e-6}}] (slime's format)"])
    problems = []
    roles = [e.get("role") for e in entries]
    for role in sorted({str(r) for r in roles}):
        if roles.count(role) > 1:
            problems.append(f"{roles.count(role)} entries with role {role}: give at most one per role")
    if "critic" in roles:
        problems.append("role critic: slimeflow trains no critic (--use-critic is not supported yet); remove the entry")
    problems += [f"role {r!r}: slime's roles are actor and critic" for r in roles if r not in ("actor", "critic")]
    actor = next((e for e in entries if e.get("role") == "actor"), {})
    overrides = actor.get("overrides") or actor.get("args") or {}
    if not isinstance(overrides, dict):
        problems.append(f"role actor: overrides must be a mapping of flags, got {overrides!r}")
        overrides = {}
    problems += [f"role actor: {key}: the GPU allocation follows the command line (slime skips this key too); "
                 "remove it" for key in overrides if str(key).replace("-", "_") in GPU_ALLOCATION]
    if "megatron_config_path" in {str(k).replace("-", "_") for k in overrides}:
        problems.append("role actor: megatron_config_path: a config cannot name another one")
    if problems:
        raise ConfigError([f"{where}: {p}" for p in problems])
    return nest_keys(overrides, index, f"{where}: role actor")
