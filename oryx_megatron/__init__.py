"""oryx-megatron: pretraining Oryx multi-mixer language models on megatron-core."""

from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"  # the Hydra config tree, package data of the wheel
