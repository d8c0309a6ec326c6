"""``torch.compile`` for the trainer (``train.compile``, ``--compile``; issue 42), kept right under freezing.

Modes:

* ``false``: eager (the default until measured otherwise).
* ``blocks``: regional compilation, as torchtune and PyTorch's regional-compilation recipe do: each block's modules
  are compiled on their own, through one compiled function per module class, so identical blocks (a transformer's
  layers) share their compiled code. The Freezer's hooks on a block (demotion's casts, the cache's capture) stay
  outside the compiled code and run eagerly.
* ``true``: the whole model as one region.

**Correct first.** Each region's compiled call takes the region's *trainable key* (which of its parameters require
grad) as an argument that Dynamo specializes on, so a graph compiled for one trainable set is never run for another,
whatever Dynamo's own guards on ``requires_grad`` do (pytorch/pytorch#139476: a thaw that reused a stale frame left
the thawed layer untrained; dingo-gw/dingo#407). The keys are refreshed from the parameters whenever the Freezer's
frozen set changes (:meth:`CompiledRegions.refresh`, before the step's forward). The graphs of earlier keys stay
cached: a block that freezes and thaws again (LISA, BAdam) compiles once per variant, not once per switch. In the
``true`` mode the hooks inside the model are traced into the graph; a new key (every change of the frozen set) traces
them afresh.

**Bounded.** Dynamo's recompile limit counts per code object: every module class gets its own copy of the call's
code (so classes do not share one limit), the limit is raised to :data:`RECOMPILE_LIMIT` while a run trains, and a
hit is an error (``fail_on_recompile_limit_hit``), never a silent fall back to eager (pytorch/pytorch#131975,
#141039). Graphs compiled are counted from ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``
(:meth:`CompiledRegions.graphs`); the trainer logs the count per step (``compiles``) and the seconds spent compiling
in the summary (:class:`_CompileClock`: the wall time between Dynamo's outermost compile callbacks).
"""

from __future__ import annotations

import copy
import logging
import time
import types
from collections.abc import Iterable
from typing import Any

from torch import nn


def _no_cuda_runtime_note(record: logging.LogRecord) -> bool:
    """A filter for ``torch.utils.cpp_extension``'s logger: drops its "No CUDA runtime is found, using CUDA_HOME=..."
    warning, which inductor's first compile printed on every CPU-only machine (a line no user can act on)."""
    return not record.getMessage().startswith("No CUDA runtime is found")


class _CompileClock:
    """Seconds spent compiling, from Dynamo's compilation callbacks (``torch._dynamo.callback``): a compile of a frame,
    the lazy compile of its backward at the first backward, a CUDA graph's recording. The callbacks fire for the
    outermost compile only, so nested compiles are counted once. (Summing ``compilation_time_metrics``' entries
    counted a backward compiled inside its forward's compile twice: a run's compile time came out larger than its
    wall time.)"""

    def __init__(self) -> None:
        from torch._dynamo.callback import callback_handler

        self.seconds, self._since = 0.0, None
        self._handler = callback_handler
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def _start(self, args: Any) -> None:
        self._since = time.perf_counter()

    def _end(self, args: Any) -> None:
        if self._since is not None:
            self.seconds += time.perf_counter() - self._since
            self._since = None

    def close(self) -> None:
        """Stop counting (the callbacks are removed)."""
        for callbacks, callback in ((self._handler.start_callbacks, self._start),
                                    (self._handler.end_callbacks, self._end)):
            if callback in callbacks:
                callbacks.remove(callback)


#: Dynamo's recompile limit per code object while a compiled run trains (its default is 8): each module class's
#: region may hold a graph per trainable key, grad mode, train/eval mode and batch shape.
RECOMPILE_LIMIT = 64


def _region_call(key: tuple[bool, ...], module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What a region's compiled function runs: the module's own class ``forward`` (``key`` is only specialized on)."""
    return type(module).forward(module, *args, **kwargs)


def _function_for(cls: type) -> types.FunctionType:
    """:func:`_region_call` with a code object of its own for ``cls`` (Dynamo's cache and limit are per code)."""
    code = _region_call.__code__.replace(co_name=f"compiled_{cls.__name__}")
    return types.FunctionType(code, _region_call.__globals__, code.co_name)


class _RegionForward:
    """A module's ``forward`` while compiled: calls the class's compiled function with the region's key. A deep copy
    of the module (a strategy's reference copy) gets a copy that calls the same compiled function with the copy."""

    def __init__(self, module: nn.Module, compiled: Any) -> None:
        self.module, self.compiled = module, compiled
        self.key = trainable_key(module.parameters())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(self.key, self.module, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _RegionForward:
        twin = _RegionForward.__new__(_RegionForward)
        twin.module, twin.compiled, twin.key = copy.deepcopy(self.module, memo), self.compiled, self.key
        return twin


def trainable_key(params: Iterable[nn.Parameter]) -> tuple[bool, ...]:
    """Which of ``params`` require grad, in order: the key a region's graph is specialized on."""
    return tuple(p.requires_grad for p in params)


class CompiledRegions:
    """The compiled regions of a model (module docstring).

    Args:
        model: The model (already on its device, its hooks attached).
        block_modules: The modules of every block, in forward order (``blocks`` mode: each is a region).
        mode: ``"blocks"`` or ``True`` (the whole model).
        backend: ``torch.compile``'s backend (``"inductor"``; ``"aot_eager"`` compiles in a fraction of the time and
            runs the same graphs eagerly: the tests' choice).

    Raises:
        ValueError: an unknown ``mode``.
    """

    def __init__(self, model: nn.Module, block_modules: Iterable[nn.Module], mode: bool | str,
                 backend: str = "inductor") -> None:
        if mode not in (True, "blocks"):
            raise ValueError(f"compile mode must be True or 'blocks', got {mode!r}")
        import torch._dynamo

        self.mode, self.backend = mode, backend
        cpp_extension_log = logging.getLogger("torch.utils.cpp_extension")
        if _no_cuda_runtime_note not in cpp_extension_log.filters:
            cpp_extension_log.addFilter(_no_cuda_runtime_note)
        self._config = torch._dynamo.config
        self._saved = (self._config.recompile_limit, self._config.fail_on_recompile_limit_hit)
        self._config.recompile_limit = max(RECOMPILE_LIMIT, self._saved[0])
        self._config.fail_on_recompile_limit_hit = True
        modules = [model] if mode is True else list(block_modules)
        functions: dict[type, Any] = {}
        self.regions: list[_RegionForward] = []
        for module in modules:
            cls = type(module)
            if cls not in functions:
                functions[cls] = torch.compile(_function_for(cls), backend=backend)
            region = _RegionForward(module, functions[cls])
            module.forward = region  # an instance attribute: nn.Module's __call__ (and its hooks) run eagerly around it
            self.regions.append(region)
        self._frozen: tuple[bool, ...] | None = None
        self._graphs_at_start = self.graphs()
        self._clock = _CompileClock()

    def summary(self) -> dict[str, Any]:
        """The summary's ``compile``: mode, backend, regions, graphs compiled and seconds spent compiling (in training
        steps and in evaluation: the trainer adds ``train_compile_s``, the steps' share)."""
        return {"mode": self.mode, "backend": self.backend, "regions": len(self.regions),
                "graphs": self.compiled_graphs(), "compile_s": self.compile_seconds()}

    def refresh(self, frozen: Iterable[bool]) -> None:
        """Before a forward: when the frozen set (``Freezer.frozen``, one flag per block) changed since the last call,
        every region's key is read again from its parameters (a thaw's region gets a graph of its own trainable
        set)."""
        frozen = tuple(frozen)
        if frozen == self._frozen:
            return
        self._frozen = frozen
        for region in self.regions:
            region.key = trainable_key(region.module.parameters())

    @staticmethod
    def graphs() -> int:
        """Graphs Dynamo compiled in this process so far (every compile and recompile of every region)."""
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    def compile_seconds(self) -> float:
        """Seconds spent compiling since these regions were made (:class:`_CompileClock`)."""
        return self._clock.seconds

    def compiled_graphs(self) -> int:
        """Graphs compiled since these regions were made."""
        return self.graphs() - self._graphs_at_start

    def close(self) -> None:
        """Give the model its eager ``forward`` back and Dynamo its limits (the end of a run); stop the clock."""
        self._clock.close()
        for region in self.regions:
            if region.module.__dict__.get("forward") is region:
                del region.module.forward
        self._config.recompile_limit, self._config.fail_on_recompile_limit_hit = self._saved
