"""The Hugging Face callback in real ``transformers.Trainer.train`` runs on a tiny BERT built from a config: frozen
weights bitwise unchanged, freezes at the steps the strategy chose, thawed parameters back in their own param
group, the timeline in the Trainer's log, a resumed run equal to the uninterrupted one, gradient checkpointing
with a frozen prefix (#21381), bf16 autocast, and 2-process torchrun with and without gradient checkpointing; the
callback given in the Trainer's constructor or attached to it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from layerfreeze.integrations.hf import LayerFreezeCallback  # noqa: E402

from .integration_models import (  # noqa: E402
    Scripted,
    TokenDataset,
    check_rotation,
    free_port,
    run_ranks,
    tiny_bert,
)

ROOT = Path(__file__).resolve().parents[1]
hf_logging.set_verbosity_error()
#: tiny BERT blocks: 0 embeddings, 1-3 encoder layers, 4 pooler, 5 classifier
PLAN = {2: [("freeze", 0)], 3: [("freeze", 1)], 6: [("thaw", 1)], 10: [("freeze", 2)]}


def arguments(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=5e-3, max_steps=12,
                    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                    dataloader_num_workers=0, weight_decay=0.01)
    defaults.update(kwargs)
    return TrainingArguments(**defaults)


def train(tmp_path, strategy, params=None, model=None, resume=None, callbacks=(), ledger_every=None, **kwargs):
    model = model or tiny_bert()
    trainer = Trainer(model=model, args=arguments(tmp_path, **kwargs), train_dataset=TokenDataset(),
                      callbacks=list(callbacks))
    callback = LayerFreezeCallback(strategy, params, ledger_every=ledger_every).attach(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, callback


def losses(trainer):
    return [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]


def test_static_frozen_weights_bitwise_and_out_of_the_optimizer(tmp_path):
    model = tiny_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer, callback = train(tmp_path, "static", {"k": 2}, model=model, max_steps=4, ledger_every=1)
    for name, p in model.named_parameters():
        frozen = name.startswith(("bert.embeddings.", "bert.encoder.layer.0."))
        assert torch.equal(before[name], p) == frozen, name
    # the memory ledger, logged with the Trainer's logs: AdamW holds two float32 moments per trainable weight and a
    # float32 step per trainable tensor; the frozen prefix holds no gradient and no state
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = 4 * sum(p.numel() for p in trainable)
    logged = [h for h in trainer.state.log_history if "layerfreeze/memory/grads" in h]
    assert [h["step"] for h in logged] == [1, 2, 3, 4]
    assert logged[-1]["layerfreeze/memory/params_trainable"] == weights == logged[-1]["layerfreeze/memory/grads"]
    assert logged[-1]["layerfreeze/memory/optimizer"] == 2 * weights + 4 * len(trainable)
    assert logged[-1]["layerfreeze/memory/params_frozen"] == 4 * sum(p.numel() for p in model.parameters()) - weights
    assert logged[-1]["layerfreeze/memory/activations"] > 0
    assert callback.session.ledger.peaks.blocks["grads"][:2] == [0, 0]  # embeddings, layer 0
    optimizer = callback.freezer.optimizer
    assert len(optimizer.param_groups) == 2  # the Trainer's decay / no-decay groups, unchanged
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in held for p in model.bert.embeddings.parameters())
    assert [(h["kind"], h["index"], h["step"]) for h in callback.freezer.history] == [("freeze", 0, 0),
                                                                                       ("freeze", 1, 0)]
    # the start stage's freezes open the timeline (they were made before the callback's log existed: missing)
    timeline = [(h["step"], k, v) for h in trainer.state.log_history for k, v in h.items()
                if k.startswith("layerfreeze/frozen/")]
    assert timeline == [(0, "layerfreeze/frozen/bert.embeddings", 1.0),
                        (0, "layerfreeze/frozen/bert.encoder.layer.0", 1.0)]


def test_freeze_thaw_steps_groups_and_the_log(tmp_path):
    model = tiny_bert()
    trainer, callback = train(tmp_path, Scripted(PLAN), model=model)
    assert [(h["kind"], h["index"], h["step"]) for h in callback.freezer.history] == [
        ("freeze", 0, 2), ("freeze", 1, 3), ("thaw", 1, 6), ("freeze", 2, 10)]
    groups = callback.freezer.optimizer.param_groups
    layer0 = model.bert.encoder.layer[0]
    # the thawed block is back in the groups the Trainer built: LayerNorm weights without weight decay
    assert any(p is layer0.output.LayerNorm.weight for p in groups[1]["params"])
    assert any(p is layer0.output.dense.weight for p in groups[0]["params"])
    assert groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0
    timeline = [(h["step"], k, v) for h in trainer.state.log_history for k, v in h.items()
                if k.startswith("layerfreeze/frozen/")]
    assert timeline == [(2, "layerfreeze/frozen/bert.embeddings", 1.0),
                        (3, "layerfreeze/frozen/bert.encoder.layer.0", 1.0),
                        (6, "layerfreeze/frozen/bert.encoder.layer.0", 0.0),
                        (10, "layerfreeze/frozen/bert.encoder.layer.1", 1.0)]


def test_the_callback_passed_in_the_trainers_constructor_as_hf_users_pass_callbacks(tmp_path):
    """Issue 32: ``Trainer(..., callbacks=[LayerFreezeCallback(...)])`` raised "needs its trainer"."""
    model = tiny_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    callback = LayerFreezeCallback("static", {"k": 1})
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=4), train_dataset=TokenDataset(),
                      callbacks=[callback])
    assert callback.trainer is trainer  # found at on_init_end
    trainer.train()
    for name, p in model.named_parameters():
        assert torch.equal(before[name], p) == name.startswith("bert.embeddings."), name
    assert [(h["kind"], h["index"], h["step"]) for h in callback.freezer.history] == [("freeze", 0, 0)]
    assert len(losses(trainer)) == 4
    # the freeze timeline goes through trainer.log into its log history, as with attach
    model = tiny_bert()
    scripted = LayerFreezeCallback(Scripted(PLAN))
    trainer = Trainer(model=model, args=arguments(tmp_path / "plan"), train_dataset=TokenDataset(),
                      callbacks=[scripted])
    trainer.train()
    timeline = [(h["step"], k, v) for h in trainer.state.log_history for k, v in h.items()
                if k.startswith("layerfreeze/frozen/")]
    assert timeline == [(2, "layerfreeze/frozen/bert.embeddings", 1.0),
                        (3, "layerfreeze/frozen/bert.encoder.layer.0", 1.0),
                        (6, "layerfreeze/frozen/bert.encoder.layer.0", 0.0),
                        (10, "layerfreeze/frozen/bert.encoder.layer.1", 1.0)]
    attached, _ = train(tmp_path / "attached", Scripted(PLAN))
    assert losses(trainer) == losses(attached)  # the same run as the attach form


def test_resume_after_a_thaw_equals_the_uninterrupted_run(tmp_path):
    full, full_cb = train(tmp_path / "full", Scripted(PLAN), save_strategy="steps", save_steps=4)
    model = tiny_bert()
    resumed, resumed_cb = train(tmp_path / "full", Scripted(PLAN), model=model,
                                resume=str(tmp_path / "full" / "checkpoint-8"), save_strategy="no")
    assert losses(resumed) == losses(full)  # log_history: steps 1-8 from the checkpoint, 9-12 trained again
    assert resumed_cb.freezer.frozen == full_cb.freezer.frozen
    assert resumed_cb.freezer.history == full_cb.freezer.history
    for (name, a), b in zip(full.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    # a checkpoint moved elsewhere: named with resume_from; without it, a clear error
    moved = tmp_path / "moved"
    (tmp_path / "full" / "checkpoint-8").rename(moved)
    with pytest.raises(FileNotFoundError, match="resume_from"):
        train(tmp_path / "other", Scripted(PLAN), resume=str(moved))
    trainer = Trainer(model=tiny_bert(), args=arguments(tmp_path / "other"), train_dataset=TokenDataset())
    callback = LayerFreezeCallback(Scripted(PLAN), resume_from=moved).attach(trainer)
    trainer.train(resume_from_checkpoint=str(moved))
    assert losses(trainer) == losses(resumed) and callback.freezer.history == full_cb.freezer.history


@pytest.mark.parametrize("strategy, params", [("lisa", {"gamma": 1, "k": 3}), ("badam", {"k": 2})])
def test_rotating_strategies_train_what_they_switch_on_with_state_only_for_it(tmp_path, strategy, params):
    # the callback is given before the Trainer builds its optimizer (where LMFlow's LISA callback froze, LMFlow#726):
    # every block switched on must train from its first step, and only the trainable blocks hold Adam state
    model = tiny_bert()
    weights, state = {}, {}

    class Watch(transformers.TrainerCallback):
        def on_step_begin(self, args, state_, control, **kwargs):
            if state_.global_step == 0:
                weights[0] = [[p.detach().clone() for p in b.parameters()] for b in callback.freezer.blocks]

        def on_step_end(self, args, state_, control, **kwargs):  # before the layerfreeze callback's stage
            weights[state_.global_step] = [[p.detach().clone() for p in b.parameters()]
                                           for b in callback.freezer.blocks]
            state[state_.global_step] = {id(p) for p in callback.freezer.optimizer.state}

    callback = LayerFreezeCallback(strategy, params)
    trainer = Trainer(model=model, args=arguments(tmp_path), train_dataset=TokenDataset(),
                      callbacks=[Watch(), callback])
    trainer.train()
    assert check_rotation(callback.freezer, weights, state) >= 4
    assert len(losses(trainer)) == 12


def reentrant_checkpointing_bert():
    """A tiny BERT with reentrant gradient checkpointing and without transformers' own input-grad hook (which
    transformers >= 5 adds for ``input_ids`` models; older versions, other models and other wrappers do not)."""
    model = tiny_bert()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.disable_input_require_grads()
    return model


def test_gradient_checkpointing_with_a_frozen_prefix_still_trains_the_layers(tmp_path):
    # the fault itself (transformers #21381): reentrant checkpointing after frozen embeddings gives no gradients
    model = reentrant_checkpointing_bert()
    model.train()
    model.bert.embeddings.requires_grad_(False)
    batch = TokenDataset()[0]
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    assert model.bert.encoder.layer[0].output.dense.weight.grad is None

    grads = []

    class Grads(transformers_callback()):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append([model.bert.encoder.layer[i].output.dense.weight.grad for i in (1, 2)])

    model = reentrant_checkpointing_bert()
    trainer, callback = train(tmp_path, "static", {"k": 2}, model=model, max_steps=3, callbacks=[Grads()])
    assert callback.session.boundary is not None
    assert len(grads) == 3 and all(g is not None and float(g.abs().sum()) > 0 for step in grads for g in step)


def transformers_callback():
    from transformers import TrainerCallback

    return TrainerCallback


def test_bf16_autocast(tmp_path):
    model = tiny_bert()
    before = model.bert.embeddings.word_embeddings.weight.detach().clone()
    trainer, callback = train(tmp_path, "static", {"k": 1}, model=model, max_steps=4, bf16=True)
    assert torch.equal(before, model.bert.embeddings.word_embeddings.weight)
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in losses(trainer))


@pytest.mark.parametrize("checkpointing,form", [(False, "attach"), (True, "constructor")])
def test_torchrun_two_processes_identical_weights(tmp_path, checkpointing, form):
    cmd = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "tests" / "scripts" / "hf_ddp.py"), str(tmp_path), str(int(checkpointing)), form]
    result = run_ranks(cmd, tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["hash"] == ranks[1]["hash"]
    expected = [["freeze", 0, 2], ["freeze", 1, 3], ["thaw", 1, 6], ["freeze", 2, 10]]
    assert ranks[0]["history"] == ranks[1]["history"] == expected
    # and one for the weight frozen by hand after step 4 (tests/scripts/hf_ddp.py): without find_unused_parameters
    # (gradient checkpointing) DDP's reducer waited for its gradient ("Expected to have finished reduction")
    assert ranks[0]["rebuilds"] == 5
    assert ranks[0]["find_unused"] is (not checkpointing)
    assert ranks[0]["frozen_unchanged"] and ranks[0]["thawed_changed"] and ranks[0]["hand_unchanged"]


@pytest.mark.assets("minilm", "bbc_news")
def test_minilm_bbc_news_a_few_steps_with_a_frozen_prefix(tmp_path):
    from layerfreeze.train import assets, data
    from layerfreeze.train.loaders import load_text_model

    try:
        path = assets.minilm_dir()
        texts, labels, classes = data.load_bbc_news()
    except assets.AssetMissingError as exc:
        pytest.skip(str(exc))
    model, tokenizer = load_text_model(path, num_labels=len(classes))
    picks = list(range(0, len(texts), len(texts) // 16))[:16]
    dataset = data.TokenizedTextDataset([texts[i] for i in picks], [labels[i] for i in picks], tokenizer, 64)
    before = model.bert.encoder.layer[2].output.dense.weight.detach().clone()
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=3, per_device_train_batch_size=8,
                                                  learning_rate=5e-5),
                      train_dataset=dataset, data_collator=lambda items: {
                          k: torch.stack([it[k] for it in items]) for k in items[0] if k != "index"})
    callback = LayerFreezeCallback("static", {"k": 4}).attach(trainer)
    trainer.train()
    assert callback.freezer.frozen_blocks == ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1",
                                              "bert.encoder.layer.2"]
    assert torch.equal(before, model.bert.encoder.layer[2].output.dense.weight)
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in losses(trainer))


def test_gradual_discriminative_lr_with_one_param_group_per_block(tmp_path):
    from layerfreeze import block_param_groups, discover_blocks

    model = tiny_bert()
    optimizer = torch.optim.AdamW(block_param_groups(model, discover_blocks(model), lr=5e-3, weight_decay=0.01))
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=6), train_dataset=TokenDataset(),
                      optimizers=(optimizer, None))
    callback = LayerFreezeCallback("gradual", {"every_steps": 2}).attach(trainer)
    trainer.train()
    assert [(h["index"], h["step"]) for h in callback.freezer.history if h["kind"] == "thaw"] == [(4, 2), (3, 4),
                                                                                                  (2, 6)]
    assert trainer.lr_scheduler.base_lrs[4] == pytest.approx(5e-3 / 2.6)
    assert trainer.lr_scheduler.base_lrs[3] == pytest.approx(5e-3 / 2.6 ** 2)
    assert len(optimizer.param_groups) == 6 and len(optimizer.param_groups[0]["params"]) == 0  # embeddings frozen


def test_a_memory_budget_freezes_the_planned_prefix_and_the_peak_stays_within_it(tmp_path):
    model = tiny_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, free = train(tmp_path / "none", "none", model=tiny_bert(), max_steps=3, ledger_every=1)
    trainer = Trainer(model=model, args=arguments(tmp_path / "budget", max_steps=3), train_dataset=TokenDataset())
    callback = LayerFreezeCallback("none", ledger_every=1, memory_budget="50%").attach(trainer)
    trainer.train()
    plan = callback.memory_plan
    assert plan.none_peak_bytes == free.session.ledger.peaks.tensor.bytes  # measured on the same first batch
    assert plan.k >= 1 and callback.freezer.frozen_blocks == plan.frozen_from_start
    for name, p in model.named_parameters():
        if any(name.startswith(f"{b}.") for b in plan.frozen_from_start):
            assert torch.equal(before[name], p), name
    peak = callback.session.ledger.peaks.tensor.bytes
    assert peak <= plan.budget_bytes and abs(peak / plan.predicted_peak_bytes - 1) <= 0.10


@pytest.mark.parametrize("form", ["attach", "twice in the list"])
def test_a_callback_registered_twice_is_refused_before_the_first_step(tmp_path, form):
    # transformers warns "There is already ... in the callbacks", then calls it twice: the strategy stepped twice
    # per update (LISA switched every 2.5 steps), and a second Freezer was built over the first
    callback = LayerFreezeCallback("lisa", {"k": 5})
    trainer = Trainer(model=tiny_bert(), args=arguments(tmp_path, max_steps=4), train_dataset=TokenDataset(),
                      callbacks=[callback] if form == "attach" else [callback, callback])
    if form == "attach":
        callback.attach(trainer)
    with pytest.raises(RuntimeError, match=r"registered twice with the Trainer .* Register it once"):
        trainer.train()
    assert trainer.state.global_step == 0 and callback.freezer.closed


def test_two_callbacks_on_one_model_are_refused(tmp_path):
    first, second = LayerFreezeCallback("static", {"k": 2}), LayerFreezeCallback("lisa", {"k": 5})
    trainer = Trainer(model=tiny_bert(), args=arguments(tmp_path, max_steps=4), train_dataset=TokenDataset(),
                      callbacks=[first, second])
    with pytest.raises(RuntimeError, match=r"already has an open Freezer \(strategy 'static', on its Bert.* use one"):
        trainer.train()
    assert trainer.state.global_step == 0



def test_train_again_after_a_train_that_raised_with_the_same_callback(tmp_path):
    # HF calls no on_train_end after a train() that raised: the next train() was refused as "registered twice"
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise KeyboardInterrupt("a Ctrl-C in a notebook")

    model = tiny_bert()
    callback = LayerFreezeCallback("static", {"k": 1})
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=4), train_dataset=TokenDataset(),
                      callbacks=[callback, Interrupt()])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    first = callback.freezer
    trainer.remove_callback(Interrupt)
    trainer.train()
    assert first.closed and callback.freezer is not first and trainer.state.global_step == 4
    assert not model.bert.embeddings.word_embeddings.weight.requires_grad


@pytest.mark.parametrize("form", ["attach", "constructor"])
def test_a_second_trainer_after_a_first_ones_freezes_resumes_from_its_own_checkpoint(tmp_path, form):
    # phase 2 with a new Trainer on the model phase 1 left frozen: create_optimizer took only what required grad, the
    # take-over put the embeddings' LayerNorm and every bias into the decay group, and resuming phase 2 failed
    # ("loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
    def phase1(model):
        train(tmp_path / "p1", "static", {"k": 2}, model=model, max_steps=4)

    def phase2(model, resume=None, warned=True):
        args = arguments(tmp_path / "p2", max_steps=6, save_strategy="steps", save_steps=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(),
                              callbacks=[LayerFreezeCallback("none")] if form == "constructor" else [])
            if form == "attach":
                LayerFreezeCallback("none").attach(trainer)
        said = [str(w.message) for w in caught if "left frozen" in str(w.message)]
        assert said == (["Freezer: block(s) bert.embeddings, bert.encoder.layer.0 were left frozen by an earlier "
                         "Freezer on this model (closed, or copied with it); they are trainable again before the "
                         "optimizer is built, and the next Freezer's strategy decides anew"] if warned else [])
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    model = tiny_bert()
    phase1(model)
    full = phase2(model)
    decays = [sorted(n for n, p in model.named_parameters() if any(p is q for q in g["params"]))
              for g in full.optimizer.param_groups]
    no_decay = set(full.get_decay_parameter_names(model))
    assert decays == [sorted(no_decay), sorted(n for n, _ in model.named_parameters() if n not in no_decay)]
    for fresh in (False, True):  # the script run again (phase 1, then phase 2 resumed), or phase 2 alone
        again = tiny_bert()
        if not fresh:
            phase1(again)
        resumed = phase2(again, resume=str(tmp_path / "p2" / "checkpoint-3"), warned=not fresh)
        assert losses(resumed) == losses(full)
        for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
            assert torch.equal(a, b), name


def test_lora_after_a_freezers_run_keeps_the_base_model_frozen(tmp_path):
    # phase 1 froze two blocks; get_peft_model then froze the whole base model for LoRA, and the next Trainer's
    # callback made phase 1's blocks trainable again: 21 base tensors trained beside the adapters, in silence
    peft = pytest.importorskip("peft")
    from layerfreeze import Freezer, release_earlier_freezers

    model = tiny_bert()
    with Freezer(model, torch.optim.AdamW(model.parameters()), "static", {"k": 2}):
        pass
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["query", "value"],
                                                      modules_to_save=["classifier"]))
    trains = sorted(n for n, p in lora.named_parameters() if p.requires_grad)
    assert trains and all("lora_" in n or "modules_to_save" in n for n in trains)
    with pytest.warns(UserWarning, match=r"block\(s\) bert.embeddings, bert.encoder.layer.0 were left frozen by an "
                                         r"earlier Freezer on this model, and other parameters were frozen since it "
                                         r"closed .* they stay frozen, as yours"):
        assert release_earlier_freezers(lora) == []
    assert sorted(n for n, p in lora.named_parameters() if p.requires_grad) == trains
    base = {n: p.detach().clone() for n, p in lora.named_parameters() if not p.requires_grad}
    trainer = Trainer(model=lora, args=arguments(tmp_path, max_steps=3), train_dataset=TokenDataset())
    callback = LayerFreezeCallback("none").attach(trainer)
    trainer.train()
    assert callback.freezer.frozen_blocks == []
    assert all(torch.equal(p, base[n]) for n, p in lora.named_parameters() if n in base)  # the base did not move
    with Freezer(lora, torch.optim.AdamW(p for p in lora.parameters() if p.requires_grad), "none") as freezer:
        with pytest.raises(RuntimeError, match="already has an open Freezer"):
            release_earlier_freezers(lora)  # an open Freezer's blocks are its own
        assert not freezer.frozen[0]


def test_lora_adapters_inside_a_block_an_earlier_freezer_froze_train_after_a_thaw():
    # the take-over recorded the adapters get_peft_model put inside such a block as the user's frozen parameters: after
    # the new Freezer froze and thawed the block they stayed frozen, and the block's LoRA never trained again
    peft = pytest.importorskip("peft")
    from layerfreeze import Freezer

    model = tiny_bert()
    with Freezer(model, torch.optim.AdamW(model.parameters()), "static", {"k": 2}):
        pass
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["query", "value"]))
    adapters = sorted(n for n, p in lora.named_parameters() if "encoder.layer.0." in n and "lora_" in n)
    assert len(adapters) == 4
    optimizer = torch.optim.AdamW(p for p in lora.parameters() if p.requires_grad)
    with pytest.warns(UserWarning, match="stay frozen, as yours"):
        freezer = Freezer(lora, optimizer, "none")
    with freezer:
        block = next(b.name for b in freezer.blocks if b.name.endswith("encoder.layer.0"))
        assert freezer.freeze(block) and freezer.thaw(block)
        named = dict(lora.named_parameters())
        assert all(named[n].requires_grad for n in adapters)
        assert not any(p.requires_grad for n, p in named.items() if "encoder.layer.0." in n and "lora_" not in n)
