"""Freezing in your own data-parallel loop: ``torchrun --nproc_per_node 2 examples/ddp_own_loop.py``.

Options: ``--strategy NAME -p key=value`` (default: smartfrz), ``--epochs N`` (default 8: 128 steps on 2 ranks, where
smartfrz freezes 5 of the 6 hidden blocks from step ~100), ``--save DIR`` (each rank writes its final weights).

A small MLP on synthetic data, so it runs anywhere: ``rank_device()`` puts each rank on its own GPU
(``cuda:LOCAL_RANK``, NCCL) or on the CPU without CUDA (gloo), and refuses a node with fewer GPUs than ranks
(``--device cpu`` trains on the CPU there). What layerfreeze adds to a plain DDP
loop is three lines: the Freezer (rank 0 decides, every rank applies), ``FreezeDDP`` instead of
``DistributedDataParallel`` (rebuilt around the trainable blocks on every freeze/thaw, no
``find_unused_parameters``), and ``freezer.step()`` after the optimizer; ``close_distributed()`` at the end is the
``destroy_process_group`` every DDP program calls. Prints, on rank 0, when each block froze
and the gradient bytes all-reduced per step before and after.
"""

import argparse
from pathlib import Path

import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from layerfreeze import Freezer, block_param_groups, discover_blocks
from layerfreeze.distributed import close_distributed, init_distributed, rank, rank_device
from layerfreeze.distributed.ddp import FreezeDDP
from layerfreeze.strategies.registry import create_strategy

cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
cli.add_argument("--strategy", default="smartfrz")
cli.add_argument("-p", "--param", action="append", default=[], help="strategy parameter key=value")
cli.add_argument("--save", type=Path, help="folder for each rank's final weights")
cli.add_argument("--epochs", type=int, default=8, help="(smartfrz freezes its first blocks after about 100 steps)")
cli.add_argument("--device", default="auto", help="auto (a GPU per rank, else the CPU), cpu, cuda")
args = cli.parse_args()
params = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.param)}

try:                                                         # bad input: one line, before any rank joins
    create_strategy(args.strategy, params)                   # the name and its parameters
    device = rank_device(args.device)                        # cuda:LOCAL_RANK, or the CPU
except ValueError as exc:                                    # UserError, a parameter out of range
    cli.error(str(exc))
if not init_distributed(device=device):                      # joins torchrun's process group (NCCL or gloo)
    cli.error("run it under torchrun: torchrun --nproc_per_node 2 examples/ddp_own_loop.py")
torch.manual_seed(0)                                         # the same initial weights on every rank
x, y = torch.randn(512, 32), torch.randint(0, 4, (512,))
data = TensorDataset(x + y[:, None].float(), y)
model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(6)], nn.Linear(32, 4)).to(device)
sampler = DistributedSampler(data, shuffle=True, seed=0)    # each rank its shard
loader = DataLoader(data, batch_size=16, sampler=sampler)
epochs = args.epochs
blocks = discover_blocks(model)
optimizer = torch.optim.AdamW(block_param_groups(model, blocks, lr=3e-3))
bytes_per_step = []
with Freezer(model, optimizer, args.strategy, params, blocks=blocks, total_steps=epochs * len(loader)) as freezer:
    ddp = FreezeDDP(model, freezer)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            loss = nn.functional.cross_entropy(ddp(xb), yb)
            loss.backward()
            freezer.after_backward()                         # only gradient-based strategies need it
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            freezer.step()
            bytes_per_step.append(ddp.bytes_per_step())
        freezer.epoch_end()
if rank() == 0:
    for h in freezer.history:
        print(f"step {h['step']:>3}: {h['kind']} block {h['block']}")
    print(f"gradient bytes all-reduced per step: first {bytes_per_step[0]:,}, last {bytes_per_step[-1]:,}; "
          f"{ddp.rebuilds} DDP builds")
if args.save:
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.save / f"rank{rank()}.pt")
close_distributed()                                          # barrier, then destroy_process_group before exit
