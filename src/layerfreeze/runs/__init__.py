"""A run, on disk and for people: the run folder's contract, the logs written into it, what was measured, and the
tables and report made from it.

* :mod:`~layerfreeze.runs.rundir` -- the run folder's layout, ``metrics.jsonl``'s record and event kinds, reading
  records back (:func:`~layerfreeze.runs.rundir.read_metrics`) and replaying a resumed run's records;
* :mod:`~layerfreeze.runs.telemetry` -- :class:`~layerfreeze.runs.telemetry.Telemetry`: ``metrics.jsonl`` and
  TensorBoard;
* :mod:`~layerfreeze.runs.measure` -- measured training FLOPs (``FlopCounterMode``), peak and current memory;
* :mod:`~layerfreeze.runs.ledger` -- the memory ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`): exact bytes
  per bucket (parameters, gradients, optimizer state, saved activations, the cache, side models), device and block;
* :mod:`~layerfreeze.runs.summary` -- numbers formatted for people, the end-of-run table;
* :mod:`~layerfreeze.runs.compare_table` -- the comparison table's ratios and cells;
* :mod:`~layerfreeze.runs.report` -- ``layerfreeze report``: the HTML + PNG report of a run or a comparison.
"""
