"""A memory budget as a user writes it: ``"3GiB"``, ``"800MiB"``, ``"2.5GB"``, ``"0.6"`` or ``"60%"``.

Two kinds, one rule each:

* **bytes**: a number and a unit, binary (``KiB``, ``MiB``, ``GiB``, ``TiB``: powers of 1024) or decimal (``kB``,
  ``MB``, ``GB``, ``TB``: powers of 1000), or ``B``; case and a space before the unit do not matter (``3 gib``). An
  int is bytes too (the library's ``plan_memory(model, batch, 3 * 2**30)``).
* **a fraction of ``none``'s tensor peak**: a plain number in ``(0, 1]`` (``0.6``) or a percentage in ``(0, 100]``
  (``60%``): the tensor peak the same model reaches with nothing frozen, measured by the planner on the same batch
  (:mod:`layerfreeze.budget.plan`). A float in ``(0, 1]`` given to the library reads the same way.

Anything else (a bare number above 1, ``3G``, a negative or zero size, a number too large for a float: ``1e400GiB``)
raises :class:`~layerfreeze.errors.BudgetError` with the accepted forms and, where one is likely, what was meant: ``60``
-> ``60%`` or ``60GiB``; ``1000000000`` -> ``1000000000B`` (bytes take a unit in a string: the command line's
``--memory`` / ``--memory-budget`` always give a string, so ``60`` there is never 60 bytes); ``3G`` -> ``3GiB``. The
budget is compared with the memory ledger's tensor peak (:mod:`layerfreeze.runs.ledger`: every bucket on every memory
device, the disk left out), not with the process's RSS or the CUDA allocator's reserved bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from layerfreeze.errors import BudgetError
from layerfreeze.runs.summary import format_bytes

__all__ = ["BUDGET_FORMS", "Budget", "parse_budget"]

#: Bytes per unit (lower case).
UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}

#: The forms a budget is written in, as the errors here and the command line's help (``train --memory-budget``,
#: ``compare --memory-budget``, ``plan --memory``) list them.
BUDGET_FORMS = ("a size with a unit (3GiB, 800MiB, 2.5GB, 1000000B; binary KiB/MiB/GiB/TiB, decimal kB/MB/GB/TB, or B "
                "for bytes), or a fraction of the tensor peak with nothing frozen (0.6, or 60%)")
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")


@dataclass(frozen=True)
class Budget:
    """A memory budget: ``bytes`` (a size) or ``fraction`` (of ``none``'s tensor peak), exactly one of them set.

    ``text`` is how it was written (for messages and the config).
    """

    bytes: int | None = None
    fraction: float | None = None
    text: str = ""

    def resolve(self, none_peak_bytes: int) -> int:
        """The budget in bytes: ``bytes``, or ``fraction`` times ``none_peak_bytes`` (rounded down)."""
        if self.bytes is not None:
            return self.bytes
        return int(self.fraction * none_peak_bytes)

    def describe(self, none_peak_bytes: int | None = None) -> str:
        """``"3.00 GiB"``, or ``"60% of none's tensor peak (1.23 GiB)"``."""
        if self.bytes is not None:
            return format_bytes(self.bytes)
        what = f"{100 * self.fraction:g}% of none's tensor peak"
        return what if none_peak_bytes is None else f"{what} ({format_bytes(self.resolve(none_peak_bytes))})"

    def __str__(self) -> str:
        return self.text or (format_bytes(self.bytes) if self.bytes is not None else f"{self.fraction:g}")


def parse_budget(value: str | int | float | Budget) -> Budget:
    """Read a budget (module docstring: the forms).

    Args:
        value: ``"3GiB"``, ``"800 MiB"``, ``"2.5GB"``, ``"0.6"``, ``"60%"``; an int (bytes); a float in ``(0, 1]``
            (a fraction); or a ready :class:`Budget`.

    Raises:
        BudgetError: an unknown unit, a bare number above 1, a size or fraction that is not positive, a percentage
            above 100, a float above 1 (say what it is: ``"3GiB"`` or an int of bytes), a number or size too large
            for a float (``"1e400GiB"``).
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool):
        raise BudgetError(f"memory budget {value!r}: expected {BUDGET_FORMS}")
    if isinstance(value, int):
        if value <= 0:
            raise BudgetError(f"memory budget {value} bytes: must be positive")
        return Budget(bytes=value, text=str(value))
    if isinstance(value, float):
        if not (math.isfinite(value) and 0 < value <= 1):
            raise BudgetError(f"memory budget {value!r}: a float is a fraction of the tensor peak with nothing frozen "
                              f"and must be in (0, 1]; for a size give an int of bytes or a string such as '3GiB'")
        return Budget(fraction=value, text=f"{value:g}")
    if not isinstance(value, str):
        raise BudgetError(f"memory budget {value!r} ({type(value).__name__}): expected {BUDGET_FORMS}")
    if value.strip().startswith("-"):
        raise BudgetError(f"memory budget {value!r}: a budget must be positive; expected {BUDGET_FORMS}")
    found = _NUMBER.match(value)
    if found is None:
        raise BudgetError(f"memory budget {value!r}: expected {BUDGET_FORMS}")
    number, unit = float(found.group(1)), found.group(2).lower()
    text = value.strip()
    if not math.isfinite(number):  # "1e400GiB": the number overflows a float
        raise BudgetError(f"memory budget {value!r}: {found.group(1)} is too large a number (it overflows a float); "
                          f"expected {BUDGET_FORMS}")
    if unit == "%":
        if not 0 < number <= 100:
            raise BudgetError(f"memory budget {value!r}: a percentage of the tensor peak with nothing frozen must be "
                              "in (0, 100]")
        return Budget(fraction=number / 100, text=text)
    if not unit:
        if not 0 < number <= 1:
            raise BudgetError(f"memory budget {value!r}: a number without a unit is a fraction of the tensor peak "
                              f"with nothing frozen and must be in (0, 1]{_bare_hint(found.group(1), number)}; "
                              f"expected {BUDGET_FORMS}")
        return Budget(fraction=number, text=text)
    if unit not in UNITS:
        guess = {"k": "KiB", "m": "MiB", "g": "GiB", "t": "TiB"}.get(unit)
        hint = f" (did you mean {found.group(1)}{guess}?)" if guess else ""
        raise BudgetError(f"memory budget {value!r}: unknown unit {found.group(2)!r}{hint}; expected {BUDGET_FORMS}")
    size = number * UNITS[unit]
    if not math.isfinite(size):  # "1e306TiB": the number is finite, its bytes are not
        raise BudgetError(f"memory budget {value!r}: too large a size (its bytes overflow a float); expected "
                          f"{BUDGET_FORMS}")
    nbytes = int(size)
    if nbytes <= 0:
        raise BudgetError(f"memory budget {value!r}: must be at least one byte")
    return Budget(bytes=nbytes, text=text)


def _bare_hint(text: str, number: float) -> str:
    """What a bare number above 1 likely meant: a percentage (up to 100), else bytes (a whole number of at least a
    KiB, with its size) or a size in GiB."""
    if number <= 1:
        return ""
    if number <= 100:
        return f" (did you mean {text}% of it, or a size such as {text}GiB?)"
    if number.is_integer() and number >= 1024:
        return f" (did you mean {text}B, that is {format_bytes(int(number))}? a size in bytes takes the unit B)"
    return f" (did you mean {text}MiB or {text}GiB?)"
