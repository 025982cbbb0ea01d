"""The launchers a distmm run starts its ranks with, and how a started rank ends.

``popen`` uses Lightning's subprocess launcher as DDP does; ``spawn`` and ``fork`` use
:class:`ConsolidatingLauncher`, Lightning's multiprocessing launcher made to hand the parent the
whole trained model (every rank holds only its towers), to keep torch's per-rank error files out of
the temp directory, and to end each rank without the interpreter's finalisation (docs/runtime.md,
"Why a finished rank aborted"). Both launcher classes are private to Lightning: this module is part
of the seam, and ``tests/test_lightning_seam.py`` checks what it reaches.
"""

from __future__ import annotations

import atexit
import gc
import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ParallelStrategy


def configure_launcher(
    strategy: ParallelStrategy,
    start_method: str,
    consolidate: Callable[[], dict[str, torch.Tensor] | None],
    after_ranks_ended: Callable[[], None] | None = None,
    release: Callable[[], None] | None = None,
) -> None:
    """Set ``strategy._launcher``: Lightning's ``_SubprocessScriptLauncher`` for ``"popen"``, else a
    multiprocessing launcher that returns the whole model.

    The subprocess launcher is set on every rank, also where the processes were created by
    someone else (its children, torchrun, SLURM), as DDP does: its ``launch`` then starts no
    process but gives the rank its share of the host's cores for intra-op threads; without it
    every rank runs as many threads as the host has cores.

    Lightning calls ``Strategy._configure_launcher`` to pick a launcher and has no public way to
    choose one; both launcher classes are private.
    """
    environment = strategy.cluster_environment
    assert environment is not None
    if start_method == "popen":
        launcher = RefittingScriptLauncher(environment, strategy.num_processes, strategy.num_nodes)
        strategy._launcher = launcher  # type: ignore[attr-defined]
    else:
        method: Literal["spawn", "fork", "forkserver"] = start_method  # type: ignore[assignment]
        launcher = ConsolidatingLauncher(
            strategy, consolidate, start_method=method, after_ranks_ended=after_ranks_ended, release=release
        )
        strategy._launcher = launcher  # type: ignore[attr-defined]


class Refitting:
    """A rank's ``trainer.fit`` body, run again while the strategy asks for it.

    A re-planned job (``DistMMStrategy(replan="drift")``) ends its fit after the step that saved
    the switch's checkpoint; the strategy's ``refit()`` then sets the new plan, rebuilds the module
    and names the checkpoint, and the fit runs again from it, in the same processes and process
    group. Lightning's ``Trainer.fit`` sets the trainer's state before its (private) ``_fit_impl``;
    so does this, before each new run of it. Picklable (the spawn launcher sends it to the ranks).
    """

    def __init__(self, function: Callable, trainer: pl.Trainer | None) -> None:
        self.function, self.trainer = function, trainer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.function(*args, **kwargs)
        trainer = self.trainer
        refit = getattr(trainer.strategy, "refit", None) if trainer is not None else None
        while trainer is not None and refit is not None and trainer.state.fn == TrainerFn.FITTING:
            path = refit()
            if path is None:
                break
            from lightning.pytorch.trainer.states import TrainerStatus

            trainer.state.status, trainer.training, trainer.should_stop = TrainerStatus.RUNNING, True, False
            args = (*args[:4], path, *args[5:])  # _fit_impl(model, train, val, datamodule, ckpt_path, weights_only)
            result = self.function(*args, **kwargs)
        return result


class RefittingScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher (scripts, torchrun, SLURM) whose ranks fit again after a re-plan
    (:class:`Refitting`)."""

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        return super().launch(Refitting(function, trainer), *args, trainer=trainer, **kwargs)


class ConsolidatingLauncher(_MultiProcessingLauncher):
    """Spawn/fork launcher that hands the parent process the *whole* trained model.

    Lightning's multiprocessing launcher sends rank 0's ``state_dict`` back to the parent (in the
    private ``_collect_rank_zero_results``, as a private ``_WorkerOutput``); under distmm rank 0
    holds only its towers, so every rank first assembles the full state dict on rank 0
    (``consolidate``, a collective), and that is what the parent loads.
    """

    def __init__(
        self,
        strategy: ParallelStrategy,
        consolidate: Callable[[], dict[str, torch.Tensor] | None],
        start_method: Literal["spawn", "fork", "forkserver"] = "spawn",
        after_ranks_ended: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(strategy, start_method=start_method)
        self._consolidate = consolidate
        self._after_ranks_ended = after_ranks_ended
        self._release = release
        self._temp_dir: str | None = None
        #: the parent's scratch folder for this launch (removed when the launch returns)
        self._scratch: str | None = None

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        """Lightning's launch, with torch's per-rank error files kept out of the temp directory.

        ``torch.multiprocessing.start_processes`` names one ``pytorch-errorfile-*.pickle`` per rank
        in the temp directory; a rank that raises writes its traceback there, and
        ``ProcessContext.join`` reads it but never removes it, so every failed run would leave one
        behind. While the ranks run, the parent's temp directory (``tempfile.tempdir``) is a folder
        of its own, removed afterwards whatever happened; the ranks themselves keep the real one.
        ``after_ranks_ended`` runs last. ``MASTER_PORT``, which Lightning writes into this process's
        environment, is taken back: a later run, or a process this one starts, picks a free port.

        Before a fork the parent's objects are frozen out of the garbage collector (``gc.freeze``, as
        Python's documentation advises for fork without exec): a forked rank's collections then skip
        them instead of traversing the parent's whole heap, which took 0.5-1 s per collection and
        copied every page it touched into the rank. The parent unfreezes them once its ranks ended
        (unless something froze objects before it: ``gc.unfreeze`` cannot tell them apart).
        """
        froze = self._start_method == "fork" and gc.get_freeze_count() == 0
        if froze:
            gc.freeze()
        self._temp_dir = tempfile.gettempdir()
        scratch = self._scratch = tempfile.mkdtemp(prefix="distmm-launch-")
        previous, tempfile.tempdir = tempfile.tempdir, scratch
        rendezvous = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
        try:
            return super().launch(Refitting(function, trainer), *args, trainer=trainer, **kwargs)
        finally:
            for key, value in rendezvous.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            tempfile.tempdir = previous
            if froze:
                gc.unfreeze()
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
            if self._after_ranks_ended is not None:
                self._after_ranks_ended()

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> Any:
        """A rank's body (Lightning's private entry point in each started process), in the real temp
        directory (a forked rank inherits the parent's scratch one).

        When the work is done, every rank waits for the others (a barrier), drops what refers to the
        towers' process groups (``release``: their DeviceMeshes) and destroys the default group. Then
        the rank ends as a forked rank does, without the interpreter's finalisation, where a gloo
        worker freeing a tensor would abort a rank whose work succeeded (docs/runtime.md, "Why a
        finished rank aborted"). A rank whose work raised ends the same way with code 1. The exit
        hook is registered first, so it runs after every ``atexit`` handler the run registered."""
        if self._temp_dir is not None:
            tempfile.tempdir = self._temp_dir
        done = _RankEnd()
        atexit.register(done.exit_if_ended)
        try:
            result = super()._wrapping_function(*args, **kwargs)
        except Exception:
            done.code = 1  # torch's spawn wrapper records the error, then exits with 1
            raise
        _end_process_group(self._release)
        done.code = 0
        return result

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        """Lightning's private parent-side step that loads rank 0's returned weights into the parent's
        module. A module built on the meta device (``trainer.init_module(empty_init=True)``) has no
        storage to load into there (``load_state_dict`` on meta tensors does nothing): it is
        materialised from its construction's recording first, so tensors the returned state dict
        lacks (non-persistent buffers) get their constructed values."""
        from lightning_distmm.parallel import deferred

        module = trainer.lightning_module
        refs = deferred.tensor_refs(module) if worker_output.weights_path is not None else {}
        if refs:
            deferred.materialize(module, refs, torch.device("cpu"))
            deferred.release(refs)
        super()._recover_results_in_main_process(worker_output, trainer)

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        state_dict = self._consolidate()  # on every rank: a collective
        if self._strategy.local_rank != 0:
            return None
        checkpoint_callback = trainer.checkpoint_callback
        best = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING and state_dict is not None:
            # in the launch's scratch folder, which the parent removes (Lightning's parent removes
            # the file it loads but not the folder ``mkdtemp`` made for it)
            weights_path = os.path.join(tempfile.mkdtemp(dir=self._scratch), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))


def _end_process_group(release: Callable[[], None] | None = None) -> None:
    """Every rank of the job gets here once its work (results included) is done. After a barrier
    (no rank still talks on any group), ``release`` drops the references to the other groups and
    the default group is destroyed."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        if release is not None:
            release()
            gc.collect()  # the runtime's meshes may sit in reference cycles
        dist.destroy_process_group()


class _RankEnd:
    """A started rank's ``atexit`` hook: once its work has ended, flush the output and end the
    process with ``os._exit`` (what multiprocessing does after a forked child's work), skipping
    the rest of the interpreter's finalisation. ``code`` is 0 once the work has succeeded and 1
    when it raised (the code torch's spawn wrapper exits with); a failed rank's collectives may
    still be running, and one that completes during finalisation would abort the process.
    ``None`` (interrupted: torch's wrapper exits quietly) leaves the exit as usual."""

    def __init__(self) -> None:
        self.code: int | None = None

    def exit_if_ended(self) -> None:
        if self.code is None:
            return
        import logging
        import sys

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(self.code)
