"""The GPU session: one command that brings back the most valuable rows a rare, short, bare GPU machine
can give, even when a kernel crashes, a stage overruns or the compiles are slow (``driver``; docs/gpu.md)."""
