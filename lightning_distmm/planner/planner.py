"""Import path kept for ``lightning_distmm.strategy``'s ``plan="auto"``; the code lives in
:mod:`lightning_distmm.planner.auto`, the place to import it from."""

from lightning_distmm.planner.auto import auto_plan, tower_info_from_batch

__all__ = ["auto_plan", "tower_info_from_batch"]
