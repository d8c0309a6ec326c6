"""``python -m layerfreeze`` (and ``torchrun -m layerfreeze train ...``): the ``layerfreeze`` command."""

import sys

from layerfreeze.cli import main

sys.exit(main())
