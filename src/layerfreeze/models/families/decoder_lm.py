"""Hugging Face decoder-only language models: Llama, Mistral, Qwen2/3, Gemma, Phi, GPT-2, GPT-NeoX, Falcon, ...

Blocks, front to back: the token embeddings (``model.embed_tokens``; GPT-2's ``wte`` + ``wpe`` + ``drop`` are one
block, ``transformer.embeddings``), one block per decoder layer (``model.layers.<i>``, ``transformer.h.<i>``,
``gpt_neox.layers.<i>``), then the head: the final norm with the LM head (``model.norm`` + ``lm_head``, named
``head``; a sequence classifier's ``score`` likewise). With ``tie_word_embeddings`` the LM head's matrix is the
embedding matrix: it belongs to the embeddings block (:func:`~layerfreeze.models.blocks.resolve_ties`), so freezing the
embeddings freezes the LM head's matrix too, and the head trains its norm.

Forward splits (activation cache), written from ``<Model>.forward`` of transformers 5: :class:`LlamaStyleSplit`
(Llama, Gemma, Mistral, Qwen2, Qwen3: embeddings -> causal mask and rotary position embeddings built as the model
builds them -> layers -> norm -> ``lm_head``) and :class:`GPT2Split`. The state is ``(B, T, H)``, stored whole per
sample (the CLI's ``text-lm`` task gives fixed-length chunks), so cached and uncached logits are equal at every
position, padded ones included.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from layerfreeze.models.blocks import Block, has_params, head_entry, make_blocks, qualified_names
from layerfreeze.models.forward_split import Batch, ModelSplit, Stage, call, exact_forward
from layerfreeze.models.registry import register_blocks, register_split

_STACKS = ("layers", "h", "blocks")


def _stack(base: nn.Module) -> tuple[str, nn.ModuleList] | None:
    for name in _STACKS:
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return name, layers
    return None


@register_blocks("Hugging Face decoder LM", order=15)
def discover_decoder_lm(model: nn.Module) -> list[Block] | None:
    """The blocks of a decoder LM (see the module docstring), or None for another model.

    Recognised by: ``model.base_model`` holds a token embedding (an ``nn.Embedding`` child) registered before a
    ``ModuleList`` of layers named ``layers`` / ``h`` / ``blocks``. Base children registered before the layers
    form the embeddings block (a dropout there included, so a frozen embeddings block runs it in eval mode, as
    BERT's embeddings do theirs); those after (the final norm), with the model's other children (``lm_head``), the
    head.
    """
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or getattr(model, "main_input_name", "input_ids") != "input_ids":
        return None
    found = _stack(base)
    if found is None:
        return None
    stack_name, layers = found
    children = list(base.named_children())
    cut = [n for n, _ in children].index(stack_name)
    before = [m for _, m in children[:cut]]
    if not any(isinstance(m, nn.Embedding) for m in before):
        return None
    names = qualified_names(model)
    base_name = names[id(base)]
    embed = [(names[id(m)], m) for m in before]  # with the embedding dropout: frozen with them, in eval mode
    weighted = [n for n, m in embed if has_params(m)]
    embed_name = weighted[0] if len(weighted) == 1 else (f"{base_name}.embeddings" if base_name else "embeddings")
    entries = [(embed_name, embed)] + [(names[id(layer)], [(names[id(layer)], layer)]) for layer in layers]
    after = [(names[id(m)], m) for _, m in children[cut + 1:]]
    if base is model:
        return make_blocks(entries + head_entry(after), head=False)
    head = head_entry(after + [(n, m) for n, m in model.named_children() if m is not base])
    return make_blocks(entries + head, head=bool(head))


def _no_kv_cache(fn: Callable[..., Any]) -> dict[str, None]:
    """The keyword that passes "no KV cache" to ``fn`` (``create_causal_mask``, a decoder layer's ``forward``), under
    the name the installed transformers uses: ``cache`` in transformers 5.2x, ``past_key_values`` up to 5.17 at
    least (issue 41: a GPU machine with transformers 5.17 got ``create_causal_mask() got an unexpected keyword
    argument 'cache'`` from every LM split, so the cache's logits test failed for every decoder LM there)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return {}
    for name in ("cache", "past_key_values"):
        if name in params:
            return {name: None}
    return {}


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _lm_full(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Logits ``(B, T, V)`` from the model's own forward, as :func:`layerfreeze.train.lm.lm_forward` calls it."""
    return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits


def _llama_classes() -> dict[type, tuple[type, str]]:
    """``{CausalLM class: (base model class, mask rule)}`` for the Llama-style forwards this file replays."""
    import transformers as hf

    table = {
        "Llama": "full", "Gemma": "full", "Mistral": "mistral", "Qwen2": "layer_types", "Qwen3": "layer_types",
    }
    out = {}
    for prefix, rule in table.items():
        lm, base = getattr(hf, f"{prefix}ForCausalLM", None), getattr(hf, f"{prefix}Model", None)
        if lm is not None and base is not None:
            out[lm] = (base, rule)
    return out


@register_split(order=15)
class LlamaStyleSplit(ModelSplit):
    """Llama, Gemma, Mistral, Qwen2, Qwen3 ``...ForCausalLM``, written from ``LlamaModel.forward`` (transformers 5).

    Stages: ``model.embed_tokens(input_ids)`` -> ``model.layers[i](hidden, attention_mask=causal mask,
    position_embeddings=rotary(hidden, position_ids), position_ids)`` -> ``model.norm`` -> ``lm_head``. Position ids
    are ``arange(T)`` as the model uses them without a KV cache; the causal mask is made by the same
    ``masking_utils`` function as the model's (``create_causal_mask``; Mistral with ``sliding_window`` and Qwen's
    sliding layers: ``create_sliding_window_causal_mask``), from ``batch["attention_mask"]``. Batch keys:
    ``input_ids``, ``attention_mask`` (optional). Logits ``(B, T, vocab)``.

    Raises (constructor):
        ValueError: not one of these classes with its standard forward, or a model that keeps only some layers
            (``config.num_hidden_layers`` below the number of layers).
    """

    family = "Hugging Face Llama-style decoder LM (Llama, Gemma, Mistral, Qwen2, Qwen3)"
    input_keys = ("input_ids", "attention_mask")
    library = "transformers"

    @classmethod
    def check_model(cls, model: nn.Module) -> None:
        try:
            classes = _llama_classes()
        except ImportError:  # pragma: no cover
            raise ValueError("needs transformers (pip install layerfreeze[text])") from None
        for lm, (base, _) in classes.items():
            if exact_forward(model, lm) and exact_forward(model.model, base):
                if len(model.model.layers) != model.config.num_hidden_layers:
                    raise ValueError("config.num_hidden_layers differs from the number of layers")
                return
        raise ValueError(f"{type(model).__name__} is not one of {', '.join(c.__name__ for c in classes)} with its "
                         "standard forward")

    @staticmethod
    def _masks(base: nn.Module, rule: str, hidden: torch.Tensor, batch: Batch, position_ids: torch.Tensor) -> list[Any]:
        """The attention mask each layer gets, as ``<Model>.forward`` builds them."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(config=base.config, inputs_embeds=hidden, attention_mask=batch.get("attention_mask"),
                      position_ids=position_ids, **_no_kv_cache(create_causal_mask))
        n = len(base.layers)
        if rule == "mistral" and base.config.sliding_window is not None:
            return [create_sliding_window_causal_mask(**kwargs)] * n
        if rule == "layer_types":
            kinds = base.config.layer_types
            made = {"full_attention": create_causal_mask(**kwargs)}
            if "sliding_attention" in kinds[:n]:
                made["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
            return [made[k] for k in kinds[:n]]
        return [create_causal_mask(**kwargs)] * n

    def _stages(self, model: nn.Module) -> list[Stage]:
        names = qualified_names(model)
        base = model.model
        rule = _llama_classes()[type(model)][1]

        def embed(_: Any, batch: Batch, ctx: dict[str, Any]) -> torch.Tensor:
            return base.embed_tokens(batch["input_ids"])

        def layer_fn(i: int, layer: nn.Module) -> Callable[[Any, Batch, dict[str, Any]], Any]:
            no_cache = _no_kv_cache(type(layer).forward)

            def run(hidden: torch.Tensor, batch: Batch, ctx: dict[str, Any]) -> torch.Tensor:
                if "masks" not in ctx:
                    ctx["position_ids"] = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
                    ctx["masks"] = self._masks(base, rule, hidden, batch, ctx["position_ids"])
                    ctx["rotary"] = base.rotary_emb(hidden, position_ids=ctx["position_ids"])
                return _first(layer(hidden, attention_mask=ctx["masks"][i], position_embeddings=ctx["rotary"],
                                    position_ids=ctx["position_ids"], use_cache=False, **no_cache))

            return run

        stages = [Stage(names[id(base.embed_tokens)], base.embed_tokens, embed)]
        stages += [Stage(names[id(layer)], layer, layer_fn(i, layer)) for i, layer in enumerate(base.layers)]
        stages.append(Stage(names[id(base.norm)], base.norm, call(base.norm)))
        stages.append(Stage(names[id(model.lm_head)], model.lm_head, call(model.lm_head)))
        return stages

    def _initial(self, batch: Batch) -> Any:
        return None

    def full(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return _lm_full(model, batch)


@register_split(order=16)
class GPT2Split(ModelSplit):
    """Hugging Face ``GPT2LMHeadModel``, written from ``GPT2Model.forward`` (transformers 5).

    Stages: ``wte(input_ids)`` -> ``+ wpe(arange(T))`` -> ``drop`` -> ``h[i](hidden, None, causal mask, None,
    position_ids=...)`` -> ``ln_f`` -> ``lm_head``. The causal mask is ``create_causal_mask`` from
    ``batch["attention_mask"]``, as the model makes it. Batch keys: ``input_ids``, ``attention_mask`` (optional).

    Raises (constructor):
        ValueError: not a ``GPT2LMHeadModel`` with its standard forward, or a cross-attention configuration.
    """

    family = "Hugging Face GPT2LMHeadModel"
    input_keys = ("input_ids", "attention_mask")
    library = "transformers"

    @classmethod
    def check_model(cls, model: nn.Module) -> None:
        try:
            from transformers import GPT2LMHeadModel, GPT2Model
        except ImportError:  # pragma: no cover
            raise ValueError("needs transformers (pip install layerfreeze[text])") from None
        if not (exact_forward(model, GPT2LMHeadModel) and exact_forward(model.transformer, GPT2Model)):
            raise ValueError(f"{type(model).__name__} is not a GPT2LMHeadModel with its standard forward")
        if model.config.add_cross_attention:
            raise ValueError("GPT2Split does not support cross-attention")

    def _stages(self, model: nn.Module) -> list[Stage]:
        from transformers.masking_utils import create_causal_mask

        names = qualified_names(model)
        base = model.transformer

        def wte(_: Any, batch: Batch, ctx: dict[str, Any]) -> torch.Tensor:
            return base.wte(batch["input_ids"])

        def wpe(hidden: torch.Tensor, batch: Batch, ctx: dict[str, Any]) -> torch.Tensor:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            return hidden + base.wpe(position_ids).to(hidden.device)

        def layer_fn(layer: nn.Module) -> Callable[[Any, Batch, dict[str, Any]], Any]:
            def run(hidden: torch.Tensor, batch: Batch, ctx: dict[str, Any]) -> torch.Tensor:
                if "mask" not in ctx:
                    ctx["position_ids"] = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
                    ctx["mask"] = create_causal_mask(config=base.config, inputs_embeds=hidden,
                                                     attention_mask=batch.get("attention_mask"),
                                                     position_ids=ctx["position_ids"],
                                                     **_no_kv_cache(create_causal_mask))
                return _first(layer(hidden, None, ctx["mask"], None, encoder_attention_mask=None, use_cache=False,
                                    position_ids=ctx["position_ids"]))

            return run

        stages = [Stage(names[id(base.wte)], base.wte, wte), Stage(names[id(base.wpe)], base.wpe, wpe),
                  Stage(names[id(base.drop)], base.drop, call(base.drop))]
        stages += [Stage(names[id(layer)], layer, layer_fn(layer)) for layer in base.h]
        stages += [Stage(names[id(m)], m, call(m)) for m in (base.ln_f, model.lm_head)]
        return stages

    def _initial(self, batch: Batch) -> Any:
        return None

    def full(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return _lm_full(model, batch)
