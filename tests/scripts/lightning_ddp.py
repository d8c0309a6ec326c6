"""2-process Lightning DDP on CPU (gloo) with a freeze and a thaw mid-run, and a weight of a training block frozen by
hand after step 3 (in a callback that runs after LayerFreeze's); each rank writes rank<r>.json into the
folder given as argv[1]. Launched by tests/test_integration_lightning.py (Lightning re-runs this script for rank 1).
"""

import json
import os
import sys
import threading
from pathlib import Path

import lightning.pytorch as L
import torch
from torch import nn

from layerfreeze.distributed import close_distributed
from layerfreeze.integrations.lightning import LayerFreeze
from tests.integration_models import Scripted, blobs, mlp, state_hash


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class Record(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step == 2:
            self.frozen0 = pl_module.net[0].weight.detach().clone()
        if trainer.global_step == 5:
            self.thawed = pl_module.net[2].weight.detach().clone()
        if trainer.global_step == 3:  # the user freezes a weight of block 2, which trains, by hand
            pl_module.net[4].weight.requires_grad_(False)
            self.hand = pl_module.net[4].weight.detach().clone()


def main(out: Path) -> None:
    torch.set_num_threads(1)
    x, y = blobs(128)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)
    callback = LayerFreeze(Scripted({2: [("freeze", 0)], 3: [("freeze", 1)], 5: [("thaw", 1)]}), submodule="net")
    record = Record()
    module = Module()
    trainer = L.Trainer(max_steps=8, accelerator="cpu", devices=2, strategy="ddp", callbacks=[callback, record],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=out)
    trainer.fit(module, loader)
    net = module.net
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "hash": state_hash(net),
        "history": [[h["kind"], h["index"], h["step"]] for h in callback.freezer.history],
        "rebuilds": callback.session.ddp_rebuilds,
        "frozen_unchanged": torch.equal(record.frozen0, net[0].weight),
        "thawed_changed": not torch.equal(record.thawed, net[2].weight),
        "hand_unchanged": torch.equal(record.hand, net[4].weight) and not net[4].weight.requires_grad,
    }))
    close_distributed()  # a rank that exits with the group alive can abort at shutdown (its docstring)


if __name__ == "__main__":
    watchdog = threading.Timer(200, lambda: os._exit(3))  # a hung rank never outlives its test
    watchdog.daemon = True
    watchdog.start()
    main(Path(sys.argv[1]))
