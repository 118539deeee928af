"""The recipes: training scripts run as ``python recipes/NAME.py`` from a clone, or as
``python -m aotdist.recipes.NAME`` once aotdist is installed (their default configs are
installed with them)."""
