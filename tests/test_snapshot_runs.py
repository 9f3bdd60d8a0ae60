"""Snapshot folders shared by runs (issue 14, item 5): each PostHocEMA run has an id written
into every snapshot and kept across resumes; a run holds a lock on its folder while it
writes; synthesis and ``inspect`` refuse a folder of several runs unless one is picked; a
snapshot changed between planning and reading is detected when read; a second run in a
folder keeps the first run's snapshots."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from _models import bn_mlp, walk
from emakit import EMARuntimeError, EMAStateError, PostHocEMA, PostHocWarning
from emakit.inspection import inspect_cmd
from emakit.posthoc import plan_synthesis
from emakit.posthoc.commands import synthesize
from emakit.posthoc.snapshots.folder import list_snapshots
from emakit.posthoc.snapshots.format import read_snapshot_info, write_snapshot

STEPS = 12


def trained_run(folder: Path, seed: int, steps: int = STEPS, **kw: object) -> PostHocEMA:
    """A PostHocEMA run in ``folder``: ``steps`` updates of a random walk of `bn_mlp`'s
    weights, snapshots every 4 steps."""
    net = bn_mlp(4, 8, 2, seed=seed)
    ema = PostHocEMA(
        net,
        update_every=1,
        checkpoint_every_num_steps=4,
        checkpoint_folder=folder,
        checkpoint_dtype=torch.float32,
        **kw,
    )
    walk(net, [ema], steps, seed=seed, scale=0.1)
    return ema


def weights(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten().float() for k, v in sorted(state.items())])


def test_every_snapshot_records_the_run_and_a_resume_keeps_it(tmp_path: Path) -> None:
    ema = trained_run(tmp_path, seed=0, steps=8)
    assert {s.run for s in list_snapshots(tmp_path)} == {ema.run_id}
    path = tmp_path / "state.pt"
    torch.save(ema.state_dict(), path)
    ema.release_folder()
    resumed = PostHocEMA(
        bn_mlp(4, 8, 2, seed=0),
        update_every=1,
        checkpoint_every_num_steps=4,
        checkpoint_folder=tmp_path,
        checkpoint_dtype=torch.float32,
    )
    assert resumed.run_id != ema.run_id
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert resumed.run_id == ema.run_id
    for _ in range(4):
        resumed.update()
    snaps = list_snapshots(tmp_path)
    assert {s.run for s in snaps} == {ema.run_id} and max(s.step for s in snaps) == 12
    plan_synthesis(tmp_path, sigma_rel=0.1)  # one run: no refusal


def test_a_resume_from_a_state_without_run_id_continues_the_folders_run(tmp_path: Path) -> None:
    ema = trained_run(tmp_path, seed=0, steps=8)
    state = dict(ema.state_dict())  # a rebuilt dict: torch's metadata is gone
    ema.release_folder()
    resumed = PostHocEMA(
        bn_mlp(4, 8, 2, seed=0),
        update_every=1,
        checkpoint_every_num_steps=4,
        checkpoint_folder=tmp_path,
    )
    with pytest.warns(PostHocWarning, match="continuing run"):
        resumed.load_state_dict(state)
    assert resumed.run_id == ema.run_id


def test_a_folder_of_two_runs_is_refused_unless_one_is_picked(tmp_path: Path) -> None:
    shared, alone = tmp_path / "shared", tmp_path / "alone"
    first = trained_run(shared, seed=0)
    first.release_folder()
    other = {"sigma_rels": (0.06, 0.25)}  # other file names: nothing is overwritten
    trained_run(alone, seed=1, **other)
    with pytest.warns(PostHocWarning, match="other run"):
        second = trained_run(shared, seed=1, **other)  # a second experiment in the same folder
    with pytest.raises(EMAStateError, match="2 runs") as info:
        plan_synthesis(shared, sigma_rel=0.1)
    assert first.run_id in str(info.value) and second.run_id in str(info.value)
    # Picking the run gives exactly what a folder of that run alone gives.
    picked = plan_synthesis(shared, sigma_rel=0.1, run=second.run_id).run()
    clean = plan_synthesis(alone, sigma_rel=0.1).run()
    assert torch.allclose(weights(picked), weights(clean), atol=1e-6, rtol=0)
    # A PostHocEMA synthesizes from its own run.
    own = second.synthesize_ema_model(sigma_rel=0.1).ema_model.state_dict()
    assert torch.allclose(weights(own), weights(clean), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="no snapshots"):
        plan_synthesis(shared, sigma_rel=0.1, run="nosuchrun")


def test_the_cli_refuses_a_folder_of_two_runs_unless_one_is_picked(tmp_path: Path) -> None:
    first = trained_run(tmp_path, seed=0)
    first.release_folder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        second = trained_run(tmp_path, seed=1, sigma_rels=(0.06, 0.25))
    out = tmp_path / "out.safetensors"
    args = [str(tmp_path), "--sigma-rel", "0.1", "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(synthesize, args)
    assert result.exit_code == 1 and "--run" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()
    result = CliRunner().invoke(synthesize, [*args, "--run", second.run_id])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(inspect_cmd, [str(tmp_path)])
    assert result.exit_code == 1 and "2 runs" in result.output, result.output
    result = CliRunner().invoke(inspect_cmd, [str(tmp_path), "--run", first.run_id])
    assert result.exit_code == 0 and first.run_id in result.output, result.output


def test_a_second_run_may_not_write_while_the_first_holds_the_folder(tmp_path: Path) -> None:
    first = trained_run(tmp_path, seed=0, steps=4)
    with pytest.raises(EMARuntimeError, match=first.run_id):
        trained_run(tmp_path, seed=1, steps=4)
    first.release_folder()
    trained_run(tmp_path, seed=2, steps=4)  # free again
    # The same run (a resumed object in the same process) shares it.
    state = first.state_dict()
    again = PostHocEMA(
        bn_mlp(4, 8, 2, seed=0),
        update_every=1,
        checkpoint_every_num_steps=4,
        checkpoint_folder=tmp_path / "other",
    )
    again.load_state_dict(state)
    assert again.run_id == first.run_id


def hold_the_folder(folder: Path, conn) -> None:  # a child: the other experiment
    ema = trained_run(folder, seed=0, steps=4)
    conn.send(ema.run_id)
    conn.recv()  # blocks until the parent kills it


@pytest.mark.skipif(
    sys.platform == "win32" or "fork" not in mp.get_all_start_methods(), reason="fork, flock"
)
def test_the_lock_holds_across_processes_and_dies_with_its_holder(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        child = ctx.Process(target=hold_the_folder, args=(tmp_path, child_end))
        child.start()
    child_end.close()  # the child's end: a child that dies closes the pipe for good
    try:
        assert parent_end.poll(60), "the child never took the lock"
        holder = parent_end.recv()
        with pytest.raises(EMARuntimeError, match=f"{holder}.*process {child.pid}"):
            trained_run(tmp_path, seed=1, steps=4)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)  # the killed run's snapshots
        trained_run(tmp_path, seed=1, steps=4)  # the lock died with the process


def test_a_snapshot_changed_after_planning_is_detected(tmp_path: Path) -> None:
    trained_run(tmp_path, seed=0)
    plan = plan_synthesis(tmp_path, sigma_rel=0.1)
    victim = plan.snapshots[1]
    info = read_snapshot_info(victim.path)
    with torch.no_grad():
        from safetensors.torch import load_file

        tensors = {k: v + 1 for k, v in load_file(victim.path).items()}
    write_snapshot(  # the same header, other weights: a rewrite by another process
        victim.path,
        tensors,
        step=info.step,
        t=info.t,
        gamma=info.gamma,
        sigma_rel=info.sigma_rel,
        profile=info.profile,
        update_every=info.update_every,
        copied=info.copied,
        run=info.run,
    )
    with pytest.raises(EMAStateError, match="changed after the synthesis was planned"):
        plan.run()


def test_releasing_the_folder_removes_the_lock_file(tmp_path: Path) -> None:
    ema = trained_run(tmp_path, seed=0, steps=4)
    assert (tmp_path / ".emakit-posthoc.lock").exists()
    ema.release_folder()
    assert not (tmp_path / ".emakit-posthoc.lock").exists()
    ema.checkpoint()  # takes it again
    assert (tmp_path / ".emakit-posthoc.lock").exists()
    del ema
    gc.collect()  # garbage-collected: released
    assert not (tmp_path / ".emakit-posthoc.lock").exists()


def test_a_second_run_in_the_same_folder_keeps_the_first_runs_snapshots(tmp_path: Path):
    from emakit.posthoc import list_snapshots

    def run(seed: int) -> PostHocEMA:
        net = nn.Linear(3, 2)
        torch.manual_seed(seed)
        ema = PostHocEMA(
            net, sigma_rels=(0.05, 0.28), checkpoint_every_num_steps=2, checkpoint_folder=tmp_path
        )
        for _ in range(8):
            with torch.no_grad():
                net.weight.add_(torch.randn(2, 3))
            ema.update()
        ema.release_folder()
        return ema

    first = run(0)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("step-*")}
    assert len(before) == 8  # 4 steps x 2 profiles
    with pytest.warns(Warning, match="theirs are kept"):
        second = run(1)
    for name, data in before.items():
        assert (tmp_path / name).read_bytes() == data, name  # run 1's, untouched
    runs = {s.run for s in list_snapshots(tmp_path)}
    assert runs == {first.run_id, second.run_id}
    assert len(list(tmp_path.glob(f"*_run-{second.run_id}.safetensors"))) == 8
    synth = second.synthesize_ema_model(sigma_rel=0.1)  # its own run's snapshots
    assert torch.isfinite(synth.ema_model.weight).all()
