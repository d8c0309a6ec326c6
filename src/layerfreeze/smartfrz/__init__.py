"""The SmartFRZ predictor's offline pipeline: research code that imports the library and is never imported by it.

``layerfreeze predictor collect -> label -> train (-> evaluate, counterfactual, calibrate)``:

* :mod:`~layerfreeze.smartfrz.setup` / :mod:`~layerfreeze.smartfrz.recipes` -- what one run trains (the registered
  recipes: datasets, networks, settings);
* :mod:`~layerfreeze.smartfrz.collect` -- record runs to the end (weight samples, probe activations);
* :mod:`~layerfreeze.smartfrz.labels` -- CKA labels: when each block's representation has converged;
* :mod:`~layerfreeze.smartfrz.fit` -- train and evaluate a predictor on labelled windows;
  :mod:`~layerfreeze.smartfrz.lofo` -- leave one architecture family out; :mod:`~layerfreeze.smartfrz.ship` --
  the predictor file and its card (:mod:`~layerfreeze.smartfrz.card`);
* :mod:`~layerfreeze.smartfrz.counterfactual` -- what freezing at step t really costs, to check the labels;
  :mod:`~layerfreeze.smartfrz.cflabels` -- CKA labels corrected by those costs (``label --counterfactual``);
* :mod:`~layerfreeze.smartfrz.runs` -- the runs folder's format;
* :mod:`~layerfreeze.smartfrz.parser` -- the CLI's arguments; :mod:`~layerfreeze.smartfrz.cli` -- its commands.

The strategy that uses the shipped predictor at run time is :mod:`layerfreeze.strategies.smartfrz`.
"""
