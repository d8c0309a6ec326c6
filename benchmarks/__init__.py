"""The scripts behind every number in BENCHMARKS.md and the README, each printing its table.

Run them from the repository root as modules (``python -m benchmarks.suite``, ``python -m benchmarks.controlnet``);
they import each other as ``benchmarks.<name>`` and use only the library's public API. Besides the scripts:
:mod:`benchmarks.oracle` (the CKA oracle: when each block's representation converged, known only after a full run)
and :mod:`benchmarks.controlnet` (the ControlNet demo's models, data, placements and report).
"""
