"""Tiny models, data and a scripted strategy for the Lightning / Hugging Face / accelerate integration tests (also
imported by the 2-process scripts in ``tests/scripts/``)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from layerfreeze.strategies import Decision, StageContext, Strategy


class Scripted(Strategy):
    """A strategy with a known answer: ``plan`` maps an optimizer step to ``[("freeze"|"thaw", block index), ...]``
    (step 0: the start stage). Asked every step, so the test knows exactly when each block must freeze or thaw."""

    name = "scripted"

    def __init__(self, plan: dict[int, list[tuple[str, int]]]) -> None:
        super().__init__()
        self.plan = {int(k): [tuple(a) for a in v] for k, v in plan.items()}
        self.stage_every = 1
        self.stages = 0

    def decide(self, ctx: StageContext) -> Decision:
        self.stages += 1
        actions = self.plan.get(ctx.step, [])
        return Decision(freeze=[i for a, i in actions if a == "freeze"], thaw=[i for a, i in actions if a == "thaw"],
                        reason=f"scripted step {ctx.step}")

    def state_dict(self) -> dict[str, Any]:
        return {"stages": self.stages}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stages = state["stages"]


def frozen_during(history: list[dict[str, Any]], num_blocks: int, step: int) -> list[bool]:
    """The frozen set during optimizer step ``step`` (1-based), from a freezer's history: the events of the stages
    after steps ``< step`` (the start stage is step 0), in order."""
    frozen = [False] * num_blocks
    for event in history:
        if event["step"] < step:
            frozen[event["index"]] = event["kind"] == "freeze"
    return frozen


def check_rotation(freezer: Any, weights: dict[int, list[list[torch.Tensor]]],
                   state: dict[int, set[int]]) -> int:
    """For a run of a rotating strategy (``lisa``, ``badam``) in a framework: ``weights[t]`` (every block's
    parameters after step ``t``, ``t = 0`` before the first) and ``state[t]`` (the ids of the parameters with
    optimizer state after step ``t``). A block trainable in a step changed in it, a frozen one is bitwise unchanged,
    and optimizer state exists for exactly the blocks trainable in that step. Returns the number of switches."""
    n = len(freezer.blocks)
    steps = sorted(t for t in weights if t > 0)
    for t in steps:
        frozen = frozen_during(freezer.history, n, t)
        for i in range(n):
            same = all(torch.equal(a, b) for a, b in zip(weights[t][i], weights[t - 1][i]))
            assert same == frozen[i], f"step {t}, block {freezer.blocks[i].name}: frozen {frozen[i]}"
        held = {id(p) for i in range(n) if not frozen[i] for p in freezer.blocks[i].parameters()}
        assert state[t] == held, f"step {t}: optimizer state for other blocks than the trainable ones"
    return len({e["step"] for e in freezer.history if e["kind"] == "thaw"})


def mlp(seed: int = 0, width: int = 16) -> nn.Sequential:
    """Four blocks (Linear layers) front to back, the last one the head: 8 features -> 3 classes."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))


def blobs(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of 8 features in 3 classes (fixed)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    centers = torch.randn(3, 8, generator=torch.Generator().manual_seed(1)) * 2
    return centers[y] + torch.randn(n, 8, generator=g), y


def state_hash(module: nn.Module) -> str:
    """SHA-256 of a module's state_dict (names and exact bytes), to compare ranks."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def tiny_bert(seed: int = 0, layers: int = 3, num_labels: int = 3) -> nn.Module:
    """A randomly initialised BertForSequenceClassification from a config (no download): blocks embeddings,
    ``layers`` encoder layers, pooler, classifier."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=num_labels,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


class TokenDataset(torch.utils.data.Dataset):
    """``n`` random token sequences of length 12 whose label is the first token mod 3 (fixed)."""

    def __init__(self, n: int = 48, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 64, (n, 12), generator=g)
        self.labels = self.ids[:, 0] % 3

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(12, dtype=torch.long), "labels": self.labels[i]}


def run_ranks(cmd: list[str], cwd: Any, timeout: float) -> Any:
    """Run a multi-process launch in its own process group, killing the whole group (every rank) on timeout, so a
    hung rank never outlives the test. Returns the ``CompletedProcess``; raises ``subprocess.TimeoutExpired``."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, *cmd], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def free_port() -> int:
    """A TCP port free on this machine now (for torchrun's rendezvous; port 0 does not work there)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
