"""``python -m layerfreeze`` (and ``torchrun -m layerfreeze train ...``): the ``layerfreeze`` command."""

import sys

from .cli import main

sys.exit(main())
