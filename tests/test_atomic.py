"""Atomic writes (data/atomic.py) and the plot save built on them (training/plotting.py): while a write is under
way the destination still holds the old file; a write that fails leaves the old file and no temporary; the new
file gets the permissions an ordinary write would."""
from __future__ import annotations

import os

import pytest

from data.atomic import atomic_write, write_bytes_atomic, write_text_atomic
from training.plotting import pyplot, save_figure


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_the_destination_holds_the_old_file_until_the_write_ends(tmp_path):
    path = tmp_path / "report.md"
    path.write_text("old\n")
    with atomic_write(path) as f:
        f.write("new, first half ")
        f.flush()
        assert path.read_text() == "old\n"  # a reader during the write sees the whole old file
        f.write("and second half\n")
    assert path.read_text() == "new, first half and second half\n"
    assert leftovers(tmp_path) == []


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    write_text_atomic(path, '{"v": 1}\n')
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_write(path) as f:
            f.write('{"v": ')
            raise RuntimeError("disk full")
    assert path.read_text() == '{"v": 1}\n'
    assert leftovers(tmp_path) == []


def test_new_files_get_the_umask_mode_not_mkstemps_private_one(tmp_path):
    old = os.umask(0o022)
    try:
        write_bytes_atomic(tmp_path / "a.bin", b"\x00\x01")
    finally:
        os.umask(old)
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "a.bin").stat().st_mode & 0o777 == 0o644


def test_save_figure_writes_a_whole_png_and_keeps_the_old_one_on_failure(tmp_path):
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    out = tmp_path / "plots" / "curve.png"
    save_figure(fig, out)
    png = out.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png.endswith(b"IEND\xaeB`\x82")
    assert not plt.fignum_exists(fig.number)  # closed
    fig, ax = plt.subplots()
    with pytest.raises(ValueError):
        save_figure(fig, tmp_path / "plots" / "curve.nosuchformat")
    assert out.read_bytes() == png and leftovers(out.parent) == []
