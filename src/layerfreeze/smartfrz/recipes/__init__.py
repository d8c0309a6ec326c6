"""The SmartFRZ collection recipes: the small networks, datasets and settings the shipped predictor's runs come from.

A *recipe* builds a :class:`~layerfreeze.smartfrz.setup.Setup` (model, train data, fixed probe batch, loss,
optimizer settings) from a seed; :func:`~layerfreeze.smartfrz.collect.collect` records each recipe with each seed
and learning rate. ``layerfreeze predictor collect --recipes`` names them.

* :mod:`~layerfreeze.smartfrz.recipes.registry` -- :func:`register_recipe`, :data:`RECIPES`, :func:`get_recipes`,
  :func:`import_recipes` (a user's own recipes, ``predictor collect --import``);
* :mod:`~layerfreeze.smartfrz.recipes.corpora` -- the datasets (installed offline), in fixed subsets;
* :mod:`~layerfreeze.smartfrz.recipes.zoo` -- the networks;
* :mod:`~layerfreeze.smartfrz.recipes.rounds` -- the registered recipes, in the order of their three rounds.

Importing this package registers every built-in recipe (it imports ``rounds``).
"""

from layerfreeze.smartfrz.recipes import rounds  # noqa: F401 - importing it registers the built-in recipes
from layerfreeze.smartfrz.recipes.registry import (
    DEFAULT_HOLDOUT,
    RECIPES,
    Recipe,
    get_recipes,
    import_recipes,
    register_recipe,
)

__all__ = ["DEFAULT_HOLDOUT", "RECIPES", "Recipe", "get_recipes", "import_recipes", "register_recipe"]
