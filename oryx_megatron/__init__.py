"""oryx-megatron: pretraining Oryx multi-mixer language models on megatron-core."""

from importlib.resources import files
from pathlib import Path

# The Hydra config tree: the checkout's recipes/, mapped into the package as oryx_megatron.recipes (pyproject.toml),
# so it is site-packages/oryx_megatron/recipes installed from the wheel and the checkout's recipes/ when editable.
RECIPES_DIR = Path(files("oryx_megatron.recipes"))
