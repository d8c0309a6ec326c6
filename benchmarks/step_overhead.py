"""What each freezing strategy adds to a training step on a tiny model, where host work is not hidden by compute.

The issue-40 CPU proxy: a 9-block stack of tiny ``Linear`` layers (8 blocks of ``Linear(32, 32)`` + ``ReLU`` and a
``Linear(32, 10)`` head, batch 32: the model's own forward, backward and AdamW step take 0.5-1 ms on one core, mostly
per-op overhead, as a small model's step on a GPU is),
trained for ``--steps`` steps (default 168, ``total_steps`` the same, 4 epochs of 42 steps so the epoch-end
strategies stage too) with every registered strategy, ``none`` first, one after another in one process with one
thread (``torch.set_num_threads(1)``). Each strategy's run is repeated ``--repeats`` times (default 5) and the median
of the repetitions' medians is reported.

What is timed (``time.perf_counter``; the model is on the CPU, so no clock waits for a device):

* the Freezer's hooks, ``after_backward()``, its step post-hook on the optimizer (AutoFreeze's gradient sums: timed
  between two post-hooks of the benchmark's own, registered before and after it) and ``step()`` (and ``epoch_end()``
  at an epoch's end): the engine's and the strategy's per-step work, whatever the frozen set;
* the whole step (forward, loss, backward, the hooks, ``optimizer.step()``, ``zero_grad``): for reference only, as
  a strategy that freezes blocks also makes the step cheaper.

A step *with a stage* is one where the strategy decided (``stage_every`` divides the step count, or an epoch-end
stage); the others are steps without a stage. Reported, in ms:

* **step without a stage, added**: the median hooks' time of the strategy's steps without a stage minus ``none``'s
  (the target of issue 40: at most 0.02 ms for every strategy; "-" for a strategy that stages on every step);
* **stage, added**: the median hooks' time of its steps with a stage minus ``none``'s steps without one ("-" for a
  strategy that never stages after the start in this run);
* **forward, added**: the median forward time minus ``none``'s: what hooks a strategy attaches to the model cost
  (a frozen prefix also makes the forward cheaper: it builds no autograd graph, so a negative value is possible);
* the number of stages and the median whole step.

    python -m benchmarks.step_overhead                       # the table, Markdown, on stdout
    python -m benchmarks.step_overhead --strategies none,static,autofreeze --repeats 1     # a quick look

Run it alone on the machine: a few microseconds need quiet cores. Writes ``--out/results.json`` when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.cli import entry
from layerfreeze import Freezer, block_param_groups
from layerfreeze.models.discovery import discover_blocks
from layerfreeze.strategies import STRATEGIES

#: The tiny model: ``BLOCKS`` blocks of width ``WIDTH``, batch ``BATCH``, ``CLASSES`` classes.
BLOCKS, WIDTH, BATCH, CLASSES = 9, 32, 32, 10
#: Steps of a run (= ``total_steps``) and steps per epoch.
STEPS, STEPS_PER_EPOCH = 168, 42
#: Repetitions of each strategy's run (the median of their medians is reported).
REPEATS = 5


def tiny_model(seed: int = 0) -> nn.Sequential:
    """``BLOCKS - 1`` blocks of ``Linear(WIDTH, WIDTH)`` + ``ReLU`` and a ``Linear(WIDTH, CLASSES)`` head."""
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS - 1)]
    return nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))


def run(strategy: str, steps: int = STEPS, steps_per_epoch: int = STEPS_PER_EPOCH, seed: int = 0,
        params: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run of ``strategy`` (with ``params``, default its defaults) on the tiny model: per-step times (s) of the
    hooks, the forward and the whole step, split into steps with a stage and without one.

    Returns:
        ``{"hooks": {"step": [...], "stage": [...]}, "forward": [...], "whole": [...], "stages": int}``.
    """
    model = tiny_model(seed)
    blocks = discover_blocks(model)
    optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=1e-3), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(8)]
    hooks: dict[str, list[float]] = {"step": [], "stage": []}
    forward: list[float] = []
    whole: list[float] = []
    clock = time.perf_counter
    marks: list[float] = []  # around the Freezer's optimizer step post-hook (AutoFreeze reads the gradients there)
    optimizer.register_step_post_hook(lambda *_: marks.append(clock()))  # runs before the Freezer's
    with Freezer(model, optimizer, strategy, params, blocks=blocks, total_steps=steps,
                 steps_per_epoch=steps_per_epoch) as freezer:
        optimizer.register_step_post_hook(lambda *_: marks.append(clock()))  # and this one after it
        hook = freezer._grad_hook
        if hook is not None and hook.id not in optimizer._optimizer_step_post_hooks:
            raise RuntimeError("the Freezer reads the gradients in another optimizer hook than a step post-hook: "
                               "move the benchmark's marks around it, or the table leaves its cost out")
        for i in range(steps):
            x, y = data[i % len(data)]
            every = freezer.strategy.stage_every  # read before step(): a stage may change the cadence
            t0 = clock()
            loss = nn.functional.cross_entropy(model(x), y)
            t1 = clock()
            loss.backward()
            t2 = clock()
            freezer.after_backward()
            t3 = clock()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t4 = clock()
            freezer.step()
            staged = bool(every) and freezer.step_count % every == 0
            epoch_end = (i + 1) % steps_per_epoch == 0
            if epoch_end:
                staged = staged or freezer.strategy.at_epoch_end
                freezer.epoch_end()
            t5 = clock()
            in_step = marks[-1] - marks[-2]
            hooks["stage" if staged else "step"].append((t3 - t2) + in_step + (t5 - t4))
            forward.append(t1 - t0)
            whole.append(t5 - t0)
    return {"hooks": hooks, "forward": forward, "whole": whole, "stages": len(hooks["stage"])}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _median_of_medians(runs: Any) -> float | None:
    """The median of each run's median (runs without values left out); None when no run has one."""
    medians = [m for m in map(_median, runs) if m is not None]
    return statistics.median(medians) if medians else None


def measure(strategies: list[str], repeats: int = REPEATS, steps: int = STEPS,
            steps_per_epoch: int = STEPS_PER_EPOCH) -> list[dict[str, Any]]:
    """Each strategy's medians (s) over ``repeats`` runs, and what it adds to ``none`` (ms); ``none`` runs first
    (added to ``strategies`` when missing). One thread, one process, strategies one after another.

    Returns:
        One row per strategy: ``strategy``, ``stages``, ``hooks_step_s``, ``hooks_stage_s`` (None without stages),
        ``forward_s``, ``whole_s``, and ``step_added_ms``, ``stage_added_ms`` (None without stages),
        ``forward_added_ms`` against ``none``.
    """
    torch.set_num_threads(1)
    order = ["none", *[s for s in strategies if s != "none"]]
    rows = []
    for name in order:
        runs = [run(name, steps, steps_per_epoch) for _ in range(repeats)]
        rows.append({
            "strategy": name, "stages": runs[0]["stages"],
            "hooks_step_s": _median_of_medians(r["hooks"]["step"] for r in runs),
            "hooks_stage_s": _median_of_medians(r["hooks"]["stage"] for r in runs),
            "forward_s": statistics.median(_median(r["forward"]) for r in runs),
            "whole_s": statistics.median(_median(r["whole"]) for r in runs),
        })
    base = rows[0]
    for row in rows:
        row["step_added_ms"] = (None if row["hooks_step_s"] is None
                                else 1000 * (row["hooks_step_s"] - base["hooks_step_s"]))
        row["stage_added_ms"] = (None if row["hooks_stage_s"] is None
                                 else 1000 * (row["hooks_stage_s"] - base["hooks_step_s"]))
        row["forward_added_ms"] = 1000 * (row["forward_s"] - base["forward_s"])
    return [r for r in rows if r["strategy"] in strategies or r["strategy"] == "none"]


def markdown(rows: list[dict[str, Any]], repeats: int, steps: int) -> str:
    """The table (Markdown): one row per strategy."""
    head = ["strategy", "stages", "step without a stage, added ms", "stage, added ms", "forward, added ms",
            "whole step ms"]
    lines = [f"Tiny model, {BLOCKS} blocks, {steps} steps, one thread, median of {repeats}; none's hooks take "
             f"{1000 * rows[0]['hooks_step_s']:.4f} ms per step.", "",
             "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        step, stage = ("-" if r[k] is None else f"{r[k]:+.4f}" for k in ("step_added_ms", "stage_added_ms"))
        lines.append(f"| {r['strategy']} | {r['stages']} | {step} | {stage} | "
                     f"{r['forward_added_ms']:+.4f} | {1000 * r['whole_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="comma-separated registered strategies (default: all; none always runs first)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="runs per strategy (median of their medians)")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per run (= total_steps)")
    parser.add_argument("--out", help="a folder for results.json")
    args = parser.parse_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        parser.error(f"--strategies: unknown {', '.join(unknown)}; registered: {', '.join(STRATEGIES)}")
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1")
    steps_per_epoch = max(1, round(args.steps * STEPS_PER_EPOCH / STEPS))
    rows = measure(strategies, args.repeats, args.steps, steps_per_epoch)
    print(markdown(rows, args.repeats, args.steps), end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main))
