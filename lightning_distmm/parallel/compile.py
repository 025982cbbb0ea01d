"""Regional compilation of a tower (a plan's ``compile: true``), applied from outside like TP and FSDP.

What is compiled is each transformer block's ``forward`` (torchtitan's and the PyTorch tutorial's
"regional compilation"): the blocks of a tower share their code, so torch compiles the block once and
reuses it for every block (the parameters are the graph's inputs), instead of one graph for the whole
tower that a new sequence length or a pipeline cut would recompile. Only ``forward`` is wrapped, so
the modules' hooks (FSDP2's gathers and reduce-scatters, the runtime's own) stay eager around the
compiled region, and the order torchtitan applies the parts in holds: tensor, sequence and context
parallelism and recomputation first (the blocks compile with their DTensors, collectives and
checkpoints: a compiled function never runs inside a checkpoint's recomputation, where dynamo is
disabled), FSDP2 after. A tower
with no repeated blocks (a small conv encoder) compiles its root ``forward`` instead; a pipelined
tower compiles its stage's blocks only.

Replica batches change from step to step (uneven splits, per-step balance by cost, the last batch of
an epoch, microbatches), so the batch dimension of every tensor a region receives is marked dynamic
(``torch._dynamo.maybe_mark_dynamic``): a region compiles once for all batch sizes instead of once per
size (a batch of 1 is specialised by torch and compiles once more). A change of grad mode (``cached``
recomputes under ``no_grad`` first) or of ``train()``/``eval()`` compiles once more as well.

A region that fails to compile falls back to eager, for the whole tower, with one logged line naming
the reason: the failed call is run again eagerly and, if eager raises too, eager's error (the
module's own) is raised, never the compiler's. What is not caught: a failure while compiling the
backward at the first ``backward()`` (torch compiles it with the forward for inductor's default
settings; an error there ends the step like any other).
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_distmm.parallel.fsdp import transformer_blocks

_log = logging.getLogger(__name__)

#: torch.compile's backend for a plan's ``compile: true``
BACKEND = "inductor"


class _Region:
    """A compiled ``forward`` installed on one module, with the way back to eager."""

    def __init__(self, tower: CompiledTower, module: nn.Module, backend: str | Callable[..., Any]) -> None:
        self.tower = tower
        self.module = module
        self.own_forward = "forward" in module.__dict__  # an instance forward (a patch) to restore as it was
        self.eager = module.forward
        # a recomputed block's forward is a callable object (parallel.recompute): compile its __call__
        target = self.eager if inspect.ismethod(self.eager) or inspect.isfunction(self.eager) else self.eager.__call__
        self.compiled = torch.compile(target, backend=backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.tower.failure is not None:
            return self.eager(*args, **kwargs)
        for a in args:
            if isinstance(a, Tensor) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as compiled_error:  # noqa: BLE001  (any compiler failure: retried eagerly)
            out = self.eager(*args, **kwargs)  # eager's own error, if it has one, is the one raised
            self.tower.fall_back(compiled_error)
            return out

    def restore(self) -> None:
        if self.own_forward:
            self.module.forward = self.eager
        else:
            del self.module.forward

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # a copy of the module runs eagerly: its forward is the eager one, bound to the copy
        return copy.deepcopy(self.eager, memo)


class CompiledTower:
    """One tower's compiled regions on this rank.

    Args:
        name: the tower's name, for the log lines.
        regions: the modules whose ``forward`` is compiled.
        backend: ``torch.compile``'s backend (:data:`BACKEND`).
    """

    def __init__(self, name: str, regions: Iterable[nn.Module], backend: str | Callable[..., Any] = BACKEND) -> None:
        self.name = name
        #: why the tower runs eagerly after all (the first compiler error), or None while compiled
        self.failure: str | None = None
        self.regions = [_Region(self, m, backend) for m in regions]
        for region in self.regions:
            region.module.forward = region

    def fall_back(self, error: BaseException) -> None:
        """Run every region of the tower eagerly from now on, saying why once."""
        if self.failure is not None:
            return
        self.failure = _reason(error)
        for region in self.regions:
            region.restore()
        _log.warning("tower %r: torch.compile failed (%s); the tower runs eagerly", self.name, self.failure)
        _log.debug("tower %r: the compiler's traceback", self.name, exc_info=error)


def _reason(error: BaseException) -> str:
    """The compiler's error and, where it wraps one (a backend's), the error it wraps, a line each."""

    def line(e: BaseException) -> str:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__

    root, inner = error, error
    while inner is not None:
        root, inner = inner, getattr(inner, "inner_exception", None) or inner.__cause__
    reason = line(error) if root is error else f"{line(error)} {line(root)}"
    return reason[:400]


def compile_tower(
    name: str,
    module: nn.Module,
    held: Callable[[nn.Module], bool] = lambda block: True,
    pipelined: bool = False,
    backend: str | Callable[..., Any] = BACKEND,
) -> CompiledTower:
    """Compile ``module``'s transformer blocks that this rank runs (``held``), or its root ``forward``
    when it has no repeated blocks (not when ``pipelined``: a stage does not run the root's forward).
    A tower compiled already (an earlier ``Trainer`` call in this process) is returned as it is."""
    blocks = [b for b in transformer_blocks(module) if held(b)]
    regions = blocks or ([] if pipelined else [module])
    for region in regions:  # a second Trainer call in the same process (fit, then validate): as it is
        if isinstance(region.__dict__.get("forward"), _Region):
            return region.__dict__["forward"].tower
    compiled = CompiledTower(name, regions, backend)
    what = f"{len(blocks)} block(s)" if blocks else ("its forward" if regions else "nothing (no blocks in this stage)")
    _log.info(
        "tower %r: compiled %s with torch.compile (%s)", name, what, backend if isinstance(backend, str) else "custom"
    )
    return compiled


__all__ = ["BACKEND", "CompiledTower", "compile_tower"]
