"""oryx-chaos-train: a training run killed again and again ends where the uninterrupted run ends
(``driver`` runs it; docs/reliability.md)."""
