"""Mixtures of prepared directories (data.path {dir: weight}) and named held-out sets (data.val_sets)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from data.datamodule import TokenDataModule
from data.errors import DataError
from data.layout import open_tokens, read_meta
from data.mixture import MixtureSampler
from data.prepare import prepare
from tests.test_data_datamodule import _Recorder, first, stand_in
from tests.test_data_support import VOCAB, prose_documents

SEQ, BATCH = 16, 4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two sources of different text prepared with one tokenizer, and one prepared with another."""
    root = tmp_path_factory.mktemp("mix")
    docs = prose_documents(40)
    for name, part in (("prose", docs[:20]), ("more", docs[20:])):
        (root / name).mkdir()
        for i, doc in enumerate(part):
            (root / name / f"{i:02d}.txt").write_text(doc, encoding="utf-8")
    prose = prepare([root / "prose"], output=root / "a" / "prose", vocab_size=VOCAB, val_fraction=0.2)
    more = prepare([root / "more"], output=root / "b" / "more", tokenizer=prose / "tokenizer.model", val_fraction=0.2)
    other = prepare([root / "more"], output=root / "c" / "other", vocab_size=VOCAB + 16, val_fraction=0.2)
    return {"prose": prose, "more": more, "other": other}


def make(path, **kwargs) -> TokenDataModule:
    dm = TokenDataModule(path, **{"seq_len": SEQ, "batch_size": BATCH, "seed": 7, **kwargs})
    dm.setup("fit")
    return dm


def test_proportions_within_sampling_error() -> None:
    sampler = MixtureSampler((10_000, 50_000, 3_000), (0.5, 0.3, 0.2), SEQ, seed=3)
    n = 40_000
    counts = np.bincount(sampler.sources(np.arange(n)), minlength=3)
    for count, w in zip(counts, (0.5, 0.3, 0.2), strict=True):
        assert abs(count / n - w) < 4 * math.sqrt(w * (1 - w) / n)  # 4 standard errors
    # pure: any slice of the stream, computed alone, gives the same (source, start)
    whole = sampler.locate(np.arange(1000))
    part = sampler.locate(np.arange(500, 600))
    assert np.array_equal(whole[0][500:600], part[0]) and np.array_equal(whole[1][500:600], part[1])


def test_windows_a_source_supplies_within_its_epoch_are_distinct() -> None:
    sampler = MixtureSampler((5_000, 5_000), (0.7, 0.3), SEQ, seed=1)
    n_windows = sampler.samplers[0].n_windows
    source, starts = sampler.locate(np.arange(n_windows))
    for i in range(2):
        assert len(np.unique(starts[source == i])) == (source == i).sum()


def test_batches_come_from_their_sources_in_proportion(dirs: dict[str, Path]) -> None:
    dm = make({str(dirs["prose"]): 3, str(dirs["more"]): 1})
    tokens = {p: np.asarray(open_tokens(p, read_meta(p), "train")) for p in (dirs["prose"], dirs["more"])}
    windows = {p: {t[s:s + SEQ + 1].tobytes() for s in range(len(t) - SEQ)} for p, t in tokens.items()}
    rows = torch.cat(first(dm.train_dataloader(), 100)).numpy().astype(tokens[dirs["prose"]].dtype)
    found = [[r.tobytes() in windows[p] for p in (dirs["prose"], dirs["more"])] for r in rows]
    assert all(any(f) for f in found)  # every row is a window of one of the sources
    # the share of prose among rows that only one source holds (short windows of similar text can be in both)
    only = [f[0] for f in found if f[0] != f[1]]
    assert len(only) > 200
    assert abs(sum(only) / len(only) - 0.75) < 4 * math.sqrt(0.75 * 0.25 / len(only))


def test_world_size_change_keeps_the_position(dirs: dict[str, Path]) -> None:
    mixture = {str(dirs["prose"]): 1, str(dirs["more"]): 1}
    single = first(make(mixture).train_dataloader(), 9)
    state = {"global_step": 3, "tokens_seen": 3 * BATCH * SEQ}
    for rank in range(3):
        resumed = make(mixture)
        resumed.load_state_dict(state)
        resumed.trainer = stand_in(global_step=3, rank=rank, world=3)
        assert torch.equal(first(resumed.train_dataloader(), 1)[0], single[3 + rank])


def test_refuses_sources_or_val_sets_with_another_tokenizer(dirs: dict[str, Path]) -> None:
    prose_sha, other_sha = (read_meta(dirs[k])["tokenizer_sha256"][:12] for k in ("prose", "other"))
    message = (rf"data.path '.*other' was prepared with another tokenizer \(sha256 {other_sha}…\) than "
               rf"'.*prose' \(sha256 {prose_sha}…\); prepare it again with `normlab prepare --tokenizer")
    with pytest.raises(DataError, match=message):
        make({str(dirs["prose"]): 1, str(dirs["other"]): 1})
    with pytest.raises(DataError, match=r"data.val_sets.held '.*other' was prepared with another tokenizer"):
        make(str(dirs["prose"]), val_sets={"held": str(dirs["other"])})
    with pytest.raises(DataError, match=r"weight of '.*more' must be a positive number, got -1"):
        TokenDataModule({str(dirs["prose"]): 1, str(dirs["more"]): -1})


def test_jsonargparse_reads_a_mixture_and_val_sets() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(TokenDataModule, "data")
    cfg = parser.parse_args(["--data.path", "{a: 0.7, b: 0.3}", "--data.val_sets", "{wiki: w}"])
    assert cfg.data.path == {"a": 0.7, "b": 0.3} and cfg.data.val_sets == {"wiki": "w"}
    assert parser.parse_args(["--data.path", "x"]).data.path == "x"


def _fit(path, ckpt_dir: Path, ckpt_path: str | None = None) -> list[torch.Tensor]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = _Recorder()
    trainer = L.Trainer(
        max_steps=4, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)],
    )
    trainer.fit(model, datamodule=TokenDataModule(path, seq_len=SEQ, batch_size=BATCH), ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.filterwarnings("ignore:The dirpath has changed", "ignore:You passed in a `val_dataloader`")
def test_resume_with_a_mixture_is_exact(dirs: dict[str, Path], tmp_path: Path) -> None:
    mixture = {str(dirs["prose"]): 0.6, str(dirs["more"]): 0.4}
    straight = _fit(mixture, tmp_path / "a")
    resumed = _fit(mixture, tmp_path / "b", ckpt_path=str(tmp_path / "a" / "epoch=0-step=2.ckpt"))
    assert len(straight) == 8 and len(resumed) == 4
    assert all(torch.equal(a, b) for a, b in zip(straight[4:], resumed, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_per_source_and_named_validation_in_a_real_fit(dirs: dict[str, Path], tmp_path: Path, ranks: int) -> None:
    """val/<source>/loss per mixture source, val/<name>/loss|bpb per held-out set, val/loss their weighted mean;
    a held-out set that is a source's own directory gives exactly that source's loss, and its bpb is what
    `normlab evaluate` computes for the same windows — also with the windows shared out over 2 ranks."""
    from tests.helpers.multiproc import REPO, run_here, run_normlab
    from tests.helpers.runs import scalars
    from training.eval.heldout import evaluate

    args = ["fit", "-c", str(REPO / "tests" / "helpers" / "tiny.yaml"), "--data.seq_len", str(SEQ),
            "--data.path", f"{{{dirs['prose']}: 3, {dirs['more']}: 1}}", "--data.val_sets", f"{{held: {dirs['more']}}}",
            "--runs_dir", str(tmp_path / "runs"), "--name", "mix", "--trainer.max_steps", "4",
            "--checkpoint.every_n_steps", "4"]
    if ranks == 2:
        run_normlab([*args, "--trainer.devices", "2", "--trainer.strategy", "ddp"], cwd=tmp_path)
    else:
        run_here(args)
    run = tmp_path / "runs" / "mix"
    prose, more, held = (scalars(run, f"val/{n}/loss")[4] for n in ("prose", "more", "held"))
    assert held == pytest.approx(more, rel=1e-6)
    assert scalars(run, "val/loss")[4] == pytest.approx(0.75 * prose + 0.25 * more, rel=1e-6)
    result = evaluate(run / "checkpoints" / "step-00000004", data=dirs["more"], log_to_run=False)
    assert result["loss"] == pytest.approx(held, rel=1e-5)
    assert scalars(run, "val/held/bpb")[4] == pytest.approx(result["bits_per_byte"], rel=1e-5)
    # Without --data, a mixture run is scored on each source, by name, on the windows the loop used.
    from training.eval.heldout import evaluate_sets
    by_name = {r["set"]: r["loss"] for r in evaluate_sets(run / "checkpoints" / "step-00000004", log_to_run=False)}
    assert by_name == pytest.approx({"prose": prose, "more": more}, rel=1e-5)
