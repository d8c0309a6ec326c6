"""Hugging Face encoder-only models: BERT, RoBERTa, XLM-R, ELECTRA, DeBERTa(-v2), DistilBERT, MiniLM, ... and the
forward split of ``BertForSequenceClassification``.

Blocks: ``<base>.embeddings``, one per encoder layer (``<base>.encoder.layer.<i>``; DistilBERT
``distilbert.transformer.layer.<i>``), the ``pooler`` if it has parameters, then the task head (every other
top-level child with parameters: ``classifier``; several are one block named ``head``). Modules of the encoder
that every layer uses (DeBERTa's relative position embeddings ``encoder.rel_embeddings`` and their
``encoder.LayerNorm``) join the embeddings block, as do other parametrised children of the base model (ELECTRA's
``embeddings_project``): they run before the first layer, and a frozen layer must not read a relative embedding
that still trains.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from layerfreeze.models.blocks import Block, has_params, head_entry, make_blocks, module_entry, qualified_names
from layerfreeze.models.forward_split import Batch, ModelSplit, Stage, call, exact_forward, position_weights
from layerfreeze.models.registry import register_blocks, register_split


def _layer_stack(base: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """``(encoder, its layer list)``: ``encoder.layer`` / ``encoder.layers``, or DistilBERT's ``transformer.layer``."""
    for enc_name in ("encoder", "transformer"):
        encoder = getattr(base, enc_name, None)
        for name in ("layer", "layers"):
            layers = getattr(encoder, name, None)
            if isinstance(layers, (nn.ModuleList, nn.Sequential)) and len(layers):
                return encoder, layers
    return None


@register_blocks("Hugging Face encoder (BERT-like)", order=10)
def discover_hf_encoder(model: nn.Module) -> list[Block] | None:
    """The blocks of a BERT-like encoder (see the module docstring), or None for another model."""
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module):
        return None
    stack, embeddings = _layer_stack(base), getattr(base, "embeddings", None)
    if stack is None or not isinstance(embeddings, nn.Module):
        return None
    encoder, layers = stack
    names = qualified_names(model)
    skip = (layers, embeddings, encoder, getattr(base, "pooler", None))
    shared = [(names[id(m)], m) for part in (base, encoder) for m in part.children()
              if all(m is not s for s in skip) and has_params(m)]
    first = module_entry(names, embeddings)
    entries = [(first[0], first[1] + shared)]
    entries += [module_entry(names, layer) for layer in layers]
    pooler = getattr(base, "pooler", None)
    if has_params(pooler):
        entries.append(module_entry(names, pooler))
    if base is model:
        return make_blocks(entries, head=False)
    head = head_entry([(n, m) for n, m in model.named_children() if m is not base])
    return make_blocks(entries + head, head=bool(head))


def bidirectional_mask(base: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> Any:
    """The attention mask ``BertModel.forward`` gives its layers, for hidden states like ``hidden``.

    transformers 5 builds it with ``masking_utils.create_bidirectional_mask`` from the embeddings' output (its
    dtype, batch and length): a boolean ``(B, 1, T, T)`` mask for ``sdpa``, an additive float mask (``0`` /
    ``finfo.min``) for ``eager``, and ``None`` when nothing is padded and the implementation may skip it. We call the
    same function with the same config, so every attention implementation gets exactly what the model would.
    """
    try:
        from transformers.masking_utils import create_bidirectional_mask
    except ImportError:  # transformers 4.x: BertModel used get_extended_attention_mask (additive, eager semantics)
        if attention_mask is None:
            return None
        return base.get_extended_attention_mask(attention_mask, hidden.shape[:2])
    return create_bidirectional_mask(config=base.config, inputs_embeds=hidden, attention_mask=attention_mask)


@register_split(order=10)
class BertSplit(ModelSplit):
    """Hugging Face ``BertForSequenceClassification``, written from ``BertModel.forward`` (transformers 5).

    Stages: ``bert.embeddings(input_ids, token_type_ids)`` -> ``bert.encoder.layer[i](hidden, mask)`` ->
    ``bert.pooler`` (first token, dense, tanh) -> ``dropout`` -> ``classifier``. Batch keys: ``input_ids``,
    ``attention_mask`` and ``token_type_ids`` (the last two optional, as in
    :func:`layerfreeze.train.tasks.text_forward`).

    The mask is rebuilt on every call from ``batch["attention_mask"]`` (see :func:`bidirectional_mask`), so a
    cached hidden state is fed to the next layer exactly as the model's own forward would feed it.

    Variable length: up to the last encoder layer the state is ``(B, T, H)``; :meth:`lengths` gives each sample's
    true length (one past its last attended position), so a cache can store ``state[i, :length]``. Padded positions
    never reach a real one: their keys are masked out of every attention (weight exactly 0) and everything else is
    per position, so zeros there give the same logits as the values the full forward computes there.

    Raises (constructor):
        ValueError: not a ``BertForSequenceClassification`` with its standard forward, a decoder or cross-attention
            configuration, or no pooler.
    """

    family = "Hugging Face BertForSequenceClassification"
    input_keys = ("input_ids", "token_type_ids", "attention_mask")
    library = "transformers"

    @classmethod
    def check_model(cls, model: nn.Module) -> None:
        try:
            from transformers import BertForSequenceClassification, BertModel
        except ImportError:  # pragma: no cover
            raise ValueError("BertSplit needs transformers (pip install layerfreeze[text])") from None
        if not exact_forward(model, BertForSequenceClassification):
            raise ValueError(f"{type(model).__name__} is not a BertForSequenceClassification with its standard forward")
        if not exact_forward(model.bert, BertModel, ("forward", "_create_attention_masks")):
            raise ValueError(f"{type(model.bert).__name__} is not a BertModel with its standard forward")
        config = model.config
        if config.is_decoder or getattr(config, "add_cross_attention", False):
            raise ValueError("BertSplit supports encoder (bidirectional) BERT only, not a decoder configuration")
        if model.bert.pooler is None:
            raise ValueError("BertSplit needs the pooler (BertForSequenceClassification classifies the pooled output)")

    def _stages(self, model: nn.Module) -> list[Stage]:
        names = qualified_names(model)
        base = model.bert

        def embed(_: Any, batch: Batch, ctx: dict[str, Any]) -> torch.Tensor:
            return base.embeddings(input_ids=batch["input_ids"], token_type_ids=batch.get("token_type_ids"))

        def layer_fn(layer: nn.Module) -> Callable[[Any, Batch, dict[str, Any]], Any]:
            def run(hidden: torch.Tensor, batch: Batch, ctx: dict[str, Any]) -> torch.Tensor:
                if "mask" not in ctx:
                    ctx["mask"] = bidirectional_mask(base, hidden, batch.get("attention_mask"))
                return layer(hidden, ctx["mask"])

            return run

        stages = [Stage(names[id(base.embeddings)], base.embeddings, embed)]
        stages += [Stage(names[id(layer)], layer, layer_fn(layer)) for layer in base.encoder.layer]
        stages.append(Stage(names[id(base.pooler)], base.pooler, call(base.pooler)))
        stages.append(Stage(names[id(model.dropout)], model.dropout, call(model.dropout)))
        stages.append(Stage(names[id(model.classifier)], model.classifier, call(model.classifier)))
        return stages

    def _initial(self, batch: Batch) -> Any:
        return None  # the embeddings stage reads the batch itself

    def full(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch}
        return model(**inputs).logits

    def _sequence_depth(self) -> int:
        """Deepest depth whose state still has the sequence dimension (before the pooler stage)."""
        pooler_stage = len(self.stage_names) - 3
        return max(d for d in range(1, self.max_depth + 1) if self.boundary(d) <= pooler_stage)

    def lengths(self, batch: Batch, depth: int) -> torch.Tensor | None:
        mask = batch.get("attention_mask")
        if mask is None or depth > self._sequence_depth():
            return None
        attended = mask != 0
        t = attended.shape[1]
        last = t - 1 - attended.flip(1).int().argmax(1)  # position of the last attended token
        return torch.where(attended.any(1), last + 1, torch.full_like(last, t)).to(torch.int64)

    def padded_length(self, batch: Batch, depth: int) -> int | None:
        if batch.get("attention_mask") is None or depth > self._sequence_depth():
            return None
        return int(batch["input_ids"].shape[1])

    def fingerprint(self, batch: Batch) -> torch.Tensor:
        """Like :meth:`ModelSplit.fingerprint`, over attended positions only (independent of the padding length)."""
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        keep = (mask != 0).to(torch.float64)
        w = position_weights(ids.shape[1], ids.device)
        parts = []
        for key in self.input_keys:
            if key in batch:
                x = batch[key].to(torch.float64) * keep
                parts += [x.sum(1), (x * w).sum(1)]
        return torch.stack(parts, 1)
