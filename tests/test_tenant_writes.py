"""Writes follow no link made after the check (issue 36, point 10).

The driver resolves and contains a job's output directory once; the ranks
write the mp4 and the checkpoints minutes later. Namespace ``a`` (whose pods
can write its directory on a shared volume) swaps a directory on the way, or
the checkpoint directory, or a file name the writer will use, for a symbolic
link into namespace ``b``'s files in that window. Each write is refused
naming spec.output.uri, or lands in ``a``'s own directory; ``b``'s files
are untouched, read back from where ``b`` reads them.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from helpers import require_module
from videojob_runtime.beneath import Beneath
from videojob_runtime.errors import JobFailure
from videojob_runtime.locations import resolve_in_root

B_VIDEO = b"b's video"


@pytest.fixture
def outputs(tmp_path, monkeypatch) -> Path:
    """The output root with b's finished video; the driver's check of a's location already passed."""
    root = tmp_path / "outputs"
    monkeypatch.setenv("VIDEOJOB_OUTPUT_ROOT", str(root))
    (root / "b/videos").mkdir(parents=True)
    (root / "b/videos/job.mp4").write_bytes(B_VIDEO)
    return root


def _checked(uri: str = "local://videos") -> tuple[Path, Path]:
    """What the driver hands the ranks: a's output directory and the root it was contained in."""
    directory, root = resolve_in_root(uri, "output", "spec.output.uri", namespace="a")
    directory.mkdir(parents=True, exist_ok=True)
    return directory, root


def _swap_for_link(directory: Path, target: Path) -> None:
    """a replaces its checked directory by a link to ``target`` (after the check, before the write)."""
    directory.rename(directory.with_name(directory.name + "-was"))
    directory.symlink_to(target, target_is_directory=True)


def _b_untouched(outputs: Path) -> None:
    assert sorted(os.listdir(outputs / "b/videos")) == ["job.mp4"]
    assert (outputs / "b/videos/job.mp4").read_bytes() == B_VIDEO


def _frames() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 255, (3, 16, 16, 3), dtype=np.uint8)


def test_the_output_root_is_the_admin_s_and_the_directory_lies_in_a_s(outputs):
    directory, root = _checked("local://x/videos")
    assert root == outputs.resolve() and directory == root / "a/x/videos"


@pytest.mark.parametrize("swapped", ["output-dir", "namespace-dir"])
def test_a_directory_swapped_for_a_link_before_the_write_is_refused(outputs, swapped):
    require_module("av")
    from videojob_runtime.output import write_outputs

    directory, root = _checked()
    _swap_for_link(directory if swapped == "output-dir" else directory.parent,
                   outputs / "b/videos" if swapped == "output-dir" else outputs / "b")
    with pytest.raises(JobFailure, match=r"^spec.output.uri: .*symbolic link.*nothing was written through it") as err:
        write_outputs(_frames(), directory, "job", 8, {"job": "j"}, root=root)
    assert err.value.details["field"] == "spec.output.uri" and err.value.stage == "write"
    _b_untouched(outputs)


def test_a_directory_swapped_while_the_video_is_encoded_still_gets_a_s_files(outputs):
    """The swap lands between the video's partial file and the renames: every file goes to the
    directory that was opened (a's, now under its new name), none through the link."""
    require_module("av")
    from videojob_runtime.output import write_outputs

    directory, root = _checked()
    written = write_outputs(_frames(), directory, "job", 8, {"job": "j"}, root=root,
                            between_files=lambda: _swap_for_link(directory, outputs / "b/videos"))
    moved = directory.with_name("videos-was")
    assert sorted(os.listdir(moved)) == ["job.json", "job.mp4", "job.png"]
    assert written.video_bytes == (moved / "job.mp4").stat().st_size > 0
    _b_untouched(outputs)


def test_a_link_at_the_final_name_is_replaced_not_written_through(outputs):
    require_module("av")
    from videojob_runtime.output import write_failure, write_outputs

    directory, root = _checked()
    (directory / "job.mp4").symlink_to(outputs / "b/videos/job.mp4")
    (directory / "job.json").symlink_to(outputs / "b/videos/job.json")
    write_outputs(_frames(), directory, "job", 8, {"job": "j"}, root=root)
    assert not (directory / "job.mp4").is_symlink() and (directory / "job.mp4").stat().st_size > len(B_VIDEO)
    (directory / "job.json").unlink()
    (directory / "job.json").symlink_to(outputs / "b/videos/job.mp4")
    write_failure(directory, "job", {"ok": False}, root=root)
    assert not (directory / "job.json").is_symlink()
    _b_untouched(outputs)


def _store(directory: Path, root: Path):
    from videojob_runtime.checkpoint import CheckpointStore

    return CheckpointStore(directory / ".videojob-checkpoints" / "job-k", "f" * 64, steps=10, root=root)


def _state():
    torch = require_module("torch")
    return {"latents": torch.zeros(2, 2), "step": 1}


def test_a_checkpoint_directory_swapped_for_a_link_is_refused(outputs):
    directory, root = _checked()
    store = _store(directory, root)
    store.save(1, _state())
    assert store.newest().checkpoint.step == 1
    _swap_for_link(store.directory, outputs / "b/videos")
    with pytest.raises(JobFailure, match=r"^spec.output.uri: .*'job-k' on the way is a symbolic link"):
        store.save(2, _state())
    with pytest.raises(JobFailure, match="symbolic link"):
        store.newest()
    store.remove()  # a link where the directory was: left alone, and nothing of b's removed
    _b_untouched(outputs)


def test_planted_checkpoint_names_are_never_written_through(outputs):
    """The old writer's temporary name was predictable (.step-N.ckpt.tmp-PID) and opened without
    O_EXCL: a link there overwrote b's mp4. Links at every name the writer uses now change nothing of b's."""
    directory, root = _checked()
    store = _store(directory, root)
    store.save(1, _state())
    target = outputs / "b/videos/job.mp4"
    for name in (f".step-000002.ckpt.tmp-{os.getpid()}", "step-000002.ckpt"):
        (store.directory / name).symlink_to(target)
    path, _, _ = store.save(2, _state())
    assert path.is_file() and not path.is_symlink() and store.newest().checkpoint.step == 2
    _b_untouched(outputs)
    store.remove()
    assert not store.directory.exists() and not store.directory.parent.exists()
    _b_untouched(outputs)


def test_the_driver_sends_the_root_and_a_swapped_directory_fails_before_any_gpu(outputs):
    """The driver tells the ranks the root; its own writability probe opens the directory the same way."""
    from test_tenant_locations import _driver_request
    from videojob_runtime.driver import job_request

    job, output_dir, _ = job_request(_driver_request(output_uri="local://videos"))
    assert job.output_root == str(outputs.resolve()) and Path(job.output_dir) == output_dir
    with pytest.raises(ValueError, match="job.output_root is the driver's to set"):
        job_request(_driver_request(output_uri="local://videos", job={"output_root": "/"}))
    (output_dir.parent / "later").symlink_to(outputs / "b/videos")
    with pytest.raises(JobFailure, match="symbolic link"):
        # resolved (links followed, target outside a's directory): refused by the resolver already
        job_request(_driver_request(output_uri="local://later"))
    _b_untouched(outputs)


@pytest.mark.parametrize("relative", ["/abs", "../up", "a/../../up"])
def test_beneath_takes_only_relative_paths_without_dotdot(tmp_path, relative):
    with pytest.raises(ValueError, match="relative path without '..'"):
        Beneath(tmp_path, relative)


def test_beneath_refuses_a_file_where_a_directory_belongs(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(JobFailure, match="'f' on the way is a symbolic link or not a directory"):
        Beneath(tmp_path, "f/g", create=True)
