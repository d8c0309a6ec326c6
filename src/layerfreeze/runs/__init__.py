"""A run, on disk and for people: the run folder's contract, the logs written into it, what was measured, and the
tables and report made from it.

The map, one line per module: what it holds and who may import it. The modules are listed top to bottom; inside the
folder a module imports only modules listed below it (the ``runs-layers`` contract in ``pyproject.toml``; modules on
one line of that contract import nothing from each other). Outside the folder, every layer of the package above
``layerfreeze.runs`` (all but the registries, errors and version) may import it.

* :mod:`~layerfreeze.runs.report` -- ``layerfreeze report``: the HTML + PNG report of a run or a comparison; imported
  by the CLI;
* :mod:`~layerfreeze.runs.compare_table` -- the comparison table's ratios and cells; imported by ``report`` and
  ``layerfreeze.train.compare``;
* :mod:`~layerfreeze.runs.telemetry` -- :class:`~layerfreeze.runs.telemetry.Telemetry`: ``metrics.jsonl`` and
  TensorBoard; imported by the trainer and the integrations;
* :mod:`~layerfreeze.runs.summary` -- numbers formatted for people, the end-of-run table; imported by
  ``compare_table``, ``report``, the CLI, the trainer and the memory budget;
* :mod:`~layerfreeze.runs.ledger` -- the memory ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`), which wires
  the three ``ledger_*`` modules into a training step; its ``__all__`` also names their public records and buckets.
  Imported by the package root, the trainer, the integrations and the memory budget;
* :mod:`~layerfreeze.runs.ledger_records` -- the ledger's records: a sampled step's
  (:class:`~layerfreeze.runs.ledger_records.LedgerSnapshot`), the run's peaks, what changed between two snapshots;
  imported by ``ledger`` and the trainer;
* :mod:`~layerfreeze.runs.ledger_counting` -- the ledger's accounting: each storage once per device, saved tensors,
  optimizer state (optimizers unwrapped), byte sources, the CUDA allocator's figures; imported by ``ledger`` and the
  memory budget;
* :mod:`~layerfreeze.runs.ledger_buckets` -- the ledger's buckets (:class:`~layerfreeze.runs.ledger_buckets.Bucket`,
  with the table of what each counts), their labels and order, ``DISK``, what a byte source reports; imported by
  every module that reports or reads bytes per bucket (``compute``, ``engine.demote``, ``budget``, ``summary``,
  ``report``);
* :mod:`~layerfreeze.runs.measure` -- measured training FLOPs (``FlopCounterMode``'s count), peak and current
  memory; imported by the trainer;
* :mod:`~layerfreeze.runs.rundir` -- the run folder's layout, ``metrics.jsonl``'s record and event kinds, reading
  records back (:func:`~layerfreeze.runs.rundir.read_metrics`) and replaying a resumed run's records; imported by
  ``telemetry``, ``compare_table``, ``report``, the CLI, the trainer and the checkpoints;
* :mod:`~layerfreeze.runs.flops` -- the FLOP counter (:class:`~layerfreeze.runs.flops.TotalFlopCounter`:
  ``FlopCounterMode``'s total at less cost) and layerfreeze's formulas over torch's; imported by ``measure``.
"""
