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
   device once and kept, and so are each pick's view of its source and slice of the buffer, while the source's
   memory stays where it is: a stage then costs one ``index_select`` per pick), scalars (Adam's ``step`` when it
   lives on the device, as with ``fused=True``) into its last row;
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
from typing import NamedTuple

import torch

__all__ = ["Pick", "Read", "StageReader"]


class Pick(NamedTuple):
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
        values: ``(rows, width)`` float32 on the host, zero where no pick wrote; valid after :meth:`settle`.
        scalars: The read's scalars, as floats, in the order given to :meth:`StageReader.launch`; valid after
            :meth:`settle`.
        deferred: The caller should use the values at its next stage, not now (a CUDA read, or any read of a
            reader made with ``defer=True``); until then no other read of the same reader may be launched.
    """

    values: torch.Tensor
    scalars: list[float] = field(default_factory=list)
    deferred: bool = False
    # per device read, its ``(rows + 1, width)`` host buffer (the last row: scalars) and the CUDA event recorded
    # after its copy (None: already there); several parts (picks on several devices) add up (each position is
    # written by one device only, the others hold zeros there)
    _parts: list[tuple[torch.Tensor, torch.cuda.Event | None]] = field(default_factory=list)
    _device_scalars: list[int] = field(default_factory=list)  # which scalars were read on a device

    @property
    def ready(self) -> bool:
        """True when :meth:`settle` will not wait (never synchronises: ``event.query()``)."""
        return all(event is None or bool(event.query()) for _, event in self._parts)

    def settle(self) -> Read:
        """Wait for the copies (a no-op when they are done: the caller settles a read one stage after launching it)
        and fill :attr:`values` and :attr:`scalars`; returns self."""
        if not self._parts:
            return self
        for _, event in self._parts:
            if event is not None:
                event.synchronize()
        hosts = [host for host, _ in self._parts]
        total = hosts[0] if len(hosts) == 1 else torch.stack(hosts).sum(0)
        self.values = total[:-1]
        if self._device_scalars:
            row = total[-1].tolist()  # host memory: no device sync
            for j in self._device_scalars:
                self.scalars[j] = float(row[j])
        self._parts, self._device_scalars = [], []
        return self


class _Gather(NamedTuple):
    """How a :class:`StageReader` reads one pick: ``source`` at ``positions`` (on its device) into ``dst``.

    Attributes:
        pick: The pick.
        ptr: ``pick.source.data_ptr()`` when this was made (another value: its memory moved, made again).
        device: The source's device.
        flat: ``pick.source.view(-1)`` for a contiguous source, else None (reshaped, a copy, at each read).
        positions: ``pick.positions`` on ``device``.
        dst: The pick's slice of the device's buffer (``(n,)`` float32).
        same_dtype: The source is float32 (``index_select`` writes into ``dst`` directly).
    """

    pick: Pick
    ptr: int | None
    device: torch.device
    flat: torch.Tensor | None
    positions: torch.Tensor
    dst: torch.Tensor
    same_dtype: bool


class StageReader:
    """Gathers picks of tensors on their device into one buffer and brings it to the host in one copy.

    Args:
        rows: Rows of a read (the caller's layout: e.g. one per block for weights, two more per block for Adam's
            moments).
        width: Values per row (SmartFRZ's ``sample_size``).
        max_scalars: Scalars a read may carry besides its rows (read on the device into an extra row), ``<= width``.
        defer: Mark every read deferred (:attr:`Read.deferred`), also on the CPU: a CPU run then uses its reads a
            stage late, as a CUDA run does (for tests and comparisons); None (default): deferred when a pick or a
            scalar is on a CUDA device.

    A read's values live in the reader's buffers until its next launch: use them (or copy them) before that. Picks
    on several devices (a model split over GPUs, an optimizer state kept on the host) are read per device, one copy
    each, and added up on the host.

    Shapes: a read's :attr:`Read.values` is ``(rows, width)`` float32.

    Raises:
        ValueError: ``rows < 1``, ``width < 1`` or ``max_scalars`` outside ``[0, width]``.
    """

    def __init__(self, rows: int, width: int, max_scalars: int = 0, defer: bool | None = None) -> None:
        if rows < 1 or width < 1 or not 0 <= max_scalars <= width:
            raise ValueError(f"StageReader: rows and width must be >= 1 and max_scalars in [0, width], got "
                             f"{rows}, {width}, {max_scalars}")
        self.rows, self.width, self.max_scalars, self.defer = rows, width, max_scalars, defer
        self._host_cpu = torch.zeros(rows + 1, width)  # the CPU's part: gathers write here directly
        self._device: dict[torch.device, torch.Tensor] = {}  # per device: (rows + 1, width) gather buffer
        self._pinned: dict[torch.device, torch.Tensor] = {}  # per CUDA device: its pinned host twin
        self._positions: dict[tuple[int, torch.device], torch.Tensor] = {}  # positions moved to a device, once
        self._views: dict[tuple[int, int, int, int], torch.Tensor] = {}  # (buffer, row, start, n) -> its slice
        self._gathers: dict[int, _Gather] = {}  # id(pick) -> how it is read (_gather_of)

    def launch(self, picks: list[Pick], scalars: list[torch.Tensor | float] = ()) -> Read:
        """Gather ``picks`` and ``scalars`` and start bringing them to the host; never synchronises on a CUDA
        device (on ``mps``/``xpu``, which have no pinned memory or events here, the copy is a plain one).

        Scalars are numbers, CPU tensors (read now) or one-element device tensors (read with the picks, e.g. the
        step a fused Adam keeps on the device).

        Raises:
            ValueError: a pick outside ``(rows, width)``, or more scalars than ``max_scalars``.
        """
        if len(scalars) > self.max_scalars:
            raise ValueError(f"StageReader: {len(scalars)} scalars, at most {self.max_scalars}")
        by_device: dict[torch.device, list[_Gather]] = {}
        with torch.no_grad():
            gathers = [self._gather_of(pick) for pick in picks]
        if len(self._gathers) != len(gathers):  # drop what no pick of this read uses (it may hold a dropped tensor)
            self._gathers = {id(e.pick): e for e in gathers}
        for e in gathers:
            by_device.setdefault(e.device, []).append(e)
        on_device: dict[torch.device, list[int]] = {}
        host_scalars = [0.0] * len(scalars)
        for j, value in enumerate(scalars):
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                on_device.setdefault(value.device, []).append(j)
                by_device.setdefault(value.device, [])
            else:
                host_scalars[j] = float(value)  # a number or a CPU tensor: no device sync
        read = Read(values=self._host_cpu[: self.rows], scalars=host_scalars)
        with torch.no_grad():
            for device, group in by_device.items():
                if device.type == "cpu":
                    read._parts.append((self._gather_cpu(group), None))
                else:
                    read._parts.append(self._gather_device(device, group, [(j, scalars[j])
                                                                            for j in on_device.get(device, [])]))
        if not read._parts:
            self._host_cpu.zero_()
        read._device_scalars = [j for js in on_device.values() for j in js]
        cuda = any(event is not None for _, event in read._parts)
        read.deferred = cuda if self.defer is None else bool(self.defer)
        if not read.deferred:
            read.settle()
        return read

    def _view(self, buf: torch.Tensor, pick: Pick, n: int) -> torch.Tensor:
        """``buf[row, start:start + n]``, made (and checked) once per place: a stage reads the same places."""
        key = (id(buf), pick.row, pick.start, n)
        view = self._views.get(key)
        if view is None:
            if not (0 <= pick.row < self.rows and 0 <= pick.start and pick.start + n <= self.width):
                raise ValueError(f"StageReader: a pick of {n} values at row {pick.row}, column {pick.start} does not "
                                 f"fit ({self.rows}, {self.width})")
            view = self._views[key] = buf[pick.row, pick.start:pick.start + n]
        return view

    def _gather_of(self, pick: Pick) -> _Gather:
        """How ``pick`` is read, made once per pick and kept while its source's memory stays where it was (a read
        of the same picks, stage after stage, then costs one ``index_select`` each)."""
        source = pick.source
        try:
            ptr = source.data_ptr()
        except (RuntimeError, NotImplementedError):  # no plain storage (a tensor subclass): made at every read
            ptr = None
        found = self._gathers.get(id(pick))
        if found is not None and found.pick is pick and ptr is not None and found.ptr == ptr:
            return found
        device = source.device
        if device.type == "cpu":
            buf, positions = self._host_cpu, pick.positions
        else:
            buf = self._device.get(device)
            if buf is None:
                buf = self._device[device] = torch.zeros(self.rows + 1, self.width, device=device)
            key = (id(pick.positions), device)
            positions = self._positions.get(key)
            if positions is None:
                # non_blocking: from pageable memory the copy is staged at once, with no wait on the device's queue
                positions = self._positions[key] = pick.positions.to(device, non_blocking=True)
        # a contiguous source is read through a view kept here (its memory is checked at each read: ptr); another
        # one is reshaped (a copy) at each read
        flat = source.view(-1) if ptr is not None and source.is_contiguous() else None
        found = _Gather(pick, ptr, device, flat, positions, self._view(buf, pick, positions.numel()),
                        source.dtype == buf.dtype)
        if ptr is not None:
            self._gathers[id(pick)] = found
        return found

    @staticmethod
    def _gather(gathers: list[_Gather]) -> None:
        for e in gathers:
            flat = e.flat if e.flat is not None else e.pick.source.reshape(-1)
            if e.same_dtype:
                torch.index_select(flat, 0, e.positions, out=e.dst)  # the recorder's read before issue 40, bitwise
            else:
                e.dst.copy_(flat.index_select(0, e.positions))

    def _gather_cpu(self, gathers: list[_Gather]) -> torch.Tensor:
        out = self._host_cpu
        out.zero_()
        self._gather(gathers)
        return out

    def _gather_device(self, device: torch.device, gathers: list[_Gather],
                       scalars: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        buf = self._device.get(device)
        if buf is None:
            buf = self._device[device] = torch.zeros(self.rows + 1, self.width, device=device)
        buf.zero_()
        self._gather(gathers)
        for j, value in scalars:  # into the last row, at the scalar's own column
            buf[self.rows, j:j + 1].copy_(value.reshape(1))
        if device.type != "cuda":  # mps, xpu: no pinned memory / events here; a plain (synchronising) copy
            return buf.to("cpu"), None
        pinned = self._pinned.get(device)
        if pinned is None:
            pinned = self._pinned[device] = torch.zeros(self.rows + 1, self.width, pin_memory=True)
        pinned.copy_(buf, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return pinned, event

    def forget_positions(self) -> None:
        """Drop the positions kept on devices (the picks' position tensors changed)."""
        self._positions.clear()
        self._views.clear()
        self._gathers.clear()

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors this reader holds: the gather buffers and positions on the devices, the host buffers (for
        the memory ledger's ``strategy`` bucket)."""
        return [self._host_cpu, *self._device.values(), *self._pinned.values(), *self._positions.values()]
