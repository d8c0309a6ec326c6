"""A model seen as an ordered list of blocks, front to back.

A *block* is one freezable unit (embeddings, ``encoder.layer.3``, ``features.7``, the classifier). Freezing a
*frozen prefix* (blocks ``0..k-1``) is what saves backward compute, so the order of blocks is forward order.

Discovery is done by the model families in :mod:`layerfreeze.models.families` (one file per family: Hugging Face
encoders, decoder LMs, encoder-decoders, vision models; torchvision CNNs, ViT and Swin; timm; ``nn.Sequential``),
tried in their registered order, then by a generic fallback (the longest stack of same-type layers). Anything else
needs module-name patterns (:func:`blocks_from_patterns`). Parameter-free modules (ReLU, pooling, dropout) are
never blocks: there is nothing in them to freeze, and a frozen prefix around them stays graph-free.

Tied weights. A parameter used by modules of two blocks (an LM head tied to the token embeddings, T5's shared
embedding) belongs to exactly one block: the *earliest* that holds it (:func:`resolve_ties`). The later block
still runs the module but does not own the parameter: freezing the earliest block freezes the tied matrix
everywhere, and a later block's training never changes it. Why the earliest: a frozen prefix must give the same
output step after step (that is what saves backward, and what makes the activation cache exact); if the head
trained a matrix the frozen embeddings read, the "frozen" prefix would change under it. The cost: with the
embeddings frozen, the tied LM head's matrix is frozen too (untie it, ``tie_word_embeddings=False``, to train it).
"""

from __future__ import annotations

import fnmatch
import operator
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from layerfreeze.errors import BlockDiscoveryError


@dataclass(eq=False)
class Block:
    """One freezable unit of a model.

    Attributes:
        name: Stable name used in configs, checkpoints and telemetry (a module path such as ``bert.encoder.layer.3``,
            or a name such as ``stem`` or ``head`` for a block made of several modules).
        index: Position in forward order, 0-based.
        modules: ``(qualified_name, module)`` pairs the block is made of (usually one).
        is_head: True for the task head (the last block); strategies never freeze the head.
        params: ``(qualified_name, parameter)`` pairs held directly by a module outside ``modules`` (a ViT's class
            token and position embedding); they belong to the block like its modules' parameters.
        tied: ``{qualified name in this block: owning block's name}`` for parameters the block's modules use but
            an earlier block owns (tied weights; see the module docstring). :meth:`parameters` leaves them out.
    """

    name: str
    index: int
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    is_head: bool = False
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)

    def _all_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every parameter the block's modules and ``params`` hold, each once, tied ones included."""
        seen: set[int] = set()
        for prefix, module in self.modules:
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{prefix}.{name}" if prefix else name), p
        for name, p in self.params:
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(qualified name in the model, parameter)`` pairs the block owns, each once (tied ones left out)."""
        for name, p in self._all_named_parameters():
            if name not in self.tied:
                yield name, p

    def parameters(self) -> Iterator[nn.Parameter]:
        """The block's own parameters, each once (what freezing it sets ``requires_grad=False`` on)."""
        for _, p in self.named_parameters():
            yield p

    def num_parameters(self) -> int:
        """Number of scalar parameters (elements) the block owns."""
        return sum(p.numel() for p in self.parameters())

    def __repr__(self) -> str:
        head = ", head" if self.is_head else ""
        return f"Block({self.index}: {self.name}, {self.num_parameters():,} params{head})"


@dataclass
class Discovery:
    """What :func:`find_blocks` found.

    Attributes:
        blocks: The blocks, front to back (the last one is the head).
        rule: The family (or ``"patterns"``, ``"generic stack ..."``) that gave them; ``layerfreeze blocks`` shows it.
        ties: One line per tied parameter: which blocks use it and which one owns it.
    """

    blocks: list[Block]
    rule: str
    ties: list[str] = field(default_factory=list)


def output_tensor(output: Any) -> torch.Tensor:
    """The main tensor of a block's forward output: the first element of (nested) tuples/lists, a Hugging Face
    output's ``last_hidden_state``, or the tensor itself (e.g. what a forward hook on a block's last module sees)."""
    while isinstance(output, (tuple, list)):
        output = output[0]
    if hasattr(output, "last_hidden_state"):
        output = output.last_hidden_state
    return output


def has_params(module: nn.Module | None) -> bool:
    """True when ``module`` holds at least one parameter (itself or its children)."""
    return module is not None and any(True for _ in module.parameters())


Entry = tuple[str, list[tuple[str, nn.Module]]]
"""A block before it is numbered: ``(name, [(qualified module name, module), ...])``."""


def make_blocks(entries: Sequence[Entry], head: bool, params: Sequence[tuple[str, nn.Parameter]] = ()) -> list[Block]:
    """Number ``entries`` into blocks, dropping those without parameters; the last one is the head if ``head``.

    Args:
        entries: ``(name, [(qualified name, module), ...])`` front to back.
        head: Mark the last block as the task head.
        params: Parameters held directly by a module outside the entries' modules (a class token), given to the
            first block.
    """
    entries = [(n, mods) for n, mods in entries if any(has_params(m) for _, m in mods)]
    blocks = [Block(name=n, index=i, modules=list(mods)) for i, (n, mods) in enumerate(entries)]
    if params and blocks:
        blocks[0].params = list(params)
    if head and blocks:
        blocks[-1].is_head = True
    return blocks


def stack_layers(blocks: Sequence[Block]) -> list[bool]:
    """Which blocks are the *layers* of the model's repeated stack (BERT's ``encoder.layer.N``, a decoder's
    ``layers.N``, MobileNetV2's inverted residuals ``features.1-17``, ResNet's ``layer1-4``; both stacks of T5 or BART
    and what lies between them; a hybrid's Mamba and attention layers alike): every block from the first to the last
    run of two or more consecutive non-head blocks made of modules of the same classes. What comes before the first run
    (embeddings, a stem) and after the last (a pooler, a final norm, the head) is not a layer. When no such run exists,
    or the runs' span holds fewer than half of the non-head blocks (torchvision's Swin, whose stages alternate with
    patch merging), every non-head block counts as a layer.

    What strategies whose papers speak of layers read (``BlockView.is_layer``): AutoFreeze scores only the encoder
    layers (the authors' public code), and freezes the embeddings with the first frozen layer.
    """
    kinds = [tuple(type(m) for _, m in b.modules) if not b.is_head else None for b in blocks]
    runs, start = [], 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or kinds[i] is None or kinds[i] != kinds[start]:
            if kinds[start] is not None and i - start >= 2:
                runs.append((start, i))
            start = i
    body = sum(not b.is_head for b in blocks)
    if not runs or 2 * (runs[-1][1] - runs[0][0]) < body:
        return [not b.is_head for b in blocks]
    return [runs[0][0] <= i < runs[-1][1] for i in range(len(blocks))]


def qualified_names(model: nn.Module) -> dict[int, str]:
    """``{id(module): qualified name}`` for every module of ``model`` (the first name of a shared module)."""
    names: dict[int, str] = {}
    for name, module in model.named_modules():
        names.setdefault(id(module), name)
    return names


def module_entry(names: dict[int, str], module: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]]:
    """The entry of a block made of one module, named by its qualified name."""
    return names[id(module)], [(names[id(module)], module)]


def head_entry(parts: Sequence[tuple[str, nn.Module]]) -> list[Entry]:
    """The head's entry from its modules (those with parameters): one module keeps its name, several are ``head``."""
    parts = [(n, m) for n, m in parts if has_params(m)]
    if not parts:
        return []
    return [(parts[0][0] if len(parts) == 1 else "head", list(parts))]


def _children_summary(model: nn.Module) -> str:
    """The model's top-level children on one line: ``name (Type, N params), ...`` (an error message stays one line)."""
    rows = [f"{name} ({type(m).__name__}, {sum(p.numel() for p in m.parameters()):,} params)"
            for name, m in model.named_children()]
    return ", ".join(rows) if rows else "none"


def blocks_from_patterns(model: nn.Module, patterns: Sequence[str], head: bool = True) -> list[Block]:
    """Blocks from module-name patterns (``fnmatch`` syntax, matched against ``model.named_modules()`` names).

    Each pattern contributes, in ``named_modules`` order, every matching module that holds parameters and is not
    inside a module already matched (so ``encoder.layer.*`` gives one block per layer, not one per sub-module).
    Blocks are ordered by pattern, so list the patterns front to back. Tied parameters are resolved as in
    :func:`resolve_ties` (the earliest block owns them).

    The blocks' order is forward order: a strategy freezes the first blocks and never the last (the head). Patterns
    listed back to front (``["head", "layers.*", "stem"]``) would freeze the head and train the stem in silence, so
    blocks whose modules come in another order than the model registers them (``named_modules``, which is forward
    order in most models) get a ``UserWarning`` naming the first pair out of order. A model whose forward runs its
    modules in another order than it registers them may ignore it.

    Args:
        model: The model.
        patterns: e.g. ``["embed", "layers.*", "head"]``.
        head: Mark the last block as the task head (never frozen by strategies).

    Raises:
        BlockDiscoveryError: a pattern matches nothing (the message lists the top-level children).
    """
    matched: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for pattern in patterns:
        hits, shadowed = 0, []
        for name, module in model.named_modules():
            if not name or not fnmatch.fnmatchcase(name, pattern) or not has_params(module):
                continue
            if any(name == t or name.startswith(t + ".") or t.startswith(name + ".") for t in taken):
                shadowed.append(name)
                continue
            taken.append(name)
            matched.append((name, module))
            hits += 1
        if hits == 0 and shadowed:  # it said "matches no module" of a pattern whose modules an earlier one took
            raise BlockDiscoveryError(
                f"Block pattern {pattern!r} matches only modules an earlier pattern already made blocks "
                f"({', '.join(shadowed[:5])}); each module belongs to one block: give the pattern modules of its own")
        if hits == 0:
            raise BlockDiscoveryError(
                f"Block pattern {pattern!r} matches no module with parameters in {type(model).__name__} (its "
                f"top-level children: {_children_summary(model)}); patterns use fnmatch syntax on module names from "
                "model.named_modules(), e.g. 'encoder.layer.*' (`layerfreeze blocks` lists a model's blocks)"
            )
    _warn_out_of_order(model, [n for n, _ in matched])
    blocks = make_blocks([(n, [(n, m)]) for n, m in matched], head=head)
    resolve_ties(blocks)
    return blocks


def _warn_out_of_order(model: nn.Module, names: Sequence[str]) -> None:
    """Warn when the matched modules ``names`` (the blocks, front to back) are not in ``model.named_modules()``
    order (see :func:`blocks_from_patterns`)."""
    position = {name: i for i, (name, _) in enumerate(model.named_modules())}
    for before, after in zip(names, names[1:]):
        if position[after] < position[before]:
            warnings.warn(
                f"block patterns: {after!r} is a block after {before!r}, but the model registers it before it. "
                f"Blocks are front to back (forward order: strategies freeze the first blocks, never the last, the "
                f"head); list the patterns in the order the forward runs them (`layerfreeze blocks` shows the order "
                f"they give). If {type(model).__name__}'s forward does run {before!r} first, ignore this warning",
                stacklevel=5)  # the caller of discover_blocks
            return


def resolve_ties(blocks: list[Block]) -> list[str]:
    """Give every parameter used by several blocks to the earliest of them; record it in the others' ``tied``.

    Detects ties generally: the same ``Parameter`` object reached from modules of two blocks (an LM head tied to
    the token embeddings, an encoder-decoder's shared embedding). See the module docstring for why the earliest.

    Returns:
        One line per tie, e.g. ``"lm_head.weight is tied to model.embed_tokens.weight: owned by block
        'model.embed_tokens'; freezing that block also freezes it in 'head'"``.

    Raises:
        BlockDiscoveryError: a block would own no parameter at all (everything it holds is tied to earlier
            blocks) and it is not the head; name the blocks with patterns that keep tied modules together.
    """
    owner: dict[int, tuple[Block, str]] = {}
    notes: list[str] = []
    for block in blocks:
        block.tied = {}
        for name, p in block._all_named_parameters():
            if id(p) in owner:
                first, first_name = owner[id(p)]
                block.tied[name] = first.name
                notes.append(f"{name} is tied to {first_name}: owned by block {first.name!r}; freezing that block "
                             f"also freezes it in {block.name!r}")
            else:
                owner[id(p)] = (block, name)
        if not block.is_head and not any(True for _ in block.parameters()):
            raise BlockDiscoveryError(
                f"Block {block.name!r} holds only parameters tied to earlier blocks ({', '.join(block.tied)}), so "
                "it has nothing of its own to freeze; pass patterns that put the tied modules in one block."
            )
    return notes


def unassigned_parameters(model: nn.Module, blocks: Sequence[Block]) -> list[str]:
    """Names of model parameters that belong to no block (they are never frozen)."""
    owned = {id(p) for b in blocks for p in b.parameters()}
    return [n for n, p in model.named_parameters() if id(p) not in owned]


def unassigned_warning(model: nn.Module, blocks: Sequence[Block]) -> str | None:
    """The warning for trainable parameters of ``model`` that belong to no block (:func:`unassigned_parameters`),
    or None when there are none: nothing freezes them, and where they feed a frozen block the backward still runs
    through it (a top-level input scale, embeddings left out of ``model.blocks``; the cache then refuses the
    prefix)."""
    names = [n for n in unassigned_parameters(model, blocks) if model.get_parameter(n).requires_grad]
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
    return (f"{len(names)} trainable parameter(s) belong to no block ({shown}): nothing freezes them, and where "
            "they feed a frozen block its backward still runs. Add them to a block (the block patterns, "
            "model.blocks), or set their requires_grad to False")


def describe_blocks(blocks: Sequence[Block]) -> str:
    """One line per block: index, name, parameter count, head marker."""
    return "\n".join(
        f"{b.index:>3}  {b.name:<32} {b.num_parameters():>12,}{'  (head)' if b.is_head else ''}" for b in blocks
    )


def block_by_key(blocks: Sequence[Block], key: int | str) -> Block:
    """The block at index ``key`` (0 to ``len(blocks) - 1``, front to back; any integer type) or named ``key`` (a
    str: on an ``nn.Sequential`` the names are its child indices, "0", "2", ..., which need not equal the position).

    Raises:
        IndexError: an index outside 0..n-1 (the message lists the blocks with their indices and names).
        KeyError: no block has that name (the message lists the names).
        TypeError: ``key`` is neither an integer nor a str (a bool is refused: ``True`` would be block 1).
    """
    def listing() -> str:  # for the errors only: a lookup by a freeze or thaw builds no string
        return ", ".join(f"{b.index}={b.name}" for b in blocks)

    if isinstance(key, str):
        for b in blocks:
            if b.name == key:
                return b
        raise KeyError(f"No block named {key!r}; blocks (index=name): {listing()}")
    if isinstance(key, bool):  # True is the int 1: freeze(True) froze block 1
        raise TypeError("a block is given by its index (int) or its name (str), not bool")
    try:
        index = operator.index(key)
    except TypeError:
        raise TypeError(f"a block is given by its index (int) or its name (str), not {type(key).__name__}") from None
    if not 0 <= index < len(blocks):
        raise IndexError(f"block index {index} is out of range: the model has {len(blocks)} blocks, 0 to "
                         f"{len(blocks) - 1} (index=name: {listing()}); pass a str to select by name")
    return blocks[index]
