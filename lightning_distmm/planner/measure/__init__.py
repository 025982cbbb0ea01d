"""Everything that times this machine or its towers, or starts processes to do so: the only part of
the planner that runs torch or subprocesses (inside its functions, never at import)."""
