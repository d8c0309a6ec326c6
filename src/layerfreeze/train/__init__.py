"""The ``layerfreeze train`` / ``compare`` path: a config, a task, and the loop that trains it with freezing.

* :mod:`~layerfreeze.train.config` -- the validated YAML/TOML config (:func:`~layerfreeze.train.config.load_config`);
* :mod:`~layerfreeze.train.assets`, :mod:`~layerfreeze.train.data`, :mod:`~layerfreeze.train.loaders` -- the offline
  assets, the datasets, the models loaded from local files;
* :mod:`~layerfreeze.train.tasks`, :mod:`~layerfreeze.train.lm` -- model + data + objective per CLI task;
* :mod:`~layerfreeze.train.setup` -- what a run is built from (seed, device, strategy, optimizer, LR schedule, epoch
  batches, hold-out split); :mod:`~layerfreeze.train.loop` -- the LR schedule and the optimizer step;
* :mod:`~layerfreeze.train.evaluation` -- a model's loss and metric on a dataset, in one process or over ranks;
* :mod:`~layerfreeze.train.trainer` -- :class:`~layerfreeze.train.trainer.Trainer`: the train/eval loop
  (checkpoints, resume, Ctrl-C, telemetry, summary), readable in one sitting;
* :mod:`~layerfreeze.train.compare` -- ``layerfreeze compare``: several rows on one task, one table.
"""
