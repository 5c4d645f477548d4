"""Console scripts: one thin module per command."""
