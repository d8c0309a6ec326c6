"""The ``layerfreeze train`` / ``compare`` path: a config, a task, and the loop that trains it with freezing.

The folder's map, one module a line, from the top down. A module imports only modules below it (the ``train-layers``
contract in ``pyproject.toml``); outside the folder, the CLI (and ``smartfrz``, tests, benchmarks) may import any.

* ``compare`` -- ``layerfreeze compare``: several rows on one task, one table; imported by no module here.
* ``trainer`` -- :class:`~layerfreeze.train.trainer.Trainer`: the run's state and its epoch loop; imported by compare.
* ``step`` -- one training step, its per-step records and checks, ``DivergenceError``; by trainer, compare.
* ``summary`` -- ``summary.json``: what a run did (cache, ledger, memory plan, ranks); by trainer.
* ``setup`` -- what a run is built from; the trainer's setup (memory plan, cache, ledger); by step, trainer, compare.
* ``checkpointing`` -- when a checkpoint is due, writing one, resuming a run from it; by step, trainer.
* ``evaluation`` -- a model's loss and metric, in one process or over ranks, and the trainer's; by trainer.
* ``ranks`` -- distributed bookkeeping (batch shares, buffer sync, rank records); by setup, evaluation, step, trainer.
* ``tasks`` -- model + data + objective per CLI task; by setup, evaluation, trainer, compare.
* ``data`` -- the text and vision datasets; by tasks.
* ``lm`` -- the language-model task's datasets, forward and next-token objective; by tasks.
* ``loaders`` -- the models, loaded from local files; by tasks.
* ``config_yaml`` -- the config as a commented YAML file (``layerfreeze config``); imported by the CLI only.
* ``config_load`` -- a config from a file and the command line's overrides (:func:`~layerfreeze.train.config_load.
  load_config`); imported by the CLI only.
* ``config`` -- the validated config's schema (:func:`~layerfreeze.train.config.build_config`); by any module above.
* ``presets`` -- what a task and a strategy on it change from the config's defaults; by config, config_yaml.
* ``config_words`` -- a config's problems in its words (one line, each naming its key, the closest valid key); by
  config, config_load, config_yaml.
* ``loop`` -- the LR schedule and the optimizer step, shared with the SmartFRZ collector; by setup, step.
* ``assets`` -- the offline assets (where they are, whether they are there); by data, loaders, tasks.
"""
