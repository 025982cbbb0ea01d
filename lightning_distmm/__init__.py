"""lightning_distmm: DistMM for PyTorch Lightning.

Importing the package registers the strategies ``"distmm"`` (subprocess launcher: scripts,
torchrun, SLURM), ``"distmm_spawn"`` and ``"distmm_notebook"`` (fork, the notebook-safe one).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_distmm import losses
from lightning_distmm.checkpoint import consolidated_state_dict, export_checkpoint
from lightning_distmm.core.plan import Plan, PlanError, TowerPlan
from lightning_distmm.data.samples.fields import FieldDataset
from lightning_distmm.elastic import last_checkpoint
from lightning_distmm.interaction import local_rows
from lightning_distmm.mixin import DistMMMixin
from lightning_distmm.strategy import DistMMStrategy
from lightning_distmm.tower import Tower

__version__ = "0.1.0"

_REGISTRATIONS = {
    "distmm": ("popen", "DistMM: towers on their own ranks; subprocess launcher (scripts, torchrun, SLURM)"),
    "distmm_spawn": ("spawn", "DistMM with the spawn launcher"),
    "distmm_notebook": ("fork", "DistMM with the fork launcher (Jupyter / IPython)"),
}
for _name, (_method, _description) in _REGISTRATIONS.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, DistMMStrategy, description=_description, start_method=_method)

__all__ = [
    "DistMMMixin",
    "DistMMStrategy",
    "FieldDataset",
    "Plan",
    "PlanError",
    "Tower",
    "TowerPlan",
    "consolidated_state_dict",
    "export_checkpoint",
    "last_checkpoint",
    "local_rows",
    "losses",
]
