"""slime's plug-in API, for plug-ins written against slime, with slimeflow installed and slime not installed.

Its module tree mirrors slime's paths (`slimeflow.slime_compat.utils.types` is `slime.utils.types`). `install()`
appends an import hook at the END of sys.meta_path that answers `import slime.X` with this package's `X`, so a real
slime that is importable is always found first and wins. The plug-in loader installs it before importing a plug-in
(inside Ray actors too); call it yourself in your own tests of a slime plug-in.

Only the modules in PROVIDED are answered; importing another `slime.*` module raises an ImportError that says so.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

PROVIDED = (
    "slime",
    "slime.utils",
    "slime.utils.types",
    "slime.utils.http_utils",
    "slime.utils.misc",
    "slime.utils.async_utils",
    "slime.utils.ppo_utils",
    "slime.utils.data",
    "slime.utils.eval_config",
    "slime.utils.mask_utils",
    "slime.rollout",
    "slime.rollout.base_types",
    "slime.rollout.sglang_rollout",
    "slime.rollout.sft_rollout",
    "slime.rollout.sample_hooks",
    "slime.rollout.fully_async_rollout",
    "slime.rollout.data_source",
    "slime.rollout.filter_hub",
    "slime.rollout.filter_hub.base_types",
    "slime.rollout.filter_hub.dynamic_sampling_filters",
    "slime.rollout.rm_hub",
    "slime.rollout.rm_hub.math_utils",
    "slime.rollout.rm_hub.math_dapo_utils",
    "slime.rollout.rm_hub.deepscaler",
    "slime.rollout.rm_hub.f1",
    "slime.rollout.rm_hub.gpqa",
    "slime.backends",
    "slime.backends.sglang_utils",
    "slime.backends.sglang_utils.external",
    "slime.backends.megatron_utils",
    "slime.backends.megatron_utils.loss",
)
"""The slime modules slimeflow provides (what slime's plug-ins import)."""


class _SlimeAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `slime.X` with `slimeflow.slime_compat.X` (the same module object, so classes are shared)."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "slime" and not fullname.startswith("slime."):
            return None
        if fullname not in PROVIDED:
            raise ImportError(
                f"No module named {fullname!r}: slime is not installed, and slimeflow's slime compatibility layer "
                f"provides only {', '.join(PROVIDED[1:])}; install slime, or import the equivalent from slimeflow "
                "(see docs/coming-from-slime.md, 'Your plug-ins')", name=fullname)
        target_name = "slimeflow.slime_compat" + fullname[len("slime"):]
        module = importlib.import_module(target_name)
        is_package = hasattr(module, "__path__")
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        if spec.name == "slime":
            # Every provided submodule is registered under its slime name now: the path finder, which runs before
            # this hook, would otherwise load `slime.utils` from our package's folder a second time (other classes).
            for name in PROVIDED[1:]:
                sys.modules.setdefault(name, importlib.import_module("slimeflow.slime_compat" + name[len("slime"):]))
        return importlib.import_module("slimeflow.slime_compat" + spec.name[len("slime"):])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was imported under its own name."""


_FINDER = _SlimeAlias()


def install() -> None:
    """Make `import slime...` work where no real slime is importable (idempotent)."""
    if not any(isinstance(finder, _SlimeAlias) for finder in sys.meta_path):
        sys.meta_path.append(_FINDER)


def uninstall() -> None:
    """Remove the hook (the `slime` modules already imported stay in sys.modules)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _SlimeAlias)]
