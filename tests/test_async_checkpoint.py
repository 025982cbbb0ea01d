"""The background saver's promises, in one process: ``meta.pt`` only after the shards, removals
only after the save in flight succeeded, a failed save named at the next wait."""

from __future__ import annotations

import pytest
import torch

import lightning_distmm as ldm
from lightning_distmm.async_checkpoint import AsyncSaver
from lightning_distmm.checkpoint import META_FILE


def test_a_save_is_complete_once_waited_for_and_copies_what_it_writes(tmp_path):
    saver, weight = AsyncSaver(), torch.arange(6.0)
    old = tmp_path / "step=1"
    old.mkdir()
    saver.save({"state_dict": {"w": weight}}, tmp_path / "step=2", {"global_step": 2})
    weight.add_(100.0)  # the next optimizer step, while the save may still be writing
    saver.remove(old)  # ModelCheckpoint drops the previous one as soon as the new one started
    saver.wait()
    assert not old.exists() and ldm.last_checkpoint(tmp_path) == str(tmp_path / "step=2")
    assert torch.load(tmp_path / "step=2" / META_FILE) == {"global_step": 2}
    import torch.distributed.checkpoint as dcp

    loaded = {"state_dict": {"w": torch.zeros(6)}}
    dcp.load(loaded, checkpoint_id=tmp_path / "step=2", no_dist=True)
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(6.0))  # the values at the save, not after
    assert len(saver.blocking_seconds) == 1


def test_a_failed_save_keeps_the_folders_it_would_have_replaced(tmp_path):
    saver = AsyncSaver()
    old = tmp_path / "step=1"
    old.mkdir()
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the checkpoint folder should go")
    saver.save({"state_dict": {"w": torch.ones(3)}}, blocked, {"global_step": 2})
    saver.remove(old)
    with pytest.raises(RuntimeError, match="asynchronous checkpoint save into .*not-a-folder failed") as err:
        saver.wait()
    assert old.exists() and "kept, since it failed" in str(err.value)
    saver.wait()  # nothing in flight any more


def test_wait_returns_only_once_meta_is_written(tmp_path, monkeypatch):
    """The future's waiters wake before its done-callbacks run: ``wait`` must also wait for the
    ``meta.pt`` the callback writes (a slow filesystem made slower here), or the end of fit could
    end the process with the newest save incomplete."""
    import time

    import lightning_distmm.async_checkpoint as saving

    write = saving.write_atomically

    def slow(path, data):  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        write(path, data)

    monkeypatch.setattr(saving, "write_atomically", slow)
    saver = AsyncSaver()
    saver.save({"state_dict": {"w": torch.ones(2)}}, tmp_path / "step=3", {"global_step": 3})
    saver.wait()
    assert (tmp_path / "step=3" / META_FILE).is_file() and ldm.last_checkpoint(tmp_path) == str(tmp_path / "step=3")
