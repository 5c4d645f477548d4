"""The console scripts, one thin module each (pyproject.toml's [project.scripts]): each parses its
arguments, calls the library and ends a bad input as one line through ``errors`` (the one error path)."""
