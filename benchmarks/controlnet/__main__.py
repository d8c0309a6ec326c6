"""A ControlNet trained beside a frozen VAE, text encoder and UNet, under four placements; one table.

Stage 1 (trained here, cached with checksums under ``--cache-dir``; about 5 minutes on 2 cores the first time):
a tiny AutoencoderKL on Fashion-MNIST (32x32, padded), then a tiny UNet2DConditionModel (cross_attention_dim=384)
on its latents with class-name prompts encoded by the frozen MiniLM-L6. Stage 2: ``ControlNetModel.from_unet``
trained on Sobel edge maps for ``--steps`` steps of ``--batch-size`` under each placement (see
:mod:`benchmarks.controlnet`): frozen models on the trainer's device; in a worker; precomputed (VAE latent
distribution + prompt embeddings); frozen models in bfloat16. Prints the table and writes ``results.json``,
``table.md`` and ``report/index.html`` (with the loss curves) to ``--out``.

    python -m benchmarks.controlnet                      # the full demo, about 11 minutes on 2 CPU cores
    python -m benchmarks.controlnet --tiny --steps 4     # CI size: untrained tiny models (the pipeline, not quality)
    python -m benchmarks.controlnet --device cuda:0 --frozen-device cuda:1   # on two GPUs
"""

from __future__ import annotations

import argparse
import re
import time

import torch

from benchmarks.controlnet import PLACEMENTS, DemoConfig, run_demo


def main(argv: list[str] | None = None) -> dict:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.controlnet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="ControlNet steps per placement")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--train-size", type=int, default=defaults.train_size)
    parser.add_argument("--heldout-size", type=int, default=defaults.heldout_size)
    parser.add_argument("--vae-steps", type=int, default=defaults.vae_steps)
    parser.add_argument("--unet-steps", type=int, default=defaults.unet_steps)
    parser.add_argument("--stage1-size", type=int, default=defaults.stage1_size, help="images stage 1 trains on")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--device", default=defaults.device, help="the trainer's (ControlNet's) device")
    parser.add_argument("--frozen-device", help="the frozen models' device (default: the trainer's)")
    parser.add_argument("--placements", default=",".join(PLACEMENTS),
                        help=f"comma-separated, from {','.join(PLACEMENTS)}; the first is the reference")
    parser.add_argument("--threads", type=int, help="intra-op threads of the trainer (default: PyTorch's)")
    parser.add_argument("--pipeline-threads", default="auto",
                        help="worker,trainer intra-op threads of the worker placement (default auto: split the cores)")
    parser.add_argument("--tiny", action="store_true",
                        help="CI size: untrained tiny models, random data (checks the pipeline, not the quality)")
    parser.add_argument("--cache-dir", default=defaults.cache_dir, help="stage-1 model cache")
    parser.add_argument("--out", default="runs/controlnet-demo")
    args = parser.parse_args(argv)
    for flag, device in (("--device", args.device), ("--frozen-device", args.frozen_device)):
        if device is None:
            continue
        try:  # checked before stage 1 trains: a bad device string failed after minutes, in torch's words
            kind = torch.device(device).type
        except RuntimeError as exc:
            parser.error(f"{flag} {device!r} is not a device ({exc}); use cpu or cuda:N")
        if kind == "cuda" and not torch.cuda.is_available():
            parser.error(f"{flag} {device}: CUDA is not available on this machine; use cpu")
    if args.pipeline_threads != "auto" and not re.fullmatch(r"[1-9][0-9]*,[1-9][0-9]*", args.pipeline_threads):
        parser.error(f"--pipeline-threads {args.pipeline_threads!r}: give auto or WORKER,TRAINER (two counts >= 1, "
                     "e.g. 1,1)")
    try:
        cfg = DemoConfig(steps=args.steps, batch_size=args.batch_size, train_size=args.train_size,
                         heldout_size=args.heldout_size, vae_steps=args.vae_steps, unet_steps=args.unet_steps,
                         stage1_size=args.stage1_size,
                         lr=args.lr, seed=args.seed, device=args.device, frozen_device=args.frozen_device,
                         placements=tuple(p.strip() for p in args.placements.split(",") if p.strip()),
                         threads=args.threads, tiny=args.tiny, cache_dir=args.cache_dir,
                         pipeline_threads=args.pipeline_threads if args.pipeline_threads == "auto"
                         else tuple(int(n) for n in args.pipeline_threads.split(",")))
    except ValueError as exc:  # an unknown placement, pipeline threads that are not two counts
        parser.error(str(exc))
    start = time.perf_counter()
    result = run_demo(cfg, out=args.out, log=lambda m: print(m, flush=True))
    print(result["table"])
    print("\nmemory per device (memory ledger, each bucket's peak over the steps):")
    print(result["memory_table"])
    print(f"held-out denoising loss without control: {result['heldout_no_control']:.4f}; "
          f"total {time.perf_counter() - start:.0f} s; written to {args.out}/ (report/index.html)")
    return result


if __name__ == "__main__":
    main()
