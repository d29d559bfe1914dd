"""Checkpoints: atomic per-rank shards; resuming equals an uninterrupted run."""

from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest

from tensoropt.errors import TensorOptError
from tensoropt.runtime import checkpoint as ckpt
from tensoropt.runtime.run import run_steps


def _same(a, b):
    assert a.losses == b.losses
    for name, value in a.params.items():
        np.testing.assert_array_equal(b.params[name], value)
    for name, value in a.states.items():
        np.testing.assert_array_equal(b.states[name], value)


def test_resume_equals_uninterrupted(outdirs, tmp_path):
    full = run_steps(outdirs("dp2_tp2"), 5)
    run_steps(outdirs("dp2_tp2"), 3, checkpoint=tmp_path)
    assert ckpt.latest_common_step(tmp_path, 4) == 3
    resumed = run_steps(outdirs("dp2_tp2"), 5, checkpoint=tmp_path, resume=True)
    assert resumed.start_step == 3
    _same(full, resumed)


def test_resume_uses_newest_step_every_rank_has(outdirs, tmp_path):
    full = run_steps(outdirs("dp2"), 4)
    run_steps(outdirs("dp2"), 3, checkpoint=tmp_path)
    # a crash while writing step 3: rank 1's newest shard never appeared
    ckpt.shard_path(tmp_path, 1, 3).unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rank_0.step_2.tensors", "rank_0.step_3.tensors", "rank_1.step_2.tensors"
    ]  # fmt: skip
    resumed = run_steps(outdirs("dp2"), 4, checkpoint=tmp_path, resume=True)
    assert resumed.start_step == 2
    _same(full, resumed)


def test_checkpoint_every_k_and_no_temp_files_left(outdirs, tmp_path):
    run_steps(outdirs("dp2"), 5, checkpoint=tmp_path, checkpoint_every=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["rank_0.step_4.tensors", "rank_0.step_5.tensors",
                     "rank_1.step_4.tensors", "rank_1.step_5.tensors"]  # fmt: skip
    _, meta = ckpt.load_shard(tmp_path, 1, 5)
    assert meta.step == 5 and len(meta.losses) == 5


def test_resume_refuses_another_seed_or_compile(outdirs, tmp_path):
    run_steps(outdirs("dp2"), 1, checkpoint=tmp_path, seed=1)
    with pytest.raises(TensorOptError, match="resume with --seed 1"):
        run_steps(outdirs("dp2"), 2, checkpoint=tmp_path, resume=True, seed=2)
    with pytest.raises(TensorOptError, match="another compiled output"):
        run_steps(outdirs("a2a2"), 2, checkpoint=tmp_path, resume=True, seed=1)


def test_resume_with_empty_directory_starts_over(outdirs, tmp_path):
    # nothing there to lose: a job that always passes --resume starts at step 0
    fresh = run_steps(outdirs("dp2"), 2, checkpoint=tmp_path / "new", resume=True)
    assert fresh.start_step == 0 and len(fresh.losses) == 2


def test_resume_needs_checkpoint(outdirs):
    with pytest.raises(TensorOptError, match="--resume needs --checkpoint"):
        run_steps(outdirs("dp2"), 2, resume=True)


def test_atomic_writes_follow_a_symlink_and_write_through_a_fifo(tmp_path):
    """The one atomic writer (files, profiles, plots, --save-params): a symlink's target is
    replaced and the link kept; a FIFO is written through, its reader gets the bytes."""
    from tensoropt.runtime.checkpoint import save_npz, write_atomic

    target = tmp_path / "sub" / "target.bin"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    write_atomic(link, b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"
    save_npz(link, {"w": np.arange(3.0)})
    assert link.is_symlink()
    with np.load(target) as saved:
        np.testing.assert_array_equal(saved["w"], np.arange(3.0))
    assert sorted(os.listdir(target.parent)) == ["target.bin"]  # no temp file left

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    save_npz(fifo, {"w": np.arange(4.0)})
    reader.join(timeout=30)
    assert fifo.is_fifo()
    with np.load(io.BytesIO(got[0])) as saved:
        np.testing.assert_array_equal(saved["w"], np.arange(4.0))
