"""Every private Lightning (and torch) access of the distmm strategy, each behind one named function.

A distmm plan does what Lightning's strategies assume never happens: different ranks hold
different modules and load different rows. Where Lightning offers a public hook the package uses
it (``LightningModule.backward`` and ``configure_gradient_clipping`` through the mixin,
``ParallelStrategy.block_backward_sync``, ``Strategy.process_dataloader``,
``Strategy.on_train_batch_start``, ``Strategy.optimizer_step``); what is left is here, one
function per access, each saying what it reaches and why no public API does the job.
``tests/test_lightning_seam.py`` has one fast test per function that fails with a clear message
when a Lightning or torch upgrade moves or changes what it reaches; ``pyproject.toml`` pins
Lightning to the versions that test passes on.

One private torch access lives outside this module (``_StridedShard`` in ``parallel/``, which must
not import Lightning). The strategy overrides one private method, ``Strategy._configure_launcher``
(there is no public way to choose a launcher): its body is :func:`configure_launcher`.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ParallelStrategy


# ---------------------------------------------------------------------- launch and process groups
def init_process_groups(strategy: ParallelStrategy) -> None:
    """Set up the default process group only: ``ModelParallelStrategy._setup_distributed``.

    ``ModelParallelStrategy.setup_environment`` (public) also builds its 2-D (dp, tp) DeviceMesh
    over all ranks, which a distmm plan does not use (each tower gets its own mesh in ``setup``,
    once the module's towers are known); its process-group half has no public name.
    """
    strategy._setup_distributed()  # type: ignore[attr-defined]


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
        launcher = _SubprocessScriptLauncher(environment, strategy.num_processes, strategy.num_nodes)
        strategy._launcher = launcher  # type: ignore[attr-defined]
    else:
        method: Literal["spawn", "fork", "forkserver"] = start_method  # type: ignore[assignment]
        launcher = ConsolidatingLauncher(
            strategy, consolidate, start_method=method, after_ranks_ended=after_ranks_ended, release=release
        )
        strategy._launcher = launcher  # type: ignore[attr-defined]


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
        """
        self._temp_dir = tempfile.gettempdir()
        scratch = self._scratch = tempfile.mkdtemp(prefix="distmm-launch-")
        previous, tempfile.tempdir = tempfile.tempdir, scratch
        rendezvous = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            for key, value in rendezvous.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            tempfile.tempdir = previous
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


def default_store() -> Any:
    """The default group's key-value store (torch's ``_get_default_store``: no public getter), where
    failure records cross hosts."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# ---------------------------------------------------------------------- the step
def zeroes_gradients_after_training_step(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether Lightning zeroes the gradients after this batch's ``training_step`` (before its backward).

    Lightning's rule, from the private ``_AutomaticOptimization._make_zero_grad_fn``: under
    automatic optimization, on the first batch of each accumulation window. Lightning calls the
    public ``optimizer_zero_grad`` hook only at that point, after ``training_step``; the runtime
    needs to know when the step starts (it frees the old gradients and posts the sums during the
    step's own backward).
    """
    module = trainer.lightning_module
    return bool(module.automatic_optimization and batch_idx % trainer.accumulate_grad_batches == 0)


def batches_processed(trainer: pl.Trainer | None) -> int:
    """Training batches this fit has processed (the distmm loader's position for a resume): Lightning's
    ``fit_loop.epoch_loop.batch_progress``, which has no public accessor."""
    if trainer is None:
        return 0
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def launcher_kill(strategy: ParallelStrategy) -> Callable[..., object] | None:
    """The strategy's launcher's ``kill`` (it passes a signal on to the ranks it started), if it has
    one: Lightning keeps the launcher in the private ``Strategy._launcher``."""
    return getattr(getattr(strategy, "_launcher", None), "kill", None)


def move_held_tensors(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s parameters and buffers to ``device``, leaving those on the meta device there.

    ``Module.to`` would try to copy the released (meta) towers and fail; torch's private
    ``Module._apply`` is what ``to`` itself uses to swap each tensor in place.
    """
    module._apply(lambda t: t if t.is_meta else t.to(device))


def optimizers_to_device(optimizers: Iterable[Optimizer], device: torch.device) -> None:
    """Move the optimizers' state to ``device``: Lightning's private ``_optimizers_to_device``, as
    ``ModelParallelStrategy.setup`` does (the distmm ``setup`` replaces that method)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def evaluate_without_inference_mode(trainer: pl.Trainer) -> None:
    """Run the trainer's ``validate`` / ``test`` / ``predict`` loops under ``torch.no_grad`` instead of
    ``torch.inference_mode``: what ``Trainer(inference_mode=False)`` sets, decided by the strategy.

    Off gloo (NCCL) Lightning runs these standalone loops under ``inference_mode`` (it skips it on
    gloo, and for its own FSDP1 strategy). A tower sharded with FSDP2 then allocates its all-gather
    buffers as inference tensors: its forward fails (``Inference tensors do not track version
    counter``) or a later training forward does (``Inplace update to inference tensor outside
    InferenceMode``). Each loop reads its ``inference_mode`` attribute when it runs (Lightning's
    ``_no_grad_context``); the attribute is public on private loop classes, and a strategy has no
    other way to choose the evaluation context. Fit-time validation already runs under ``no_grad``.
    """
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        loop.inference_mode = False


# ---------------------------------------------------------------------- data
def disable_distributed_sampler(trainer: pl.Trainer) -> None:
    """Keep Lightning from wrapping the loaders' samplers in a ``DistributedSampler``.

    The distmm loader picks each rank's rows itself and every rank must walk the same global
    batches; Lightning's ``DistributedSampler`` would also reshuffle an unshuffled training set.
    ``Trainer(use_distributed_sampler=False)`` is the user's switch; a strategy can only set the
    private ``trainer._accelerator_connector.use_distributed_sampler``.
    """
    trainer._accelerator_connector.use_distributed_sampler = False


def train_dataloader(trainer: pl.Trainer) -> object | None:
    """The training DataLoader the fit will use, before Lightning loads it (None if there is none).

    ``trainer.train_dataloader`` is only set after the strategy's ``setup``; the plan is chosen
    in ``setup`` (default and ``"auto"`` plans measure the towers on a sample). The loader given
    to ``fit`` or defined by the module or datamodule is behind the private
    ``trainer.fit_loop._data_source``. A user hook that fails here yields None (planning falls
    back to parameter counts; the fit itself calls the hook again and reports the error).
    """
    source = trainer.fit_loop._data_source
    if not source.is_defined():
        return None
    try:
        return source.dataloader()
    except Exception:  # noqa: BLE001 - the user's train_dataloader hook: reported by the fit itself
        return None


# ---------------------------------------------------------------------- helpers of the strategy over the accesses above
def _train_dataloader(trainer: pl.Trainer) -> DataLoader | None:
    """The training DataLoader the fit will use, before Lightning processes it (None if unavailable)."""
    loader = train_dataloader(trainer)
    return loader if isinstance(loader, DataLoader) else None


def train_batch_size(trainer: pl.Trainer) -> int | None:
    return getattr(getattr(_train_dataloader(trainer), "batch_sampler", None), "batch_size", None)


def example_batch(trainer: pl.Trainer) -> Mapping[str, Any] | None:
    """One collated sample of the training data, to count or time the towers (None if unavailable)."""
    loader = _train_dataloader(trainer)
    if loader is None:
        return None
    if isinstance(loader.dataset, IterableDataset):  # a stream: its example() if it has one (data.FieldStream)
        example = getattr(loader.dataset, "example", None)
        sample = example() if callable(example) else None
    else:
        sample = loader.dataset[0] if len(loader.dataset) else None  # type: ignore[arg-type]
    batch = loader.collate_fn([sample]) if sample is not None else None
    return batch if isinstance(batch, Mapping) else None


@contextmanager
def random_state_kept(device: torch.device) -> Generator[None, None, None]:
    """Restore Python's, NumPy's and torch's random states (CPU and ``device``) on exit."""
    import random

    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def before_observer_ends_job(say: Callable[[list[tuple[int, int | None]]], None]) -> bool:
    """Have ``say((child index + 1, return code) ...)`` run before Lightning's child-process observer
    (the subprocess launcher's thread in this process) kills every process, this one included, with
    SIGKILL when a child ended badly; False when this process has no such observer.

    ``_ChildProcessObserver`` and its ``_terminate_all`` / ``_child_processes`` are private.
    """
    import threading

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver) and not getattr(thread, "_distmm_last_words", False):
            original = thread._terminate_all

            def terminate_all(observer: Any = thread, end: Callable[[], None] = original) -> None:
                try:
                    say([(i + 1, p.returncode) for i, p in enumerate(observer._child_processes)])
                finally:
                    end()

            thread._terminate_all = terminate_all  # type: ignore[method-assign]
            thread._distmm_last_words = True  # type: ignore[attr-defined]
            return True
    return False
