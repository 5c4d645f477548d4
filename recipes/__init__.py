"""The Hydra config tree of oryx-train, oryx-params and oryx-experiment (``oryx_megatron.RECIPES_DIR``): installed
as the package ``oryx_megatron.recipes`` (pyproject.toml's package-dir), its yaml files as package data."""
