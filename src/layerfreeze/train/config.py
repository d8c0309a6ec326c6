"""Run configuration: the schema a config is validated against (a file plus command-line overrides, read and merged
by :mod:`layerfreeze.train.config_load`), validated before anything runs.

Validation (pydantic, ``extra="forbid"``) rejects unknown keys, wrong types and impossible values with a message
that names the key; the strategy and its parameters are checked against the registry. Task presets fill in what
the user did not set (for example Fashion-MNIST trains MobileNetV2 with a larger learning rate than MiniLM).

Example (YAML)::

    task: bbc-news
    train: {epochs: 3, batch_size: 32, lr: 5.0e-5}
    freeze: {strategy: static, params: {k: 5}}
"""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from layerfreeze.budget.parse import parse_budget
from layerfreeze.errors import BudgetError, ConfigError
from layerfreeze.strategies import DEFAULT_STRATEGY, STRATEGIES, UnknownStrategyError, check_strategy
from layerfreeze.train.config_file import deep_merge
from layerfreeze.train.config_words import format_validation_error
from layerfreeze.train.presets import TASK_PRESETS, strategy_preset

#: Short precision names people write, as Lightning reads them (``Trainer(precision="bf16")`` is bf16-mixed).
PRECISION_ALIASES = {"16": "16-mixed", "fp16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "fp32": "32-true"}

TASKS = ("bbc-news", "fashion-mnist", "text-csv", "image-folder", "text-lm")
#: The tasks whose model.name_or_path is a torchvision architecture name, not a folder.
IMAGE_TASKS = ("fashion-mnist", "image-folder")


def _numeric_only(annotation: Any) -> bool:
    """Whether a field of type ``annotation`` takes a number (int or float) and no bool: pydantic's lax mode reads
    ``true`` as 1 there (``"epochs": true`` trained one epoch in silence)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _numeric_only(args[0])
    if typing.get_origin(annotation) is Literal:
        return False
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return any(_numeric_only(a) for a in kinds) and not any(a is bool or typing.get_origin(a) is Literal
                                                                for a in kinds)
    return annotation in (int, float)


def absolute_path(path: str) -> str:
    """``path`` made absolute (``~`` expanded, symbolic links resolved). The run's ``config.json`` keeps its paths
    so: a relative ``data.path`` was read from the folder the run happened to start in, and its resume (or a new run
    from its config) from any other folder failed, "data.path two.csv does not exist"."""
    return str(Path(path).expanduser().resolve())


class _Section(BaseModel):
    # allow_inf_nan=False: every float key refuses NaN and infinities as not finite (YAML's .nan / .inf, --lr nan),
    # before its bounds are checked ("train.lr: must be <= 10, got nan" said nothing useful)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and _numeric_only(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"must be a number, not {str(value).lower()}")
        # a NaN or infinity (YAML's .nan / .inf) in a key that takes a number: one message, also for a key that takes
        # a number or a string (freeze.memory_budget), where pydantic would list one error per member of the union
        if isinstance(value, float) and not math.isfinite(value) and _numeric_only(
                cls.model_fields[info.field_name].annotation):
            raise ValueError(f"must be a finite number, got {value!r}")
        return value


class LoraConfig(_Section):
    """LoRA adapters through the ``peft`` library (Hu et al. 2021): rank, scaling and the modules they wrap.

    ``targets``: module names (peft's ``target_modules``); None picks per model (:func:`layerfreeze.train.tasks.
    default_lora_targets`): the attention query/value projections of a transformer, else every dense convolution.
    """

    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.1, ge=0, lt=1)
    targets: list[str] | None = None


class ModelConfig(_Section):
    """Which network to train.

    ``name_or_path``: a local Hugging Face model folder for text tasks (default: the installed MiniLM-L6; text-lm:
    a causal LM folder, required), or a
    torchvision architecture name for image tasks (``mobilenet_v2`` with the installed ImageNet weights,
    ``resnet18`` from scratch). ``blocks``: module-name patterns overriding block discovery. ``pretrained`` (image
    tasks): start from the installed ImageNet weights; null (default): when the model has them (``mobilenet_v2``
    yes, ``resnet18`` no, so ``--model resnet18`` trains from scratch without another flag).
    """

    name_or_path: str | None = None
    blocks: list[str] | None = None
    max_length: int = Field(128, ge=8, le=4096, description="tokens per text sample")
    pretrained: bool | None = None
    lora: LoraConfig | None = None


class DataConfig(_Section):
    """Where the data comes from; ``path`` is a CSV file (text-csv), a folder of class sub-folders (image-folder), or
    a text file or CSV file whose ``text_column`` is read (text-lm)."""

    path: str | None = None
    test_path: str | None = None
    text_column: str = "text"
    label_column: str = "label"
    test_fraction: float = Field(0.2, gt=0, lt=1)
    split_seed: int = 0
    image_size: int = Field(32, ge=8, le=1024)
    limit_train: int | None = Field(None, ge=1, description="train on N samples: a random subset drawn with "
                                    "split_seed (fashion-mnist: its first N, stored in random order)")
    limit_test: int | None = Field(None, ge=1, description="evaluate on N samples, drawn as limit_train")

    @field_validator("path", "test_path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        """An existing path as an absolute one (:func:`absolute_path`); a missing one is named by ``_check_task``."""
        return absolute_path(value) if value and Path(value).expanduser().exists() else value


class TrainConfig(_Section):
    """Optimisation. ``lr`` is every block's learning rate with ``lr_decay`` 1 (the default), the head's when
    ``lr_decay`` > 1 gives earlier blocks smaller ones (each block's ``lr_decay`` times smaller than the next's)."""

    epochs: int = Field(3, ge=1)
    batch_size: int = Field(32, ge=1)
    eval_batch_size: int = Field(64, ge=1)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(5e-5, gt=0, le=10)
    lr_decay: float = Field(1.0, ge=1)
    weight_decay: float = Field(0.01, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    warmup_fraction: float = Field(0.1, ge=0, lt=1)
    grad_clip: float | None = Field(1.0, gt=0)
    compile: bool | Literal["blocks"] = Field(
        False, description="torch.compile: false (eager), blocks (each block compiled on its own; identical blocks "
        "share code) or true (the whole model); recompiles are bounded and counted (compiles in the step records)")
    compile_backend: Literal["inductor", "aot_eager", "eager", "cudagraphs"] = Field(
        "inductor", description="torch.compile's backend (aot_eager: compiles fast, runs eagerly; for checks)")
    precision: Literal["auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true"] = Field(
        "auto", description="auto: bf16-mixed on a CUDA GPU with bfloat16, 32-true elsewhere; *-mixed: autocast, "
        "float32 weights (16-mixed with a GradScaler); bf16-true: bfloat16 weights")
    seed: int = Field(0, ge=0, lt=2**32, description="the run's seed (data order, dropout, new weights); NumPy's "
                      "range, 0 to 2**32 - 1")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps (quick runs)")

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_alias(cls, value: Any) -> Any:
        """Lightning's short names (``16``, ``bf16``, ``32``) and the Hugging Face Trainer's ``fp16`` / ``bf16``
        flags' words, read as the precisions they stand for (``16-mixed``, ``bf16-mixed``, ``32-true``)."""
        return PRECISION_ALIASES.get(str(value).strip().lower(), value) if value is not None else value

    @field_validator("compile", mode="before")
    @classmethod
    def _check_compile(cls, value: Any) -> Any:
        """``false``, ``true`` or ``blocks`` (YAML's booleans, or the strings), with one message for anything else."""
        words = {"false": False, "true": True, "blocks": "blocks"}
        if isinstance(value, str) and value.strip().lower() in words:
            return words[value.strip().lower()]
        if value is True or value is False:
            return value
        raise ValueError(f"{value!r}: use false (eager), blocks (each block compiled on its own) or true "
                         "(the whole model)")


class GuardConfig(_Section):
    """Stability guard (:mod:`layerfreeze.engine.guard`): thaw the latest frozen block when validation loss worsens.

    The validation loss is measured on ``val_fraction`` of the training data (held out from training), at every
    epoch end and, if ``every_steps`` is set, every that many steps.
    """

    tolerance: float = Field(0.05, gt=0)
    patience: int = Field(1, ge=1)
    cooldown: int = Field(2, ge=0)
    val_fraction: float = Field(0.1, gt=0, lt=1)
    every_steps: int | None = Field(None, ge=1)


class CacheConfig(_Section):
    """Frozen-prefix activation cache (:mod:`layerfreeze.compute.cache`): skip the frozen prefix's forward.

    ``mode``: ``auto`` (the default: check the data and the model's family before training, and at every use that
    the cached prefix is frozen, in eval mode and its inputs unchanged; train without the cache, with one
    ``cache_off`` event and a console line saying why, when they are not: random augmentation, a stochastic module,
    a family without a forward split; and keep only the entries that pay (:class:`~layerfreeze.compute.cache.
    CachePolicy`): an entry is stored only for a sample visited again, under a boundary that has held at least as many
    steps as remain until that visit (or was set before the first step), and freed at its last read); ``on`` (the
    same checks, but refuse to start or stop the run instead; every miss is stored); ``off``.
    ``dtype``: storage precision (float16/bfloat16 halve the memory; values rounded).
    ``budget_mb``: host memory before spilling to checksummed safetensors shards in the run folder; null (default):
    a quarter of the host memory available at the start (:func:`layerfreeze.compute.store.auto_budget_bytes`).
    """

    mode: Literal["off", "on", "auto"] = "auto"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    budget_mb: float | None = Field(None, ge=0, le=2**30, allow_inf_nan=False,
                                    description="cache memory in MiB before spilling (null: auto)")

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        """YAML 1.1 (PyYAML, so config files and ``--set``) reads an unquoted ``on``/``off`` as True/False."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class DemoteConfig(_Section):
    """Demotion of frozen blocks (:mod:`layerfreeze.engine.demote`), off unless set (``freeze.demote: {dtype:
    bfloat16}``, or ``--set freeze.demote.dtype=bfloat16``).

    ``dtype``: a block's weights are cast to it when it freezes (its outputs cast back to float32 for the trainable
    part); a thaw restores the float32 weights exactly as they were at the freeze. ``offload: cpu``: the weights of
    the frozen prefix the activation cache serves move to host memory, and are copied to the device only for what
    runs them (cache misses, evaluation; a thaw brings them back). ``master``: where the float32 master copy of a
    demoted block is kept: ``memory`` (host RAM), ``disk`` (a checksummed safetensors file in the run folder's
    ``demoted/``), ``auto`` (memory when training on a GPU, disk on the CPU, where host memory is the training
    memory). Needs ``train_bn: false``; ``offload`` needs the cache.
    """

    #: What ``layerfreeze config`` shows as the way to turn it on.
    EXAMPLE: ClassVar[dict[str, Any]] = {"dtype": "bfloat16", "offload": None, "master": "auto"}

    dtype: Literal["bfloat16", "float16"] | None = None
    offload: Literal["cpu"] | None = None
    master: Literal["auto", "memory", "disk"] = "auto"

    @model_validator(mode="after")
    def _something(self) -> DemoteConfig:
        if self.dtype is None and self.offload is None:
            raise ValueError("freeze.demote needs dtype (bfloat16, float16), offload (cpu), or both; to turn demotion "
                             "off, leave freeze.demote out (null)")
        return self


class FreezeConfig(_Section):
    """The freezing strategy: a registered name and its parameters; optionally the stability guard, the cache, the
    demotion of frozen blocks and a memory budget.

    ``memory_budget`` (``--memory-budget``): a tensor-peak budget (:mod:`layerfreeze.budget`): ``"3GiB"``,
    ``"800MiB"``, ``"2.5GB"``, or a fraction of the tensor peak with nothing frozen (``0.6``, ``"60%"``). Before
    training, two real steps measure each block's bytes; the shortest frozen prefix whose predicted peak fits is
    frozen from the start and kept frozen (a strategy may freeze more, never thaw it; the guard neither), and the
    activation cache keeps in memory only what the budget leaves (the rest spills to disk). A budget nothing meets
    stops before training (exit code 2) naming the smallest reachable peak. ``layerfreeze plan`` shows the plan.
    """

    strategy: str = DEFAULT_STRATEGY
    params: dict[str, Any] = Field(default_factory=dict)
    train_bn: bool = False
    guard: GuardConfig | None = None
    cache: CacheConfig = Field(default_factory=CacheConfig)
    demote: DemoteConfig | None = None
    memory_budget: str | int | float | None = None

    @field_validator("cache", mode="before")
    @classmethod
    def _cache_short_form(cls, value: Any) -> Any:
        """``freeze.cache: on`` (``off``, ``auto``; YAML reads an unquoted on/off as True/False) is short for
        ``{mode: on}``."""
        return {"mode": value} if isinstance(value, (str, bool)) else value

    @field_validator("demote", mode="before")
    @classmethod
    def _demote_short_form(cls, value: Any) -> Any:
        """``freeze.demote: bfloat16`` (``--set freeze.demote=bfloat16``) is short for ``{dtype: bfloat16}``; any
        other non-mapping says how to write it."""
        if isinstance(value, str):
            if value in ("bfloat16", "float16"):
                return {"dtype": value}
            if value == "cpu":
                return {"offload": "cpu"}
            raise ValueError(f"{value!r}: write a dtype (bfloat16 or float16), which is short for "
                             "{dtype: bfloat16}, or a mapping such as {dtype: bfloat16, offload: cpu, master: auto}")
        if value is not None and not isinstance(value, (dict, DemoteConfig)):
            raise ValueError(f"{value!r}: write a mapping such as {{dtype: bfloat16, offload: cpu}} "
                             "(--set freeze.demote.dtype=bfloat16), or bfloat16 / float16 alone")
        return value

    @field_validator("memory_budget")
    @classmethod
    def _check_budget(cls, value: Any) -> Any:
        """Read as :func:`~layerfreeze.budget.parse.parse_budget` reads it (bytes with a unit, or a fraction). A bare
        integer below 1 MiB in a config (YAML's ``100``, ``--set freeze.memory_budget=100``) is refused: it would be
        bytes, which no model fits, and it is more likely a percent or a size without its unit."""
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**20:
            raise ValueError(f"memory budget {value}: a bare number is read as bytes, and {value} B holds no model; "
                             f"write {value}% for a share of the peak with nothing frozen, a size such as {value}MiB "
                             f"or {value}GiB, or {value}B if you mean bytes")
        if value is not None:
            try:
                parse_budget(value)
            except BudgetError as exc:
                raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _check_demote(self) -> FreezeConfig:
        if self.demote is None:
            return self
        if self.train_bn:
            raise ValueError("freeze.demote needs freeze.train_bn: false (with train_bn the BatchNorm layers of frozen "
                             "blocks keep training, in float32, inside blocks demotion casts)")
        if self.demote.offload is not None and self.cache.mode == "off":
            raise ValueError("freeze.demote.offload moves the frozen prefix the activation cache serves; with "
                             "freeze.cache.mode: off nothing is served. Turn the cache on (auto) or leave offload out")
        return self

    @model_validator(mode="after")
    def _check_strategy(self) -> FreezeConfig:
        """The name and the parameter names, against the registry; values are checked where the strategy is built
        (:func:`~layerfreeze.train.setup.build_strategy`, before training), so nothing is built twice."""
        try:
            check_strategy(self.strategy, self.params)
        except UnknownStrategyError as exc:
            raise ValueError(str(exc)) from None
        return self


class RunConfig(_Section):
    """Where results go and how the run behaves.

    ``parallel``: how a run launched by ``torchrun`` on several ranks is data-parallel: ``ddp`` (every rank holds the
    whole model, :class:`~layerfreeze.distributed.FreezeDDP`) or ``fsdp`` (FSDP2: each rank holds one shard of every
    parameter, :func:`~layerfreeze.distributed.shard_blocks`; full checkpoints gathered on rank 0). In one process
    ``ddp`` trains the plain model and ``fsdp`` is refused (there is nothing to shard over).

    Checkpoints (:class:`~layerfreeze.checkpoint.CheckpointStore`) are written at every epoch end, every
    ``checkpoint_every_steps`` steps and every ``checkpoint_every_minutes`` minutes (after the step that passes it),
    and on Ctrl-C or an exception; the last ``keep_checkpoints`` complete ones are kept.

    ``ledger`` (on by default) keeps the memory ledger (:class:`~layerfreeze.runs.ledger.MemoryLedger`): the bytes
    of every bucket (parameters trainable/frozen by dtype, buffers, gradients, optimizer state, saved activations,
    the activation cache in memory and on disk) per device and per block, in the ``memory`` field of a step record
    at the first step, every ``ledger_every`` steps (10 by default; 1: every step) and at the step after every freeze
    or thaw, with each bucket's peak and the tensor peak in ``summary.json``'s ``memory``. Parameters, gradients and
    optimizer state change only at a freeze or thaw, and those steps are always sampled; saved activations follow
    the batch size, the cache grows through the first epoch. A sampled step costs about one microsecond per tensor
    it walks (parameters, gradients, buffers, optimizer state, tensors autograd saves): ~2 ms for MobileNetV2 at
    batch 16 on a CPU core, under 1% of its step; an idle step costs nothing measurable
    (``python -m benchmarks.ledger_overhead``).
    """

    dir: str | None = None
    device: str = "auto"
    threads: int | None = Field(None, ge=1)
    progress: bool = True
    tensorboard: bool = True
    checkpoint: bool = True
    checkpoint_every_steps: int | None = Field(None, ge=1, description="also checkpoint every N optimizer steps")
    checkpoint_every_minutes: float | None = Field(10.0, gt=0, description="also checkpoint every M minutes")
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept (older ones deleted)")
    divergence_window_steps: int | None = Field(
        100, ge=1, description="stop when the loss sits at chance level for this many steps (null: never)")
    resume: str | None = None
    dist_timeout_s: float = Field(300, gt=0, description="seconds a collective waits for a peer rank (torchrun runs)")
    parallel: Literal["ddp", "fsdp"] = "ddp"
    ledger: bool = True
    ledger_every: int = Field(10, ge=1, description="the memory ledger samples one step in N (and the first step, "
                                                      "and the step after every freeze or thaw)")


class Config(_Section):
    """A whole run. See the module docstring for an example."""

    task: Literal["bbc-news", "fashion-mnist", "text-csv", "image-folder", "text-lm"] = "bbc-news"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    freeze: FreezeConfig = Field(default_factory=FreezeConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _check_task(self, info: ValidationInfo) -> Config:
        """The inputs a task needs to train (unless validated with ``context={"inputs": False}``: ``layerfreeze
        config`` prints a config without data, ``layerfreeze blocks`` builds only the model)."""
        what = {"text-csv": "a CSV file (--data)", "image-folder": "a folder of class sub-folders (--data)",
                "text-lm": "a text or CSV file (--data)"}
        if self.task not in what and (self.data.path or self.data.test_path):
            key = "data.path" if self.data.path else "data.test_path"
            raise ValueError(f"{key} is read by the text-csv, image-folder and text-lm tasks; task {self.task!r} "
                             "trains on its installed dataset. Drop --data, or choose the task your data is for "
                             "(--task text-csv for a CSV, image-folder for class sub-folders)")
        # The stability guard cannot undo a FreezeOut freeze: the block's LR factor is 0 from its t_i on, so a guard's
        # thaw trained it at LR 0 until FreezeOut froze it again (a run saved so before this check still resumes)
        if self.freeze.guard is not None and not self.run.resume and getattr(
                STRATEGIES.get(self.freeze.strategy), "anneals_to_zero", False):
            raise ValueError(f"freeze.guard with strategy {self.freeze.strategy}: a block it froze has annealed its "
                             "learning rate to 0, and a guard's thaw trains it at 0 until the strategy freezes it "
                             "again. Drop freeze.guard, or pick a strategy the guard can undo (static, linear, "
                             "smartfrz, ...; in `layerfreeze compare`, drop that row's guard: --row-set "
                             f"{self.freeze.strategy}.freeze.guard=null)")
        image = self.task in IMAGE_TASKS
        for key, value, default, reader in (
                ("model.max_length", self.model.max_length, ModelConfig.model_fields["max_length"].default, "text"),
                ("data.image_size", self.data.image_size, DataConfig.model_fields["image_size"].default, "image")):
            # set for the other kind of task: read by none (a run saved so before this check still resumes)
            if value != default and image == (reader == "text") and not self.run.resume:
                raise ValueError(f"{key} {value} is read by the {reader} tasks; task {self.task!r} trains on "
                                 f"{'images' if image else 'text'} and would ignore it. Drop it, or choose the task "
                                 "it is for")
        folder = self.model.name_or_path
        if not image and folder and Path(folder).expanduser().is_dir():  # image tasks: a name
            self.model.name_or_path = absolute_path(folder)  # config.json keeps it so (absolute_path)
        if (info.context or {}).get("inputs", True):
            if self.task in what and not self.data.path:
                raise ValueError(f"task {self.task!r} needs data.path: {what[self.task]}")
            for key, path in (("data.path", self.data.path), ("data.test_path", self.data.test_path)):
                if path and not Path(path).exists():
                    raise ValueError(f"{key} {path} does not exist")
                if (path and self.run.dir and self.task == "image-folder" and Path(path).is_dir()
                        and Path(self.run.dir).resolve().is_relative_to(Path(path).resolve())):
                    raise ValueError(f"run.dir {self.run.dir} is inside {key} {path}: a run writes its checkpoints "
                                     "and report there, and the next run would read them as data; pick a --run-dir "
                                     "outside the data")
            if self.task == "text-lm" and not self.model.name_or_path:
                raise ValueError("task 'text-lm' needs model.name_or_path (--model): a local Hugging Face causal LM "
                                 "folder (no decoder LM weights install offline)")
        if self.run.device not in ("auto", "cpu") and not self.run.device.startswith("cuda"):
            raise ValueError(f"run.device must be auto, cpu or cuda[:N], got {self.run.device!r}")
        if self.train.compile is True and self.freeze.cache.mode == "on":
            raise ValueError(f"train.compile true compiles the model's forward, which {COMPILE_TRUE_BYPASSED}: "
                             "training would run eager. Use --compile blocks (each block compiled, the cache kept), "
                             "or the cache off (--set freeze.cache.mode=off)")
        return self


#: Why ``train.compile: true`` and the activation cache do not go together (``mode: on`` is refused, ``auto`` stays
#: off): the cached forward runs the trainable suffix block by block, never through ``model.forward``.
COMPILE_TRUE_BYPASSED = "the activation cache bypasses (it runs the trainable blocks one by one)"


def build_config(user: dict[str, Any] | None = None, inputs: bool = True) -> Config:
    """Validate a user config dict, after filling in the task preset
    (:data:`~layerfreeze.train.presets.TASK_PRESETS`) and the strategy's preset for the task's model
    (:func:`~layerfreeze.train.presets.strategy_preset`).

    Args:
        user: The config as the user wrote it (a file's mapping merged with overrides).
        inputs: Whether the task's inputs must be given (``data.path`` for text-csv, image-folder and text-lm;
            text-lm's ``model.name_or_path``): True for a run; False for ``layerfreeze config`` and ``blocks``.

    Raises:
        ConfigError: with every problem found, one per line, each naming its key.
    """
    try:
        return validate_config(user or {}, inputs)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, Config)) from None


def validate_config(user: dict[str, Any], inputs: bool) -> Config:
    """:func:`build_config`'s validation, the presets filled in; raises pydantic's ``ValidationError`` (for a caller
    that picks among its errors: :mod:`layerfreeze.train.config_load`)."""
    task = user.get("task", "bbc-news")
    preset = TASK_PRESETS.get(task, {}) if isinstance(task, str) else {}
    freeze = user.get("freeze")
    strategy = freeze.get("strategy", DEFAULT_STRATEGY) if isinstance(freeze, dict) else DEFAULT_STRATEGY
    model = user.get("model")
    name = model.get("name_or_path") if isinstance(model, dict) and "name_or_path" in model else \
        preset.get("model", {}).get("name_or_path")
    params = strategy_preset(task, strategy, name)
    if params:
        preset = deep_merge(preset, {"freeze": {"params": params}})
    return Config.model_validate(deep_merge(preset, user), context={"inputs": inputs})
