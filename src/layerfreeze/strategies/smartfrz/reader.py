"""One read per stage: SmartFRZ's sampled values gathered on the training device and brought to the host in one copy,
without a host synchronisation.

At a stage SmartFRZ reads, for every active block, the weights at the recorder's sampled positions and, for the
gradient signal-to-noise gate, Adam's two moments at the same positions (issue 40). Read as the recorder used to
read them -- one ``index_select`` per parameter into a host buffer, i.e. one device-to-host copy each -- every copy
of a CUDA tensor blocks the host until the device has finished everything queued before it (the copy is
synchronous), so a stage drained the GPU's queue about a hundred times and the CPU could no longer run ahead of the
GPU: on an H200 the default job's median step went from 19 ms to 29 ms while SmartFRZ was deciding.

:class:`StageReader` does the same reads with **no synchronisation**:

1. every pick ``(source tensor, positions, row, start)`` is gathered *on the source's device* into one preallocated
   ``(rows, width)`` float32 buffer (``index_select(..., out=)``: no temporaries; the positions are moved to the
   device once and kept), scalars (Adam's ``step`` when it lives on the device, as with ``fused=True``) into its
   last row;
2. the whole buffer goes to a pinned host buffer in **one** ``non_blocking`` copy, and a CUDA event is recorded
   behind it (:class:`Read`);
3. the caller reads the values at the *next* stage (:meth:`Read.settle`): by then the copy finished long ago, so
   waiting on the event costs nothing.

On the CPU the gathers write straight into the host buffer and the read is ready at once, so on the CPU the values,
and every decision made from them, are bitwise what they were before (a test checks it). On an accelerator other
than CUDA (``mps``, ``xpu``) the copy is a plain one (no pinned memory, no events there): correct, with the
synchronisation the copy implies.

The memory it holds on the device -- the gather buffer and the positions -- is what :meth:`held_tensors` lists for
the memory ledger's ``strategy`` bucket: about ``12 * rows * width`` bytes (float32 values, int64 positions), e.g.
0.1 MiB for MiniLM-L6's 8 blocks at 1,024 samples, never a copy of a whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Pick", "Read", "StageReader"]


@dataclass(frozen=True)
class Pick:
    """Sampled values of one tensor that go into one row of a read.

    Attributes:
        source: The tensor read (any shape, contiguous or not; read as ``source.reshape(-1)``).
        positions: ``(n,)`` int64 flat positions into ``source.reshape(-1)``, on the CPU.
        row: Row of the read's ``(rows, width)`` buffer the values go to.
        start: Column of that row where the ``n`` values start.
    """

    source: torch.Tensor
    positions: torch.Tensor
    row: int
    start: int


@dataclass
class Read:
    """A launched read: the values of every pick, in rows, once :meth:`settle` returns.

    Attributes:
        values: ``(rows, width)`` float32 on the host (pinned for a CUDA read); zero where no pick wrote.
        scalars: The scalars of the read, as floats, once settled.
        event: CUDA event recorded after the copy (None: the values are there already).
        deferred: The caller should use the values at its next stage, not now (a CUDA read, or any read of a
            reader made with ``defer=True``); until then no other read of the same reader may be launched.
    """

    values: torch.Tensor
    scalars: list[float] = field(default_factory=list)
    event: torch.cuda.Event | None = None
    deferred: bool = False
    _pending_scalars: torch.Tensor | None = None

    @property
    def ready(self) -> bool:
        """True when :meth:`settle` will not wait (never synchronises: ``event.query()``)."""
        return self.event is None or bool(self.event.query())

    def settle(self) -> Read:
        """Wait for the copy (a no-op when it is done: the caller settles a read one stage after launching it) and
        fill :attr:`scalars`; returns self."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        if self._pending_scalars is not None:
            self.scalars = [float(x) for x in self._pending_scalars.tolist()]  # host memory: no device sync
            self._pending_scalars = None
        return self


class StageReader:
    """Gathers picks of tensors on their device into one buffer and brings it to the host in one copy.

    Args:
        rows: Rows of a read (the caller's layout: e.g. one per block for weights, two more per block for Adam's
            moments).
        width: Values per row (SmartFRZ's ``sample_size``).
        max_scalars: Scalars a read may carry besides its rows (read on the device into an extra row), ``<= width``.
        defer: Mark every read deferred (:attr:`Read.deferred`), also on the CPU: a CPU run then uses its reads a
            stage late, as a CUDA run does (for tests and comparisons); None (default): deferred on CUDA only.

    A read's values live in the reader's buffers until its next launch: use them (or copy them) before that.

    Shapes: a read's :attr:`Read.values` is ``(rows, width)`` float32.

    Raises:
        ValueError: ``rows < 1``, ``width < 1`` or ``max_scalars`` outside ``[0, width]``.
    """

    def __init__(self, rows: int, width: int, max_scalars: int = 0, defer: bool | None = None) -> None:
        if rows < 1 or width < 1 or not 0 <= max_scalars <= width:
            raise ValueError(f"StageReader: rows and width must be >= 1 and max_scalars in [0, width], got "
                             f"{rows}, {width}, {max_scalars}")
        self.rows, self.width, self.max_scalars, self.defer = rows, width, max_scalars, defer
        self._host_cpu = torch.zeros(rows, width)  # the CPU path's buffer (gathers write here directly)
        self._device: dict[torch.device, torch.Tensor] = {}  # per device: (rows + 1, width) gather buffer
        self._pinned: dict[torch.device, torch.Tensor] = {}  # per CUDA device: its pinned host twin
        self._positions: dict[tuple[int, torch.device], torch.Tensor] = {}  # positions moved to a device, once

    def launch(self, picks: list[Pick], scalars: list[torch.Tensor | float] = ()) -> Read:
        """Gather ``picks`` and ``scalars`` and start bringing them to the host; never synchronises on a device.

        All picks of a read must be on one device (the CPU or one accelerator); scalars are numbers, CPU tensors or
        one-element tensors on that device.

        Raises:
            ValueError: picks on more than one device, a pick outside ``(rows, width)``, or more scalars than
                ``max_scalars``.
        """
        if len(scalars) > self.max_scalars:
            raise ValueError(f"StageReader: {len(scalars)} scalars, at most {self.max_scalars}")
        devices = {p.source.device for p in picks}
        if len(devices) > 1:
            raise ValueError(f"StageReader: one read per device, got picks on {sorted(map(str, devices))}")
        device = devices.pop() if devices else torch.device("cpu")
        with torch.no_grad():
            read = self._launch_cpu(picks, scalars) if device.type == "cpu" else self._launch_device(device, picks,
                                                                                                    scalars)
        read.deferred = read.event is not None if self.defer is None else bool(self.defer)
        return read

    def _check(self, pick: Pick) -> None:
        n = pick.positions.numel()
        if not (0 <= pick.row < self.rows and 0 <= pick.start and pick.start + n <= self.width):
            raise ValueError(f"StageReader: a pick of {n} values at row {pick.row}, column {pick.start} does not fit "
                             f"({self.rows}, {self.width})")

    def _launch_cpu(self, picks: list[Pick], scalars: list[torch.Tensor | float]) -> Read:
        out = self._host_cpu
        out.zero_()
        for pick in picks:
            self._check(pick)
            flat = pick.source.reshape(-1)
            dst = out[pick.row, pick.start:pick.start + pick.positions.numel()]
            if flat.dtype == out.dtype:
                torch.index_select(flat, 0, pick.positions, out=dst)  # the recorder's read before issue 40, bitwise
            else:
                dst.copy_(flat[pick.positions])
        return Read(values=out, scalars=[float(s) for s in scalars])

    def _launch_device(self, device: torch.device, picks: list[Pick], scalars: list[torch.Tensor | float]) -> Read:
        buf = self._device.get(device)
        if buf is None:
            buf = self._device[device] = torch.zeros(self.rows + 1, self.width, device=device)
        buf.zero_()
        for pick in picks:
            self._check(pick)
            key = (id(pick.positions), device)
            idx = self._positions.get(key)
            if idx is None:
                idx = self._positions[key] = pick.positions.to(device)
            flat = pick.source.reshape(-1)
            dst = buf[pick.row, pick.start:pick.start + idx.numel()]
            if flat.dtype == buf.dtype:
                torch.index_select(flat, 0, idx, out=dst)
            else:
                dst.copy_(flat.index_select(0, idx))
        host_scalars: list[float] = []
        on_device = [s for s in scalars if isinstance(s, torch.Tensor) and s.device.type != "cpu"]
        if on_device and len(on_device) != len(scalars):
            raise ValueError("StageReader: scalars of one read are all on the device or all on the host")
        if on_device:
            buf[self.rows, :len(on_device)].copy_(torch.stack([s.reshape(()).float() for s in on_device]))
        else:
            host_scalars = [float(s) for s in scalars]  # numbers or CPU tensors: no device sync
        if device.type != "cuda":  # mps, xpu: no pinned memory / events here; a plain (synchronising) copy
            host = buf.to("cpu")
            read = Read(values=host[: self.rows], scalars=host_scalars)
            if on_device:
                read.scalars = [float(x) for x in host[self.rows, :len(on_device)].tolist()]
            return read
        pinned = self._pinned.get(device)
        if pinned is None:
            pinned = self._pinned[device] = torch.zeros(self.rows + 1, self.width, pin_memory=True)
        pinned.copy_(buf, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        read = Read(values=pinned[: self.rows], scalars=host_scalars, event=event)
        if on_device:
            read._pending_scalars = pinned[self.rows, :len(on_device)]
        return read

    def forget_positions(self) -> None:
        """Drop the positions kept on devices (the picks' position tensors changed)."""
        self._positions.clear()

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors this reader holds: the gather buffers and positions on the devices, the host buffers (for
        the memory ledger's ``strategy`` bucket)."""
        return [self._host_cpu, *self._device.values(), *self._pinned.values(), *self._positions.values()]
