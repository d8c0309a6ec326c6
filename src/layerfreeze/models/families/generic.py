"""The generic fallback, and the helper the stack-shaped families share.

Rule: the longest ``nn.ModuleList`` / ``nn.Sequential`` whose children with parameters are all of one type (at
least two of them) is the repeated stack; one block per layer. What comes before it (modules registered before it
on the path from the model down to it, and parameters held directly by those parent modules, such as a class
token) is the first block; what comes after it (deepest level first) is the head. Registration order stands in
for forward order, which is right for the usual ``__init__`` that builds modules in the order they run; check
``layerfreeze blocks`` and pass patterns when it is not.
"""

from __future__ import annotations

import warnings

from torch import nn

from layerfreeze.models.blocks import Block, Entry, has_params, head_entry, make_blocks
from layerfreeze.models.registry import register_blocks


def around_stack(model: nn.Module, path: str, head: bool = True) -> list[Block] | None:
    """Blocks for a model whose repeated layers are the list at ``path`` (e.g. ``"vit.layers"``).

    Returns:
        ``[first block (what runs before), layer blocks..., head (what runs after)]``; the first block is named
        after its module when it has one, else ``stem``; the head after its module when one, else ``head``. When
        nothing comes after the stack, its last layer is the head; parameters held by the parents (a class token)
        go to the first block. None when ``path`` is no module list.
    """
    try:
        stack = model.get_submodule(path)
    except AttributeError:
        return None
    if not isinstance(stack, (nn.ModuleList, nn.Sequential)):
        return None
    parts = path.split(".")
    before: list[tuple[str, nn.Module]] = []
    loose: list[tuple[str, nn.Parameter]] = []
    after_levels: list[list[tuple[str, nn.Module]]] = []
    module, prefix = model, ""
    for part in parts:
        loose += [(prefix + n, p) for n, p in module.named_parameters(recurse=False)]
        children = list(module.named_children())
        cut = [n for n, _ in children].index(part)
        before += [(prefix + n, m) for n, m in children[:cut] if has_params(m)]
        after_levels.append([(prefix + n, m) for n, m in children[cut + 1:] if has_params(m)])
        module, prefix = getattr(module, part), prefix + part + "."
    after = [entry for level in reversed(after_levels) for entry in level]
    entries: list[Entry] = []
    if before:
        entries.append((before[0][0] if len(before) == 1 else "stem", before))
    entries += [(f"{path}.{n}", [(f"{path}.{n}", m)]) for n, m in stack.named_children()]
    entries += head_entry(after)
    blocks = make_blocks(entries, head=head, params=loose)
    return blocks or None


#: Module names that usually hold a model's head (what :func:`discover_generic` warns about before the stack).
HEAD_NAMES = ("classifier", "head", "lm_head", "fc", "output", "out", "score", "cls")


def longest_stack(model: nn.Module) -> tuple[str, int, str] | None:
    """``(path, layers, layer type)`` of the longest list of same-type parametrised layers, or None."""
    best: tuple[str, int, str] | None = None
    for name, module in model.named_modules():
        if not name or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        kinds = [type(m) for m in module.children() if has_params(m)]
        if len(kinds) >= 2 and len(set(kinds)) == 1 and (best is None or len(kinds) > best[1]):
            best = (name, len(kinds), kinds[0].__name__)
    return best


@register_blocks("generic stack of same-type layers", order=1000)
def discover_generic(model: nn.Module) -> tuple[list[Block], str] | None:
    """The fallback (see the module docstring); the rule it reports names the stack, e.g.
    ``"generic stack: body.layers (6 x Block)"``."""
    found = longest_stack(model)
    if found is None:
        return None
    path, count, kind = found
    blocks = around_stack(model, path)
    if blocks and not blocks[0].is_head:
        named_head = [n for n, _ in blocks[0].modules if n.rsplit(".", 1)[-1].lower() in HEAD_NAMES]
        if named_head:  # registered before the stack: in the first block, frozen with it, and never the head
            warnings.warn(f"generic stack {path}: {', '.join(named_head)} is registered before the stack, so it is "
                          f"part of the first block ({blocks[0].name}), frozen with it, and not the head; if it is "
                          "the model's head, give the blocks as patterns front to back (blocks=[...], model.blocks) "
                          "or register it after the stack in __init__", stacklevel=2)
    return (blocks, f"generic stack: {path} ({count} x {kind})") if blocks else None
