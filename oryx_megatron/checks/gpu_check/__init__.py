"""oryx-gpu-check: the project checked on one GPU, one module per section (``command`` runs them)."""
