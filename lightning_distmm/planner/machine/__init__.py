"""The machine the planner plans for: cluster descriptions, their presets in ``conf/cluster`` and
measured device files, read without measuring anything."""
