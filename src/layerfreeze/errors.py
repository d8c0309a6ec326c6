"""The errors a user can act on: every one is a :class:`UserError`, which the CLI reports in one message with exit
code 2 (no traceback), and each also subclasses the built-in exception it has always been (``ValueError``,
``FileNotFoundError``, ``RuntimeError``), so ``except ValueError`` code keeps working.

Each message says what was wrong and what to do. Raised where the problem is found: a bad config before anything
trains (:class:`ConfigError`), a missing offline asset (:class:`AssetMissingError`), a model whose blocks cannot be
found (:class:`BlockDiscoveryError`), an unknown strategy or parameter (:class:`UnknownStrategyError`), a checkpoint
that is missing, corrupt or of another run (:class:`CheckpointError`), a SmartFRZ predictor file that is missing,
corrupt or of another version (:class:`PredictorError`), a memory budget that is malformed or that no frozen set
meets (:class:`BudgetError`), a parameter that holds no elements (:class:`EmptyParameterError`), a strategy's
decision the Freezer cannot apply (:class:`StrategyError`).
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input (config, files, model, assets); the message says what to do."""


class ConfigError(UserError, ValueError):
    """A configuration problem found before training starts (the CLI exits with code 2)."""


class UnknownStrategyError(UserError, ValueError):
    """A strategy name that is not registered, or a parameter the strategy does not take."""


class BlockDiscoveryError(UserError, ValueError):
    """A model's blocks cannot be discovered, or the given patterns do not describe it."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or from an incompatible version or run."""


class RunFileError(UserError, ValueError):
    """A run folder's record (``metrics.jsonl``, ``compare.json``) is not what a run writes: another file's content,
    or damaged beyond a crash's cut last line. The message names the file and line."""


class PredictorError(UserError, RuntimeError):
    """A SmartFRZ predictor file is missing, corrupt, or from an incompatible version."""


class AssetMissingError(UserError, FileNotFoundError):
    """An offline asset is not installed (or is incomplete).

    Attributes:
        asset: the asset's name, e.g. ``"minilm"``.
        location: where it was looked for (a path, or a package name when the package is absent).
        install_command: the shell command that installs it.
    """

    def __init__(self, asset: str, location: str, install_command: str, detail: str = "") -> None:
        self.asset = asset
        self.location = location
        self.install_command = install_command
        message = f"asset {asset!r} not found: looked in {location}"
        if detail:
            message += f" ({detail})"
        message += f". Install it with: {install_command}"
        super().__init__(message)


class BudgetError(UserError, ValueError):
    """A memory budget that cannot be read (``"3 lbs"``), or that no frozen set meets.

    Attributes:
        smallest_bytes: The smallest tensor peak a frozen set reaches (every block but the head frozen), in bytes,
            when the budget was read but cannot be met; None for a budget that cannot be read.
    """

    def __init__(self, message: str, smallest_bytes: int | None = None) -> None:
        super().__init__(message)
        self.smallest_bytes = smallest_bytes


class StrategyError(UserError, RuntimeError):
    """A strategy decided what the Freezer cannot do (freeze the head): a custom strategy's mistake, named with the
    strategy and the block."""


class EmptyParameterError(UserError, ValueError):
    """A parameter holds no elements: a sharded placeholder (DeepSpeed ZeRO-3 outside a gather), not weights.

    Attributes:
        names: The qualified names of the 0-element parameters.
    """

    def __init__(self, message: str, names: list[str]) -> None:
        super().__init__(message)
        self.names = names
