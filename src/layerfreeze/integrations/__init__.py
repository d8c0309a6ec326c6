"""layerfreeze inside the training loops people already use.

* :mod:`layerfreeze.integrations.lightning` — :class:`~layerfreeze.integrations.lightning.LayerFreeze`, a
  Lightning ``Callback`` (extra ``pip install layerfreeze[lightning]``);
* :mod:`layerfreeze.integrations.hf` — :class:`~layerfreeze.integrations.hf.LayerFreezeCallback`, a
  ``transformers.TrainerCallback`` (extra ``pip install layerfreeze[hf]``);
* :mod:`layerfreeze.integrations.common` — what both share: the optimizer's state across a restore, the full
  param groups a framework expects in its checkpoint, the DDP wrapper rebuilt in place on a freeze or thaw, and the
  gradient-checkpointing boundary fix.

Neither framework is a dependency of layerfreeze: each module imports its framework when it is imported, and says
which extra to install when it is missing. An ``accelerate`` loop needs no integration: it uses the library API
(:class:`~layerfreeze.engine.Freezer`) directly, see the README.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise ImportError naming the extra that installs it.

    Raises:
        ImportError: ``module`` is not installed (``pip install layerfreeze[<extra>]``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"layerfreeze.integrations needs {module!r} ({exc}); install it with "
                          f"`pip install layerfreeze[{extra}]`") from None
