"""Tensor-parallel towers: a TP=2 tower equals the unsharded tower."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distmm_testing import TinyText
from timm.models.vision_transformer import VisionTransformer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from lightning_distmm.parallel.families.clip_text import apply_tp_clip_text
from lightning_distmm.parallel.families.vit import apply_tp_vit


def _worker(rank, world, init, kind, errors):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        if kind == "vit":
            model = VisionTransformer(img_size=8, patch_size=4, embed_dim=16, depth=2, num_heads=4, num_classes=8)
            inputs = (torch.randn(5, 3, 8, 8),)
        else:
            model = TinyText()
            for p in model.parameters():
                p.requires_grad_(True)
            ids = torch.randint(1, 17, (5, 6))
            inputs = (ids, torch.ones(5, 6, dtype=torch.long))
        sharded = copy.deepcopy(model)
        (apply_tp_vit if kind == "vit" else apply_tp_clip_text)(sharded.encoder if kind == "text" else sharded, mesh)
        weight = torch.randn(5, 8)
        out_ref, out_tp = model(*inputs), sharded(*inputs)
        assert torch.allclose(out_ref, out_tp, atol=1e-5), (out_ref - out_tp).abs().max()
        (out_ref * weight).sum().backward()
        (out_tp * weight).sum().backward()
        n_sharded = 0
        for (name, p_ref), (_, p_tp) in zip(model.named_parameters(), sharded.named_parameters()):
            grad = p_tp.grad
            if isinstance(grad, DTensor):
                assert isinstance(p_tp, DTensor), name
                if any(not isinstance(pl, Replicate) for pl in p_tp.placements):
                    n_sharded += 1
                    assert p_tp.to_local().numel() * world == p_ref.numel(), name
                grad = grad.full_tensor()
                assert torch.equal(p_tp.full_tensor(), p_ref.detach()), name
            assert torch.allclose(grad, p_ref.grad, rtol=1e-4, atol=1e-5), (name, (grad - p_ref.grad).abs().max())
        assert n_sharded >= 6
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {err!r}")
        raise


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["vit", "text"])
def test_tp2_tower_matches_unsharded(kind, tmp_path):
    ctx = mp.get_context("fork")
    errors = ctx.SimpleQueue()
    init = f"file://{os.path.join(tmp_path, 'store')}"
    mp.start_processes(_worker, args=(2, init, kind, errors), nprocs=2, start_method="fork", join=True)
    assert errors.empty()
