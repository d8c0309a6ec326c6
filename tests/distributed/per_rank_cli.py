"""One rank of a CLI run whose ranks get their own command lines: ``python -m tests.distributed.per_rank_cli
SPEC.json`` runs ``layerfreeze`` with ``spec["args"][RANK]`` (ranks started by hand, or nodes with other config
files)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from layerfreeze.cli import main

if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    sys.exit(main(spec["args"][int(os.environ["RANK"])]))
