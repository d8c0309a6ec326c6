"""The package version, in one place (``layerfreeze.__version__``; run folders and predictor cards record it)."""

__version__ = "0.1.0"
