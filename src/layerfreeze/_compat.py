"""Old import paths, kept for one release (until 0.3): ``import layerfreeze.blocks`` and the like still work, with a
``DeprecationWarning`` naming the new place.

Before 0.2 the package had 29 modules side by side (``layerfreeze.blocks``, ``layerfreeze.trainer``, ...); they now
live in one folder per concept (``layerfreeze.models``, ``layerfreeze.train``, ...). :data:`MOVED` maps each old
module to where its names went: the first entry is the module it became, the others hold names it used to define
(``discover_blocks`` moved from ``blocks`` to ``models.discovery``). An old path with one place is the new module
itself (patching it patches the real one); one with several is a read-only view that looks names up in order.
``layerfreeze.oracle`` and ``layerfreeze.controlnet`` were benchmark code and moved out of the library, to
``benchmarks/``; they have no old path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

_P = "layerfreeze."

#: Old module -> the modules its names are in now (the first: the module it became).
MOVED: dict[str, tuple[str, ...]] = {
    "blocks": ("models.blocks", "models.discovery", "errors"),
    "forward_split": ("models.forward_split", "models.discovery"),
    "probe": ("models.probe",),
    "families": ("models.families", "models.registry"),
    "families.registry": ("models.registry",),
    **{f"families.{n}": (f"models.families.{n}",) for n in (
        "bert", "decoder_lm", "encoder_decoder", "generic", "hf_vision", "sequential", "timm_models",
        "torchvision_cnn", "torchvision_vit")},
    "optim": ("engine.optim",),
    "guard": ("engine.guard",),
    "integrity": ("engine.integrity",),
    "cache": ("compute.cache",),
    "store": ("compute.store",),
    "frozen": ("compute.frozen", "compute.precomputed"),
    "fsdp": ("distributed.fsdp", "checkpoint"),
    "rundir": ("runs.rundir",),
    "telemetry": ("runs.telemetry", "runs.summary"),
    "measure": ("runs.measure",),
    "report": ("runs.report",),
    "report.read": ("runs.report.read",),
    "report.plots": ("runs.report.plots",),
    "report.pages": ("runs.report.pages",),
    "compare": ("train.compare", "runs.compare_table"),
    "config": ("train.config", "errors"),
    "train_setup": ("train.setup",),
    "tasks": ("train.tasks", "train.loaders"),
    "lm": ("train.lm", "train.loaders"),
    "data": ("train.data",),
    "assets": ("train.assets", "errors"),
    "loop": ("train.loop",),
    "evaluation": ("train.evaluation",),
    "trainer": ("train.trainer",),
    "strategies.egeria_reference": ("strategies.egeria.reference",),
    "smartfrz.recorder": ("strategies.smartfrz.recorder",),
    "smartfrz.features": ("strategies.smartfrz.features",),
    "smartfrz.predictor": ("strategies.smartfrz.predictor", "errors"),
}


def _warn(old: str, targets: tuple[str, ...]) -> None:
    where = _P + targets[0] + (f" (and {', '.join(_P + t for t in targets[1:])})" if len(targets) > 1 else "")
    warnings.warn(f"{_P}{old} moved to {where}; the old path works until layerfreeze 0.3", DeprecationWarning,
                  stacklevel=3)


class _View(types.ModuleType):
    """An old module whose names are now in several modules: attribute lookups go to each in order."""

    def __init__(self, name: str, modules: list[types.ModuleType]) -> None:
        super().__init__(name, modules[0].__doc__)
        self._modules = modules
        # ``from old import *``: every module's star names, as the old module gave them before it was split
        self.__all__ = sorted({n for m in modules for n in getattr(m, "__all__", None)
                               or [n for n in vars(m) if not n.startswith("_")]})

    def __getattr__(self, attr: str) -> Any:
        for module in self._modules:
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")

    def __dir__(self) -> list[str]:
        return sorted({n for m in self._modules for n in dir(m)})


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the old module paths of :data:`MOVED`, and the modules under an old package path
    (``layerfreeze.report.plots`` -> ``layerfreeze.runs.report.plots``).

    It stands first on ``sys.meta_path`` and answers only old names (no module of the package has one), so a
    sub-module of a moved package is never loaded a second time under its old name by the ordinary path finder.
    """

    @staticmethod
    def targets(fullname: str) -> tuple[str, ...] | None:
        """The new module(s) behind an old name, or None for a name that did not move."""
        if not fullname.startswith(_P):
            return None
        old = fullname.removeprefix(_P)
        if old in MOVED:
            return MOVED[old]
        parts = old.split(".")
        for i in range(len(parts) - 1, 0, -1):  # under a moved package: the same path under its new place
            parent = ".".join(parts[:i])
            if parent in MOVED:
                return (".".join([MOVED[parent][0], *parts[i:]]),)
        return None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        targets = self.targets(fullname)
        if targets is None:
            return None
        try:  # only a name whose new module exists is answered (else the usual "No module named ...")
            if importlib.util.find_spec(_P + targets[0]) is None:
                return None
        except ModuleNotFoundError:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=False)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        targets = self.targets(spec.name)
        _warn(spec.name.removeprefix(_P), targets)
        modules = [importlib.import_module(_P + t) for t in targets]
        return modules[0] if len(modules) == 1 else _View(spec.name, modules)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is the new one, or a view of the new ones."""


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())
