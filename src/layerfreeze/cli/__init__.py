"""``layerfreeze`` command line: ``train``, ``compare``, ``plan``, ``blocks``, ``report``, ``predictor``, ``config``,
``strategies``, ``assets``.

Exit codes: 0 success; 2 bad input (config, strategy, missing asset, undiscoverable blocks, bad checkpoint, a memory
budget nothing meets) found before training starts; 130 interrupted (a resumable checkpoint was written); 1 the run
was stopped (a peer rank was lost, the loss diverged or sat at chance level, a frozen weight moved; the last
checkpoint is resumable).

The folder's map, from the top down (a module imports only those below it):

* ``entry`` -- :func:`main`: parse, dispatch, errors as one line and exit code 2, warnings as one line.
* ``commands`` -- the subcommands (``cmd_train``, ``cmd_compare``, ``cmd_plan``, ...), each returning its exit code.
* ``parser`` -- the argparse parser of every subcommand, its errors, and the config overrides its flags make.
"""

from layerfreeze.cli.entry import main

__all__ = ["main"]
