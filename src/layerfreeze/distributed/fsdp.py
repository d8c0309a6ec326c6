"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with freezing that changes mid-run.

FSDP2 shards per parameter (each a ``DTensor``), so frozen and trainable parameters can sit side by side, unlike
FSDP1, whose FlatParameters need one ``requires_grad`` per flat group (or ``use_orig_params=True``, which then saves
no gradient memory). What that gives with the :class:`~layerfreeze.engine.Freezer`, measured in
``tests/test_fsdp.py`` on 2 CPU ranks (gloo):

* a frozen parameter has no gradient, so FSDP2 reduce-scatters nothing for it (the bytes drop with each freeze),
  and a frozen block's group skips its backward all-gather too; its forward all-gather stays (FSDP2 still has to
  unshard the weights to run them; caching the prefix's output, :mod:`layerfreeze.compute.cache`, is what removes that);
* the Freezer takes frozen parameters out of the optimizer (no state for them), and a thaw puts them back: the
  sharded parameters are the same ``Parameter`` objects throughout, so no wrapper is rebuilt (unlike DDP,
  :class:`~layerfreeze.distributed.comm.ddp.FreezeDDP`);
* a checkpoint holds every weight, frozen ones included: :func:`~layerfreeze.checkpoint.save_full_checkpoint` gathers
  the *full* model state dict on rank 0 through ``torch.distributed.checkpoint.state_dict`` (``full_state_dict=True``,
  ``cpu_offload=True``) and the optimizer state as full tensors keyed by parameter name, and writes the usual folder
  (:mod:`layerfreeze.checkpoint`); :func:`~layerfreeze.checkpoint.load_full_checkpoint` restores it on every rank,
  sharded again, or into an unsharded model. (The optimizer state is gathered by name rather than through DCP's
  ``get_optimizer_state_dict``: with one param group per block, frozen blocks leave empty param groups, which DCP's
  loader refuses.)

* a strategy runs on rank 0 only, which holds one shard of each parameter: a gradient-based one (``autofreeze``)
  gets its per-block gradient norms from every rank's shards (each rank sums its own at the optimizer's step, the
  stage all-reduces the norms); one that reads the weights (``smartfrz``, ``egeria``) observes a :class:`Mirror`, an
  unsharded copy the Freezer keeps equal to the shards (``Freezer(mirror=...)``);
* the activation cache (:class:`~layerfreeze.compute.cache.CachedPrefix`) runs the blocks one by one, each block's
  forward a collective: the ranks agree on every call on what all of them run, and the root group must hold no
  parameter (:func:`root_parameters`).

Order, as with any sharded model: build the model (same initial weights on every rank), (a :class:`Mirror` copy for
a weight-reading strategy), :func:`shard_blocks`, then the optimizer (over the sharded parameters), then the Freezer.
The CLI trainer does exactly this with ``run.parallel: fsdp`` (:mod:`layerfreeze.train.trainer`).

Any ``fully_shard`` layout works (root only, one group per block, one per transformer layer and the root). One thing
the Freezer must take care of: FSDP2 registers a group's *unsharded* parameters on its modules while they run, and
the root group (``reshard_after_forward`` is off for the root, as for any group given ``reshard_after_forward=False``)
keeps them registered after a forward that no backward follows -- an evaluation pass under ``torch.no_grad()``.
Read through the modules then, a block's parameters are FSDP's all-gather buffers, not the sharded parameters the
optimizer holds: a freeze or thaw would flip ``requires_grad`` on buffers FSDP resets from the sharded parameter at
the next all-gather (the change silently lost), put them in the optimizer, and a checksum of them (``.numpy()``)
would make their storage non-resizable, so FSDP's next reshard fails ("Trying to resize storage that is not
resizable"). So the Freezer reshards every FSDP module (:func:`reshard_all`) before it touches parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from layerfreeze.models.blocks import Block


def tied_across_blocks(blocks: Sequence[Block]) -> str | None:
    """Why FSDP2 cannot shard these blocks one group each, or None when it can: a parameter used by two blocks (an
    LM head tied to the token embeddings, ``tie_word_embeddings=True``; :func:`~layerfreeze.models.blocks.resolve_ties`
    gives it to the earlier block). ``fully_shard`` refuses a parameter already in another group ("is shared with a
    parameter already managed by another FSDP group"), and a weight-reading strategy's mirror would not find it."""
    for block in blocks:
        for name, owner in block.tied.items():
            return (f"FSDP2 (run.parallel: fsdp) shards each block in a group of its own, and {name} in block "
                    f"{block.name!r} is tied to a parameter of block {owner!r}: a parameter cannot be in two groups. "
                    "Untie the weights (tie_word_embeddings=False in the model's config, then save it) or train with "
                    "DDP (drop --parallel fsdp)")
    return None


def shard_blocks(model: nn.Module, blocks: Sequence[Block], **fully_shard_kwargs: Any) -> nn.Module:
    """Apply ``fully_shard`` to each block's modules (one FSDP parameter group per block), then to the root.

    Why per block: FSDP2 communicates per group; with one group per block a frozen block's group needs no backward
    all-gather and no reduce-scatter, while a group mixing frozen and trainable blocks would still gather all of
    them for backward.

    Args:
        model: The model; must not be sharded yet.
        blocks: Its blocks (:func:`~layerfreeze.models.discovery.discover_blocks`), discovered *before* sharding
            (sharding keeps module names and objects; the parameters a block holds outside its modules, such as a
            position embedding on the root, are replaced by sharded ones, and this updates the blocks to them).
        **fully_shard_kwargs: Passed to every ``fully_shard`` call (``mesh``, ``mp_policy``, ...).

    Returns:
        ``model``, now an ``FSDPModule``.

    Raises:
        ValueError: a parameter is tied across blocks (:func:`tied_across_blocks`).
        RuntimeError: no initialized process group.
    """
    from torch.distributed.fsdp import fully_shard

    tied = tied_across_blocks(blocks)
    if tied is not None:
        raise ValueError(tied)
    if not torch.distributed.is_initialized():
        raise RuntimeError("shard_blocks needs an initialized torch.distributed process group "
                           "(layerfreeze.distributed.init_distributed() under torchrun)")
    for block in blocks:
        for _, module in block.modules:
            if module is not model:
                fully_shard(module, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    for block in blocks:  # fully_shard replaced the parameters modules hold directly: a block's own ones too
        block.params = [(name, model.get_parameter(name)) for name, _ in block.params]
    return model


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (``DTensor``) tensor, any other tensor as it is. Local: no collective."""
    return t.to_local() if hasattr(t, "to_local") else t


def root_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters the *root* FSDP2 group of ``model`` holds: those no inner ``fully_shard`` module
    holds (with :func:`shard_blocks`, a block's parameters kept outside its modules, such as a ViT's class token;
    with ``fully_shard(model)`` alone, every parameter). Empty for a model whose root is not sharded.

    Why it matters: the root group's parameters are all-gathered by the root module's forward only, so code that
    runs a model's blocks one by one (the activation cache's forward split) sees them still sharded.
    """
    modules = fsdp_modules(model)
    if not modules or modules[0] is not model:
        return []
    held = {id(p) for m in modules[1:] for p in m.parameters()}
    return [n for n, p in model.named_parameters() if id(p) not in held]


def broadcast_buffers(buffers: Sequence[torch.Tensor], src: int = 0) -> None:
    """Give every rank rank ``src``'s values of ``buffers`` (in place; a collective: every rank passes the same
    buffers in the same order).

    Why: FSDP2 shards parameters only; buffers (BatchNorm running statistics) stay per rank and each rank's
    forward updates them with its own share of the batch, so they drift apart and a checkpoint (rank 0's) could
    not restore the other ranks. DDP broadcasts rank 0's buffers before every forward (``broadcast_buffers``);
    the CLI trainer does the same under FSDP2 with this.
    """
    for b in buffers:
        torch.distributed.broadcast(b, src)


class Mirror:
    """An unsharded copy of a sharded model, kept equal to it, for code that must read whole weights on one rank.

    Why: a freezing strategy runs on rank 0 only (:class:`~layerfreeze.engine.Freezer`), and under FSDP2 rank 0
    holds one shard of each parameter; reading a whole weight (SmartFRZ's weight samples, Egeria's reference copy)
    would need a collective the other ranks never join. So the strategy observes this mirror: a plain model of the
    same architecture on the CPU, whose parameters :meth:`refresh` sets to the sharded model's full values (every
    rank gathers each parameter, ``DTensor.full_tensor``, one at a time; rank 0 keeps it), and whose root forward
    pre-hooks see the sharded model's inputs (:meth:`forward_inputs`; Egeria takes its probe batch from one).

    Args:
        model: The sharded model.
        mirror: On the rank that reads it, an unsharded model with the same parameter and module names (e.g.
            ``copy.deepcopy(model)`` taken before sharding: FSDP2 modules cannot be deep-copied); None on the other
            ranks, which only take part in the gathers.

    Raises:
        ValueError: the mirror is sharded, or lacks a parameter of the model.
    """

    def __init__(self, model: nn.Module, mirror: nn.Module | None) -> None:
        self.model = model
        self.mirror = mirror
        self.moments: dict[str, dict[str, Any]] | None = None  # refresh_moments: by parameter name, on this rank
        self._hook: Any = None
        if mirror is not None:
            if is_sharded(mirror) or fsdp_modules(mirror):
                raise ValueError("the mirror must be an unsharded copy of the model (copy.deepcopy(model) before "
                                 "fully_shard / shard_blocks), not the sharded model")
            have = dict(mirror.named_parameters())
            missing = [n for n, _ in model.named_parameters() if n not in have]
            if missing:
                raise ValueError(f"the mirror has no parameter {', '.join(missing[:4])}: it must be a copy of the same "
                                 "model (same parameter names)")
            mirror.requires_grad_(False)

    def blocks(self, blocks: Sequence[Block]) -> list[Block]:
        """``blocks`` of the model as blocks of the mirror (the same names, the mirror's modules and parameters)."""
        m = self.mirror
        return [Block(b.name, b.index, [(n, m.get_submodule(n)) for n, _ in b.modules], b.is_head,
                      [(n, m.get_parameter(n)) for n, _ in b.params], dict(b.tied)) for b in blocks]

    @torch.no_grad()
    def refresh(self, trainable_only: bool = False) -> None:
        """Copy the model's current weights into the mirror: the parameters gathered whole (a collective: every
        rank calls it at the same point), then this rank's buffers (FSDP2 does not shard them).

        Args:
            trainable_only: Gather only the parameters that require grad (the others have not changed since the
                last full refresh: a frozen block's weights stay bitwise as they were).
        """
        mine = dict(self.mirror.named_parameters()) if self.mirror is not None else {}
        for name, p in self.model.named_parameters():  # the same names, in the same order, on every rank
            if trainable_only and not p.requires_grad:
                continue
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            if self.mirror is not None:
                mine[name].copy_(full.detach().to(mine[name].device, mine[name].dtype))
        if self.mirror is not None:
            mine_buffers = dict(self.mirror.named_buffers())
            for name, b in self.model.named_buffers():
                if name in mine_buffers:
                    mine_buffers[name].copy_(b.detach().to(mine_buffers[name].device, mine_buffers[name].dtype))

    @torch.no_grad()
    def refresh_moments(self, optimizer: torch.optim.Optimizer,
                        keys: Sequence[str] = ("exp_avg", "exp_avg_sq")) -> None:
        """Gather the optimizer's ``keys`` state (Adam's first and second moments) of every trainable parameter
        whole, as :meth:`refresh` gathers the weights (a collective: every rank calls it at the same point), and
        keep it on the mirror's rank, by parameter name, with the state's ``step``: what a strategy that reads the
        optimizer state (:attr:`~layerfreeze.strategies.Strategy.reads_optimizer_state`, SmartFRZ's gradient SNR
        gate) reads under FSDP2, where each rank holds one shard of each moment.

        A parameter whose state lacks a key (no step taken yet, or an optimizer without those moments) is skipped on
        every rank alike (the state is created on the same step on every rank). Costs, at each stage: the gathers
        of ``len(keys)`` times the trainable parameters, and that many bytes of host memory on the mirror's rank.
        """
        keep = self.mirror is not None  # the other ranks only take part in the gathers
        moments: dict[str, dict[str, Any]] = {}
        for name, p in self.model.named_parameters():  # the same names, in the same order, on every rank
            state = optimizer.state.get(p) if p.requires_grad else None
            if not state or any(k not in state for k in keys):
                continue
            full = {k: state[k].full_tensor() if hasattr(state[k], "full_tensor") else state[k] for k in keys}
            if keep:
                step = state.get("step")
                moments[name] = {**{k: v.detach().to("cpu", copy=True).reshape(p.shape) for k, v in full.items()},
                                 "step": float(step) if step is not None else None}
        self.moments = moments if keep else None

    def optimizer_view(self, optimizer: torch.optim.Optimizer) -> Callable[[nn.Parameter], Any]:
        """``view(mirror_parameter)`` -> ``(its gathered state, the model parameter's param group)``, or None (not
        trainable, or no state yet): :attr:`~layerfreeze.strategies.base.StageContext.optimizer_state` for a strategy
        that observes the mirror, from the last :meth:`refresh_moments`."""
        names = {id(p): n for n, p in self.mirror.named_parameters()} if self.mirror is not None else {}
        params = dict(self.model.named_parameters())
        groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        moments = self.moments or {}

        def view(param: nn.Parameter) -> Any:
            name = names.get(id(param))
            state = moments.get(name) if name is not None else None
            group = groups.get(id(params[name])) if state is not None else None
            return None if group is None else (state, group)

        return view

    def forward_inputs(self) -> None:
        """Call the mirror's root forward pre-hooks with the inputs of each forward of the model (and set the
        mirror's ``training`` flag to the model's first): a hook that observes the model's input (Egeria's probe
        capture) sees the batches the model trains on. The hooks must not change the inputs (strategies never do)."""
        if self.mirror is None or self._hook is not None:
            return
        mirror = self.mirror

        def replay(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            mirror.training = module.training
            with_kwargs = mirror._forward_pre_hooks_with_kwargs
            for hid, hook in list(mirror._forward_pre_hooks.items()):
                if hid in with_kwargs:
                    hook(mirror, args, kwargs)
                else:
                    hook(mirror, args)

        self._hook = self.model.register_forward_pre_hook(replay, with_kwargs=True)

    def close(self) -> None:
        """Stop :meth:`forward_inputs`."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` (FSDP2) was applied to, outermost first (empty for a model that
    is not sharded, or without ``torch.distributed``)."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard_all(modules: Sequence[nn.Module]) -> None:
    """Register each FSDP module's sharded parameters again (``FSDPModule.reshard``), freeing unsharded ones.

    Why: after a forward with no backward (an evaluation pass under ``no_grad``), a group that does not reshard
    after forward (the root's, by default) leaves its all-gathered, unsharded parameters on its modules (see the
    module docstring). Local (no collective) and a no-op for groups that are sharded; the next forward all-gathers
    again. Call it on every rank at the same point: a rank that resharded all-gathers in its next forward, one that
    did not would skip that collective.
    """
    for module in modules:
        module.reshard()


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes that FSDP2's collectives send while active: ``all_gather`` and ``reduce_scatter``.

    Counted per call as the unsharded side's bytes (an all-gather's output, a reduce-scatter's input), from the
    ``c10d`` ops the process group dispatches. Use as ``with CollectiveBytes() as c: step()``, then
    ``c.bytes["reduce_scatter"]``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes = {"all_gather": 0, "reduce_scatter": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201 - dispatch protocol
        name = str(func)
        kind = "all_gather" if "allgather" in name else "reduce_scatter" if "reduce_scatter" in name else None
        if kind is not None:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors:
                self.bytes[kind] += max(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


#: The ``format`` of an optimizer state saved by parameter name (:func:`full_optimizer_state`).
BY_NAME = "layerfreeze-by-name"


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` holds a sharded (FSDP2, ``DTensor``) parameter."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support has no sharded parameters
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_options(**extra: Any) -> Any:
    """``torch.distributed.checkpoint``'s options for a full (unsharded) model state dict, plus ``extra``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


def _full(value: Any) -> Any:
    """A tensor gathered whole onto the CPU (collective for a DTensor), anything else as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    return value.cpu() if isinstance(value, torch.Tensor) else value


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"by_name": {param name: {state key: full tensor}}, "groups": hyperparameters per param group}``.

    Collective (every rank gathers the same tensors in the same, name-sorted order).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    by_param = {names[id(p)]: st for p, st in optimizer.state.items()}
    return {"format": BY_NAME,
            "by_name": {n: {k: _full(v) for k, v in by_param[n].items()} for n in sorted(by_param)},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Put :func:`full_optimizer_state` back into ``optimizer`` (after the Freezer has rebuilt its param groups): each
    full tensor sharded like its parameter for a sharded model, moved to its parameter's device for an unsharded
    one; the group hyperparameters restored.

    Raises:
        ValueError: not a layerfreeze by-name optimizer state, a different number of param groups, or state for a
            parameter this model does not have or that no param group of ``optimizer`` holds.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if saved.get("format") != BY_NAME:
        raise ValueError("the optimizer state is not from save_full_checkpoint")
    if len(saved["groups"]) != len(optimizer.param_groups):
        raise ValueError(f"{len(saved['groups'])} saved param groups, this optimizer has {len(optimizer.param_groups)}")
    params = dict(model.named_parameters())
    missing = sorted(set(saved["by_name"]) - set(params))
    if missing:
        raise ValueError(f"optimizer state for parameters this model does not have: {', '.join(missing[:5])}")
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    outside = sorted(n for n in saved["by_name"] if id(params[n]) not in held)
    if outside:
        raise ValueError("optimizer state for parameters in no param group of this optimizer: "
                         f"{', '.join(outside[:5])}")
    optimizer.state.clear()
    for name, st in saved["by_name"].items():
        p = params[name]
        restored = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and isinstance(p, DTensor) and v.shape == p.shape:
                v = distribute_tensor(v.to(p.device_mesh.device_type), p.device_mesh, p.placements)
            elif isinstance(v, torch.Tensor) and v.shape == p.shape:
                v = v.to(p.device)
            restored[k] = v
        optimizer.state[p] = restored
    for group, hyper in zip(optimizer.param_groups, saved["groups"]):
        group.update(hyper)


def check_blocks_hold_model_parameters(model: nn.Module, blocks: Sequence[Block]) -> None:
    """Refuse blocks that hold tensors standing in for the model's parameters: a clear error now rather than a block
    that silently keeps training, or a crash in FSDP later.

    Raises:
        ValueError: a block's parameter is not one of the model's (blocks found before ``fully_shard``, which
            replaces every parameter a module holds directly, or on another model).
    """
    held = {id(p) for p in model.parameters()}
    stale = [f"{n} (block {b.name})" for b in blocks for n, p in b.named_parameters() if id(p) not in held]
    if stale:
        raise ValueError(
            f"blocks hold parameters that are not the model's: {', '.join(stale[:4])}. They were discovered "
            "before the model was sharded (fully_shard replaces the parameters a module holds directly, such as "
            "a position embedding on the root) or on another model: discover them after fully_shard (give "
            "Freezer blocks=None or module-name patterns), or shard with layerfreeze.distributed.shard_blocks, "
            "which updates them")


def check_optimizer_holds_sharded_parameters(model: nn.Module, optimizer: torch.optim.Optimizer,
                                             registered: dict[str, nn.Parameter]) -> None:
    """Refuse an optimizer that holds FSDP2's unsharded parameters instead of the sharded ones it must update.

    Args:
        registered: The parameters the modules held before they were resharded (:func:`reshard_all`): FSDP2's
            unsharded ones when an evaluation pass had left them there.

    Raises:
        ValueError: the optimizer was built after a forward with no backward left the unsharded parameters on the
            modules (the message says how to build it).
    """
    held = {id(p) for p in model.parameters()}
    unsharded = {id(p): n for n, p in registered.items() if id(p) not in held}
    wrong = [unsharded[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in unsharded]
    if wrong:
        raise ValueError(
            f"the optimizer holds FSDP2's unsharded parameters ({', '.join(wrong[:4])}), not the sharded ones "
            "it must update: it was built after a forward with no backward (an evaluation pass under "
            "torch.no_grad()) left the unsharded parameters on the modules (the root FSDP group keeps them after "
            "forward). Build the optimizer right after fully_shard, before any forward, or call reshard() on "
            "each FSDP module before building it")
