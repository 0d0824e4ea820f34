"""Checkpoint files on one rank: commit by rename, partial directories ignored, meta checked."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from spindle_cli.errors import ArtifactError, SpindleError
from spindle_cli.runtime import checkpoint

META = {"plan_sha256": "ab" * 32, "seed": 0, "dtype": "fp32", "dataset": "synthetic"}


def test_save_then_load_round_trips(tmp_path: Path) -> None:
    state = {"step": 3, "params": {"w": torch.arange(4.0)}, "optimizer": {}}
    checkpoint.save(str(tmp_path), 3, rank=0, world_size=1, state=state, meta=META)
    found = checkpoint.latest(str(tmp_path))
    assert found == tmp_path / "step-000003"
    assert sorted(p.name for p in found.iterdir()) == ["manifest.json", "rank-00000.pt"]
    step, loaded = checkpoint.load(found, rank=0, world_size=1, meta=META)
    assert step == 3 and torch.equal(loaded["params"]["w"], torch.arange(4.0))
    assert not list(tmp_path.glob(".*"))  # nothing hidden left behind


def test_load_puts_the_tensors_on_the_ranks_device(tmp_path: Path) -> None:
    """A rank resumed elsewhere (another node layout) gets its tensors on its own device, not
    on the device they were saved from ('meta' stands in for another GPU here)."""
    state = {"step": 3, "params": {"w": torch.arange(4.0)}, "optimizer": {}}
    checkpoint.save(str(tmp_path), 3, rank=0, world_size=1, state=state, meta=META)
    found = checkpoint.latest(str(tmp_path))
    _, loaded = checkpoint.load(found, rank=0, world_size=1, meta=META,
                                device=torch.device("meta"))
    assert loaded["params"]["w"].device == torch.device("meta")


def test_latest_ignores_uncommitted_directories(tmp_path: Path) -> None:
    checkpoint.save(str(tmp_path), 1, rank=0, world_size=1, state={"step": 1}, meta=META)
    # a crash during the save of step 2 leaves only the hidden directory
    (tmp_path / ".step-000002.tmp").mkdir()
    (tmp_path / ".step-000002.tmp" / "rank-00000.pt").write_bytes(b"partial")
    # and a directory without a manifest is not a checkpoint either
    (tmp_path / "step-000003").mkdir()
    # nor a name whose step is not ASCII digits (str.isdigit admits '²', int() refuses it)
    (tmp_path / "step-²").mkdir()
    assert checkpoint.latest(str(tmp_path)) == tmp_path / "step-000001"
    assert checkpoint.latest(str(tmp_path / "missing")) is None


def test_load_refuses_another_configuration(tmp_path: Path) -> None:
    checkpoint.save(str(tmp_path), 1, rank=0, world_size=1, state={"step": 1}, meta=META)
    found = checkpoint.latest(str(tmp_path))
    assert found is not None
    with pytest.raises(SpindleError, match="seed=0"):
        checkpoint.load(found, rank=0, world_size=1, meta={**META, "seed": 1})
    with pytest.raises(SpindleError, match="checkpoint of 1 ranks"):
        checkpoint.load(found, rank=0, world_size=2, meta=META)


def _overwrite(file: Path, at: bytes, damage: bytes = b"\xff" * 8) -> None:
    """`damage` written over the bytes of `file` that start where `at` first occurs."""
    data = bytearray(file.read_bytes())
    start = data.index(at)
    data[start : start + len(damage)] = damage
    file.write_bytes(bytes(data))


def test_damage_inside_a_whole_rank_file_names_the_file(tmp_path: Path) -> None:
    """Bytes changed inside the archive leave its directory whole, so the check before launch
    lets the file through; loading it then says which file, not only torch's message."""
    checkpoint.save(str(tmp_path), 1, rank=0, world_size=1,
                    state={"step": 1, "params": {"w": torch.arange(4.0)}}, meta=META)
    found = checkpoint.latest(str(tmp_path))
    assert found is not None
    file = found / "rank-00000.pt"
    data = file.read_bytes()
    pickled = data.index(b"\x80", data.index(b"data.pkl"))  # the pickle's protocol opcode
    _overwrite(file, data[pickled : pickled + 16], b"\xff" * 16)
    assert checkpoint.read_manifest(found, world_size=1, meta=META) == 1
    with pytest.raises(SpindleError, match=rf"^{file}: cannot load the checkpoint: \S+/data\.pkl "
                                           r"inside it is damaged \(its CRC-32 does not "
                                           r"match\)$") as e:
        checkpoint.load(found, rank=0, world_size=1, meta=META)
    assert e.value.hint == (f"there is no checkpoint before it: remove {found} and --resume "
                            "trains from step 0")


def test_damage_inside_a_tensor_is_found_before_it_trains(tmp_path: Path) -> None:
    """Bytes changed inside a tensor's data unpickle fine: torch loads them unchecked, and the
    run resumed on NaN weights, trained NaN and exited 0. The archive's CRC-32s show it."""
    for step in (1, 2):
        checkpoint.save(str(tmp_path), step, rank=0, world_size=1,
                        state={"step": step, "params": {"w": torch.full((64,), 1.5)}},
                        meta=META)
    found = checkpoint.latest(str(tmp_path))
    assert found is not None and found.name == "step-000002"
    file = found / "rank-00000.pt"
    _overwrite(file, torch.full((8,), 1.5).numpy().tobytes())
    assert torch.load(file, weights_only=True)["params"]["w"].isnan().any()  # unchecked
    with pytest.raises(SpindleError, match=rf"^{file}: cannot load the checkpoint: \S+/data/0 "
                                           r"inside it is damaged \(its CRC-32 does not "
                                           r"match\)$") as e:
        checkpoint.load(found, rank=0, world_size=1, meta=META)
    assert e.value.hint == f"remove {found} to resume from the checkpoint before it"


def test_a_damaged_checkpoint_whose_predecessors_are_damaged_too_says_so(
        tmp_path: Path) -> None:
    """Removing it would leave no complete checkpoint, and --resume refuses such a
    directory: the hint says what does train."""
    for step in (1, 2):
        checkpoint.save(str(tmp_path), step, rank=0, world_size=1,
                        state={"w": torch.full((64,), 1.5)}, meta=META)
    (tmp_path / "step-000001" / "rank-00000.pt").unlink()
    found = tmp_path / "step-000002"
    _overwrite(found / "rank-00000.pt", torch.full((8,), 1.5).numpy().tobytes())
    with pytest.raises(SpindleError) as e:
        checkpoint.load(found, rank=0, world_size=1, meta=META)
    assert e.value.hint == ("the checkpoints before it are damaged too: train from step 0 "
                            "with another --checkpoint-dir")


def test_a_rank_file_is_on_disk_before_it_is_renamed(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every other file Spindle writes is fsynced before its rename (`files.replace_atomic`);
    the rank files were not, so a checkpoint committed just before a power loss could hold
    one the disk never got."""
    events: list[str] = []
    fsync, replace = os.fsync, os.replace

    def synced(fd: int) -> None:
        events.append(f"fsync {os.readlink(f'/proc/self/fd/{fd}')}")
        fsync(fd)

    def renamed(src: object, dst: object) -> None:
        events.append(f"replace {src}")
        replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", synced)
    monkeypatch.setattr(checkpoint.os, "replace", renamed)
    checkpoint.save(str(tmp_path), 1, rank=0, world_size=1, state={"w": torch.ones(2)},
                    meta=META)
    tmp = tmp_path / ".step-000001.tmp" / ".rank-00000.pt.tmp"
    assert events.index(f"fsync {tmp}") < events.index(f"replace {tmp}")


def test_a_failed_write_names_the_file_and_keeps_the_checkpoints_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fills up during torch.save: torch says only 'unexpected pos', which the
    run printed as a RuntimeError; now the file, a likely cause and what to do."""
    checkpoint.save(str(tmp_path), 1, rank=0, world_size=1, state={"w": torch.ones(2)},
                    meta=META)

    def full(obj: object, f: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 224256 "
                           "vs 224144")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(SpindleError) as e:
        checkpoint.save(str(tmp_path), 2, rank=0, world_size=1, state={"w": torch.ones(2)},
                        meta=META)
    assert str(e.value) == (f"{tmp_path / '.step-000002.tmp' / 'rank-00000.pt'}: cannot write "
                            "the checkpoint (a full disk?): the file system took fewer bytes "
                            "than were written")
    assert e.value.hint is not None and "--resume" in e.value.hint
    # an output the machine refused: the run ends with exit code 2, as every command's does
    # (it ended with 1)
    assert isinstance(e.value, ArtifactError) and e.value.problem.startswith("cannot write")
    monkeypatch.undo()
    assert checkpoint.latest(str(tmp_path)) == checkpoint.step_dir(str(tmp_path), 1)


def test_one_run_at_a_time_writes_into_a_directory(tmp_path: Path) -> None:
    """Two runs given one --checkpoint-dir at once replaced each other's checkpoints, one
    reporting success with none of its own kept: rank 0 of a run holds the directory, and
    another run is refused, before launch (`check_free`) or, started at the same moment, by
    its rank 0 (`hold`)."""
    said = f"--checkpoint-dir {tmp_path / 'ck'}: another run is writing checkpoints there"
    with checkpoint.hold(str(tmp_path / "ck")):
        with pytest.raises(SpindleError, match=re.escape(said)):
            checkpoint.check_free(str(tmp_path / "ck"))
        with pytest.raises(SpindleError, match=re.escape(said)), \
                checkpoint.hold(str(tmp_path / "ck")):
            pass
    # the run ended (or its process did): the directory is free, and nothing was left in it
    checkpoint.check_free(str(tmp_path / "ck"))
    with checkpoint.hold(str(tmp_path / "ck")):
        pass
    assert list((tmp_path / "ck").iterdir()) == []
    checkpoint.check_free(str(tmp_path / "never-made"))
    assert not (tmp_path / "never-made").exists()


def test_keep_removes_all_but_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    """--keep-checkpoints N: once a checkpoint is committed the ones older than the newest N
    complete ones go, a damaged one among the newest not counted (N complete ones stay);
    nothing is removed while fewer than N are complete."""
    for step in (1, 2):
        checkpoint.save(str(tmp_path), step, rank=0, world_size=1, state={"step": step},
                        meta=META, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002"]
    checkpoint.save(str(tmp_path), 3, rank=0, world_size=1, state={"step": 3}, meta=META)
    (tmp_path / "step-000003" / "rank-00000.pt").unlink()  # damaged from outside
    checkpoint.save(str(tmp_path), 4, rank=0, world_size=1, state={"step": 4}, meta=META,
                    keep=2)
    # step 3 is damaged: the newest 2 complete are 4 and 2; 1 goes
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000002", "step-000003", "step-000004"]
    checkpoint.save(str(tmp_path), 5, rank=0, world_size=1, state={"step": 5}, meta=META,
                    keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000005"]
    assert checkpoint.latest(str(tmp_path)) == tmp_path / "step-000005"


def test_a_whole_checkpoint_that_fails_to_load_is_not_called_damaged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of memory on the device, a read error: the archive's CRC-32s match, so the hint
    does not say to remove it (with none before it, that meant training from step 0)."""
    checkpoint.save(str(tmp_path), 1, rank=0, world_size=1, state={"step": 1}, meta=META)

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(checkpoint.torch, "load", fails)
    with pytest.raises(SpindleError) as e:
        checkpoint.load(tmp_path / "step-000001", rank=0, world_size=1, meta=META)
    assert str(e.value).endswith("cannot load the checkpoint: CUDA out of memory. Tried to "
                                 "allocate 2.00 GiB")
    assert e.value.hint is not None and "remove" not in e.value.hint
    assert "CRC-32s match" in e.value.hint


def test_a_checkpoint_of_another_dtype_names_the_flag(tmp_path: Path) -> None:
    """--dtype's default became auto (a bf16 plan trains in bf16): a checkpoint taken in fp32
    before then resumes with --dtype fp32, which the hint says."""
    checkpoint.save(str(tmp_path), 1, rank=0, world_size=1, state={"step": 1}, meta=META)
    with pytest.raises(SpindleError, match="dtype='fp32', this run has 'bf16'") as e:
        checkpoint.read_manifest(tmp_path / "step-000001", world_size=1,
                                 meta={**META, "dtype": "bf16"})
    assert e.value.hint == ("resume with --dtype fp32, or give this run another "
                            "--checkpoint-dir")


def test_a_rank_file_of_another_rank_or_step_is_refused(tmp_path: Path) -> None:
    """Under ZeRO the ranks' files hold the same names and shard sizes: rank 0's file copied
    over rank 1's, or a manifest edited to another step, loaded and trained on silently."""
    checkpoint.save(str(tmp_path), 2, rank=0, world_size=1, state={"step": 2}, meta=META)
    found = checkpoint.step_dir(str(tmp_path), 2)
    rank_file = found / "rank-00000.pt"
    saved = torch.load(rank_file, weights_only=True)
    torch.save({**saved, "checkpoint": {"rank": 1, "step": 2}}, rank_file)
    with pytest.raises(SpindleError, match=re.escape(
            f"{rank_file}: cannot load the checkpoint: it holds rank 1's state (copied or "
            "renamed?)")):
        checkpoint.load(found, rank=0, world_size=1, meta=META)
    torch.save(saved, rank_file)
    manifest = found / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 2', '"step": 5'))
    with pytest.raises(SpindleError, match=re.escape(
            "it holds the state after step 2, its manifest.json says 5")):
        checkpoint.load(found, rank=0, world_size=1, meta=META)
    # a rank file saved before the rank and step were recorded: the executor's step decides
    torch.save({k: v for k, v in saved.items() if k != "checkpoint"}, rank_file)
    with pytest.raises(SpindleError, match=re.escape(
            "it holds the state after step 2, its manifest.json says 5")):
        checkpoint.load(found, rank=0, world_size=1, meta=META)
    manifest.write_text(manifest.read_text().replace('"step": 5', '"step": 2'))
    assert checkpoint.load(found, rank=0, world_size=1, meta=META) == (2, {"step": 2})


def test_a_full_disk_anywhere_in_a_save_is_a_refused_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Making the step's directory or writing its manifest on a full disk raised a bare
    OSError (exit code 1); like the rank file's, it is an output the machine refused."""
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    for target in ("mkdir", "write_text"):
        with monkeypatch.context() as m:
            m.setattr(Path, target, full)
            with pytest.raises(ArtifactError) as e:
                checkpoint.save(str(tmp_path), 2, rank=0, world_size=1, state={"step": 2},
                                meta=META)
        assert e.value.problem == "cannot write the checkpoint: No space left on device"
        assert e.value.hint is not None and "--resume" in e.value.hint


def test_a_save_removes_what_crashed_saves_left_hidden(tmp_path: Path) -> None:
    """A crash (or a full disk) mid-save leaves a hidden directory that no checkpoint is read
    from, which stayed, taking the space the failed save's hint asks to free."""
    for name in (".step-000121.tmp", ".step-000007.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank-00000.pt").write_bytes(b"partial")
    checkpoint.save(str(tmp_path), 3, rank=0, world_size=1, state={"step": 3}, meta=META)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003"]


def test_a_run_removes_what_crashed_saves_left_hidden_as_it_starts(tmp_path: Path) -> None:
    """Before its first save: that save needs the space they take (a run that failed on a
    full disk, resumed once space was freed, failed again, the leftover using the space)."""
    checkpoint.save(str(tmp_path), 1, rank=0, world_size=1, state={"step": 1}, meta=META)
    (tmp_path / ".step-000002.tmp").mkdir()
    (tmp_path / ".step-000002.tmp" / "rank-00000.pt").write_bytes(b"partial")
    checkpoint.check_free(str(tmp_path))  # before launch (a dry run too): changes nothing
    assert (tmp_path / ".step-000002.tmp" / "rank-00000.pt").is_file()
    with checkpoint.hold(str(tmp_path)):
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]
