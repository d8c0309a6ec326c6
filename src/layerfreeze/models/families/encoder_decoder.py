"""Hugging Face encoder-decoder models: T5, BART, mBART, Pegasus, Marian, ... (discovery; no forward split).

Freezing order is forward order, encoder before decoder:

1. the embeddings: the shared token embedding (``shared``) with the encoder's embedding modules (BART's
   ``encoder.embed_positions`` and ``encoder.layernorm_embedding``) and the decoder's token embedding when it is
   the shared one -- one block, named ``<encoder>.embeddings`` (T5: ``encoder.embeddings``; BART:
   ``model.encoder.embeddings``), or the module's own name when it is a single module;
2. the encoder layers (``encoder.block.<i>``, ``model.encoder.layers.<i>``);
3. the encoder's final norm, if it has one (T5's ``encoder.final_layer_norm``);
4. the decoder's own embedding modules, if any (BART's ``model.decoder.embeddings``: positions and their norm);
5. the decoder layers;
6. the head: the decoder's final norm and ``lm_head`` (``head``). BART's decoder has no final norm and its
   ``lm_head`` is tied to the shared embedding, so the head would own nothing: the last decoder layer joins it
   (the ``head`` block is then ``model.decoder.layers.<n-1>`` + ``lm_head``).

So a frozen prefix that reaches the decoder has the whole encoder frozen: backward then stops at the first
trainable decoder layer (cross-attention reads the frozen encoder output). The LM head is tied to the shared
embedding: the embeddings block owns that matrix (:func:`~layerfreeze.models.blocks.resolve_ties`), so freezing the
embeddings also freezes the LM head's matrix. The activation cache does not split these models (the decoder
reads the encoder's output and its own inputs; ``split_for`` refuses them).
"""

from __future__ import annotations

from torch import nn

from layerfreeze.models.blocks import Block, Entry, has_params, head_entry, make_blocks, qualified_names
from layerfreeze.models.registry import register_blocks


def _stack(part: nn.Module) -> nn.Module | None:
    for name in ("block", "layers", "layer"):
        layers = getattr(part, name, None)
        if isinstance(layers, (nn.ModuleList, nn.Sequential)) and len(layers):
            return layers
    return None


def _named(entries: list[tuple[str, nn.Module]], many: str) -> list[Entry]:
    """One entry of these modules (distinct objects, with parameters): its module's name if one, else ``many``."""
    seen: set[int] = set()
    mods = []
    for n, m in entries:
        if id(m) not in seen and has_params(m):
            seen.add(id(m))
            mods.append((n, m))
    return [(mods[0][0] if len(mods) == 1 else many, mods)] if mods else []


@register_blocks("Hugging Face encoder-decoder (T5, BART)", order=16)
def discover_encoder_decoder(model: nn.Module) -> list[Block] | None:
    """The blocks of an encoder-decoder (see the module docstring), or None for another model."""
    base = getattr(model, "base_model", None)
    encoder, decoder = getattr(base, "encoder", None), getattr(base, "decoder", None)
    if not isinstance(encoder, nn.Module) or not isinstance(decoder, nn.Module):
        return None
    enc_layers, dec_layers = _stack(encoder), _stack(decoder)
    if enc_layers is None or dec_layers is None:
        return None
    names = qualified_names(model)
    shared = getattr(base, "shared", None)
    shared_ids = {id(p) for p in shared.parameters()} if isinstance(shared, nn.Module) else set()

    def extras(part: nn.Module, layers: nn.Module) -> tuple[list, list]:
        embeds, finals = [], []
        for n, m in part.named_children():
            if m is not layers and has_params(m):
                (embeds if "embed" in n else finals).append((names[id(m)], m))
        return embeds, finals

    enc_embeds, enc_finals = extras(encoder, enc_layers)
    dec_embeds, dec_finals = extras(decoder, dec_layers)
    tied = [(n, m) for n, m in dec_embeds if all(id(p) in shared_ids for p in m.parameters())]
    dec_embeds = [(n, m) for n, m in dec_embeds if all(m is not t for _, t in tied)]
    first = ([(names[id(shared)], shared)] if isinstance(shared, nn.Module) else []) + enc_embeds + tied
    entries = _named(first, f"{names[id(encoder)]}.embeddings")
    entries += [(names[id(layer)], [(names[id(layer)], layer)]) for layer in enc_layers]
    entries += _named(enc_finals, f"{names[id(encoder)]}.final")
    entries += _named(dec_embeds, f"{names[id(decoder)]}.embeddings")
    entries += [(names[id(layer)], [(names[id(layer)], layer)]) for layer in dec_layers]
    others = [(names[id(m)], m) for n, m in base.named_children() if m not in (shared, encoder, decoder)]
    if base is not model:
        others += [(n, m) for n, m in model.named_children() if m is not base]
    head = head_entry(dec_finals + others)
    return make_blocks(entries + head, head=bool(head))
