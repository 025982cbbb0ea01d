"""One fast test per private Lightning / torch access (lightning_distmm/lightning_seam.py, and
``_StridedShard`` in parallel/tensor_parallel.py): each fails with a message naming what moved
when an upgrade changes it. pyproject.toml pins Lightning to the versions these pass on."""

from __future__ import annotations

import inspect

import lightning as L
import torch
import torch.distributed as dist
from distmm_testing import TinyCLIP, loader, trainer_kwargs
from lightning.pytorch.strategies import ModelParallelStrategy

import lightning_distmm as ldm
from lightning_distmm import lightning_seam as seam


def _distmm_trainer(start_method: str = "fork") -> L.Trainer:
    """A Trainer with the distmm strategy, constructed (not run: no processes, no process group)."""
    return L.Trainer(strategy=ldm.DistMMStrategy(start_method=start_method), devices=2, **trainer_kwargs())


def test_init_process_groups_reaches_setup_distributed():
    assert callable(getattr(ModelParallelStrategy, "_setup_distributed", None)), (
        "Lightning's ModelParallelStrategy._setup_distributed is gone: seam.init_process_groups needs another way"
        " to set up process groups without ModelParallelStrategy's device mesh"
    )
    assert "_setup_distributed()" in inspect.getsource(ModelParallelStrategy.setup_environment), (
        "ModelParallelStrategy.setup_environment no longer calls _setup_distributed: check what it sets up now"
    )


def test_configure_launcher_is_called_by_lightning():
    """Lightning calls Strategy._configure_launcher when it builds the Trainer; the seam sets the launcher."""
    for method, expected in [("fork", seam.ConsolidatingLauncher), ("popen", None)]:
        launcher = _distmm_trainer(method).strategy.launcher
        if expected is not None:
            assert isinstance(launcher, expected), f"Lightning did not call _configure_launcher ({launcher!r})"
        else:
            from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

            assert isinstance(launcher, _SubprocessScriptLauncher), f"popen launcher is {launcher!r}"


def test_rank_zero_results_hook_and_worker_output():
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput

    params = list(inspect.signature(_MultiProcessingLauncher._collect_rank_zero_results).parameters)
    assert params == ["self", "trainer", "results"], f"_collect_rank_zero_results changed: {params}"
    assert _WorkerOutput._fields == ("best_model_path", "weights_path", "trainer_state", "trainer_results", "extra"), (
        f"_WorkerOutput changed: {_WorkerOutput._fields}"
    )
    source = inspect.getsource(_MultiProcessingLauncher._wrapping_function)
    assert "_collect_rank_zero_results" in source, "the launcher no longer collects results through this hook"


def test_launch_starts_ranks_through_torch_and_wraps_them():
    """ConsolidatingLauncher.launch keeps torch's per-rank error files out of the temp directory by
    pointing ``tempfile.tempdir`` elsewhere around Lightning's launch, and gives the ranks the real
    one back in ``_wrapping_function``: both hold only while Lightning's launch starts the ranks
    with ``mp.start_processes`` (which names those files) running ``_wrapping_function``."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    source = inspect.getsource(_MultiProcessingLauncher.launch)
    assert "mp.start_processes(" in source and "self._wrapping_function" in source, (
        "Lightning's _MultiProcessingLauncher.launch no longer starts ranks with mp.start_processes"
        " running _wrapping_function: check where torch's error files go now"
    )
    import importlib

    spawn = importlib.import_module("torch.multiprocessing.spawn")  # the attribute is the function
    assert 'prefix="pytorch-errorfile-"' in inspect.getsource(spawn.start_processes), (
        "torch's start_processes names its error files differently now: check whether they are still left behind"
    )


def test_recover_results_loads_rank_zeros_weights_into_the_parents_module():
    """ConsolidatingLauncher materialises a meta-built module before Lightning's parent-side step
    loads the returned weights into it with ``load_state_dict``."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    params = list(inspect.signature(_MultiProcessingLauncher._recover_results_in_main_process).parameters)
    assert params == ["self", "worker_output", "trainer"], f"_recover_results_in_main_process changed: {params}"
    source = inspect.getsource(_MultiProcessingLauncher._recover_results_in_main_process)
    assert "load_state_dict(" in source, "the parent no longer loads the returned weights with load_state_dict"
    assert "_recover_results_in_main_process" in inspect.getsource(_MultiProcessingLauncher.launch)


def test_default_store(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        store = seam.default_store()
        assert store.compare_set("k", "", "first") in (b"first", "first")
    finally:
        dist.destroy_process_group()


def test_zero_grad_rule_matches_lightnings():
    """seam.zeroes_gradients_after_training_step restates _AutomaticOptimization._make_zero_grad_fn."""
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization

    for accumulate in (1, 2, 3):
        trainer = L.Trainer(devices=1, accumulate_grad_batches=accumulate, **trainer_kwargs())
        trainer.strategy.connect(TinyCLIP())
        automatic = _AutomaticOptimization(trainer)
        for batch_idx in range(7):
            lightning_zeroes = automatic._make_zero_grad_fn(batch_idx, torch.optim.SGD([torch.zeros(1)])) is not None
            assert seam.zeroes_gradients_after_training_step(trainer, batch_idx) == lightning_zeroes, (
                f"Lightning's zero-grad rule changed (accumulate={accumulate}, batch_idx={batch_idx})"
            )


def test_move_held_tensors_keeps_meta():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    module[0].to("meta")
    seam.move_held_tensors(module, torch.device("cpu"))
    assert module[0].weight.is_meta and module[1].weight.device.type == "cpu"


def test_optimizers_to_device():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(2)
    opt.step()
    seam.optimizers_to_device([opt], torch.device("cpu"))
    assert opt.state[p]["exp_avg"].device.type == "cpu"


def test_disable_distributed_sampler():
    trainer = _distmm_trainer()
    data = loader(4)
    assert trainer._data_connector._requires_distributed_sampler(data), (
        "Lightning would not inject a DistributedSampler here any more: check use_distributed_sampler's role"
    )
    seam.disable_distributed_sampler(trainer)
    assert not trainer._data_connector._requires_distributed_sampler(data), (
        "trainer._accelerator_connector.use_distributed_sampler no longer switches the sampler injection off"
    )


def test_train_dataloader_before_setup():
    """In a callback's setup (before the strategy's setup), the seam finds the loader given to fit."""
    data = loader(4)
    seen = []

    class Probe(L.Callback):
        def setup(self, trainer, pl_module, stage):
            seen.append(seam.train_dataloader(trainer))

    L.Trainer(devices=1, max_steps=1, callbacks=[Probe()], **trainer_kwargs()).fit(TinyCLIP(), data)
    assert seen == [data], f"trainer.fit_loop._data_source no longer gives the fit's loader: {seen}"


def test_strided_shard_and_to_local(tmp_path):
    """_StridedShard (a fused qkv's head-aligned shard) and DTensor.to_local() sharing the shard's storage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from lightning_distmm.parallel.step.gradients import local
    from lightning_distmm.parallel.tensor_parallel import is_strided, strided_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        t = distribute_tensor(torch.arange(6.0).reshape(6, 1), mesh, [strided_shard(0, split_factor=3)])
        assert is_strided(t), "torch's _StridedShard placement changed"
        assert torch.equal(t.full_tensor(), torch.arange(6.0).reshape(6, 1))
        grad = distribute_tensor(torch.ones(4), mesh, [strided_shard(0, split_factor=2)])
        with torch.enable_grad():
            local(grad).mul_(3)
        assert torch.equal(grad.full_tensor(), torch.full((4,), 3.0)), "DTensor.to_local() no longer shares storage"
    finally:
        dist.destroy_process_group()


def test_evaluate_without_inference_mode_sets_what_the_loops_read():
    """The evaluation loops read ``inference_mode`` when they run (``_no_grad_context``), the attribute
    ``Trainer(inference_mode=...)`` sets; the seam turns it off on the three standalone loops."""
    from lightning.pytorch.loops import utilities

    source = inspect.getsource(utilities._no_grad_context)
    assert "self.inference_mode" in source and "torch.inference_mode" in source, (
        "Lightning's _no_grad_context no longer picks torch.inference_mode from the loop's inference_mode:"
        " seam.evaluate_without_inference_mode needs another way to keep FSDP2 out of inference mode"
    )
    trainer = _distmm_trainer()
    loops = (trainer.validate_loop, trainer.test_loop, trainer.predict_loop)
    assert all(loop.inference_mode for loop in loops), "Lightning's default is no longer inference_mode=True"
    seam.evaluate_without_inference_mode(trainer)
    assert not any(loop.inference_mode for loop in loops)
    assert trainer.fit_loop.epoch_loop.val_loop.inference_mode is False  # fit-time validation: no_grad already
