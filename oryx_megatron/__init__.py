"""oryx-megatron: pretraining Oryx multi-mixer language models on megatron-core."""

from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"  # the Hydra config tree
