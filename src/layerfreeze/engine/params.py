"""The blocks' parameter lists, walked once and kept until a module's structure changes (a per-step path without
Python walks of ``block.parameters()``).

Every step the engine needs some blocks' parameters (the gradient signal sums the trainable blocks' gradients; the
integrity check looks at the frozen ones). Walking ``block.parameters()`` (``named_parameters`` of each module,
recursively, with a set against duplicates) costs a few microseconds per block, every step: on a GPU, where a step of
a small model takes milliseconds and the host must run ahead of the device, that is the engine's overhead. The walks
are kept here instead and done again only when the structure may have changed.

What counts as a change: torch's global registration hooks
(``torch.nn.modules.module.register_module_parameter_registration_hook`` and the module and buffer ones) fire whenever
any module registers a parameter, a submodule or a buffer (``module.weight = nn.Parameter(...)``, ``block[0] =
nn.Linear(...)``, ``register_parameter``); each bumps :func:`structure_version`, and a list taken at another version is
walked again. What the hooks do not see: ``del module.weight``, ``register_parameter(name, None)`` and writes into
``module._parameters`` directly (FSDP2 swaps its sharded and unsharded parameters that way, which is why the Freezer
walks every time on a sharded model: :class:`BlockParams` with ``cache=False``). The hooks are installed once per
process, when the first :class:`BlockParams` is made (importing layerfreeze installs nothing); they only count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module

from layerfreeze.models.blocks import Block

#: ``[version]``: bumped by torch's global registration hooks (:func:`structure_version`).
_VERSION = [0]
_HOOKS: list[Any] = []


def _bump(*args: Any) -> None:
    _VERSION[0] += 1


def install_hooks() -> None:
    """Install the three global registration hooks that bump :func:`structure_version` (once per process)."""
    if not _HOOKS:
        _HOOKS.extend([torch_module.register_module_parameter_registration_hook(_bump),
                       torch_module.register_module_module_registration_hook(_bump),
                       torch_module.register_module_buffer_registration_hook(_bump)])


def structure_version() -> int:
    """A counter that changes whenever any module of the process registers a parameter, a submodule or a buffer
    (after :func:`install_hooks`): equal values mean no such registration happened in between."""
    return _VERSION[0]


class BlockParams:
    """Each block's parameters (``list(block.parameters())``), walked once per :func:`structure_version`.

    Args:
        blocks: The Freezer's blocks.
        cache: False walks the blocks on every call (a model sharded with FSDP2, which swaps parameters without the
            registration hooks).
    """

    def __init__(self, blocks: Sequence[Block], cache: bool = True) -> None:
        self.blocks = blocks
        self.cache = cache
        self._version = -1
        self._lists: list[list[nn.Parameter] | None] = [None] * len(blocks)
        if cache:
            install_hooks()

    def _fresh(self) -> None:
        if self._version != _VERSION[0]:
            self._version = _VERSION[0]
            self._lists = [None] * len(self.blocks)

    def of(self, index: int) -> list[nn.Parameter]:
        """Block ``index``'s own parameters, each once, in ``block.parameters()`` order (the caller must not change
        the list)."""
        if not self.cache:
            return list(self.blocks[index].parameters())
        self._fresh()
        found = self._lists[index]
        if found is None:
            found = self._lists[index] = list(self.blocks[index].parameters())
        return found

    def version(self) -> int | None:
        """The structure version the lists hold (None without a cache: nothing is kept, every call walks)."""
        return structure_version() if self.cache else None
