"""``python -m layerfreeze.cli``: the ``layerfreeze`` command."""

import sys

from layerfreeze.cli.entry import main

sys.exit(main())
