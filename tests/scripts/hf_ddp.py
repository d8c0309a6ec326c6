"""2-process transformers.Trainer under torchrun on CPU (gloo) with freezes and a thaw mid-run, optionally with
gradient checkpointing (then the Trainer sets find_unused_parameters=False), the callback attached to the Trainer
or given in its constructor (argv[3]: attach | constructor), and a weight of a training layer frozen by hand after
step 4. Each rank writes rank<r>.json into argv[1]. Launched by
tests/test_integration_hf.py."""

import json
import os
import sys
import threading
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from layerfreeze.distributed import close_distributed
from layerfreeze.integrations.hf import LayerFreezeCallback
from tests.integration_models import Scripted, TokenDataset, state_hash, tiny_bert

PLAN = {2: [("freeze", 0)], 3: [("freeze", 1)], 6: [("thaw", 1)], 10: [("freeze", 2)]}


class Record(TrainerCallback):
    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2:
            self.frozen = model.bert.embeddings.word_embeddings.weight.detach().clone()
        if state.global_step == 6:
            self.thawed = model.bert.encoder.layer[0].output.dense.weight.detach().clone()
        if state.global_step == 4:  # the user freezes a weight of layer 1, which trains, by hand
            model.bert.encoder.layer[1].output.dense.weight.requires_grad_(False)
            self.hand = model.bert.encoder.layer[1].output.dense.weight.detach().clone()


def main(out: Path, checkpointing: bool, form: str) -> None:
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, learning_rate=5e-3, max_steps=12,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             seed=0, gradient_checkpointing=checkpointing, ddp_backend="gloo")
    model = tiny_bert()
    record = Record()
    if form == "constructor":  # as HF users pass callbacks
        callback = LayerFreezeCallback(Scripted(PLAN))
        trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(96), callbacks=[record, callback])
    else:
        trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(96), callbacks=[record])
        callback = LayerFreezeCallback(Scripted(PLAN)).attach(trainer)
    trainer.train()
    ddp = trainer.model_wrapped
    (out / f"rank{args.process_index}.json").write_text(json.dumps({
        "hash": state_hash(model),
        "history": [[h["kind"], h["index"], h["step"]] for h in callback.freezer.history],
        "rebuilds": callback.session.ddp_rebuilds,
        "find_unused": bool(ddp.find_unused_parameters),
        "frozen_unchanged": torch.equal(record.frozen, model.bert.embeddings.word_embeddings.weight),
        "thawed_changed": not torch.equal(record.thawed, model.bert.encoder.layer[0].output.dense.weight),
        "hand_unchanged": torch.equal(record.hand, model.bert.encoder.layer[1].output.dense.weight)
        and not model.bert.encoder.layer[1].output.dense.weight.requires_grad,
    }))
    close_distributed()  # a rank that exits with the group alive can abort at shutdown (its docstring)


if __name__ == "__main__":
    watchdog = threading.Timer(200, lambda: os._exit(3))  # a hung rank never outlives its test
    watchdog.daemon = True
    watchdog.start()
    main(Path(sys.argv[1]), bool(int(sys.argv[2])), sys.argv[3] if len(sys.argv) > 3 else "attach")
