"""The process group's engine-free parts: which launcher started a rank, a failed collective as
``GroupLost``'s one line, and the watchdog that bounds a collective that never returns (MLX's
ring waits forever for a peer that stopped answering). The exchanges themselves run in
tests/func/test_procs.py and test_procs_mlx.py, across real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from spill.errors import EXIT_PREEMPTED, UsageError
from spill.jobs import group
from spill.jobs.launch import launch, unsaid_loss


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, None),
        ({"WORLD_SIZE": "1", "RANK": "0"}, None),  # torchrun --nproc-per-node 1
        ({"WORLD_SIZE": "2", "RANK": "1"}, "torchrun"),
        ({"MLX_RANK": "0", "MLX_HOSTFILE": "/tmp/x"}, "mlx.launch"),
    ],
)
def test_the_launcher_is_read_from_the_environment(monkeypatch, env, want):
    for name in (*group.ENV, group.MLX_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert group.launcher() == want


def test_procs_inside_mlx_launch_is_refused(monkeypatch):
    monkeypatch.setenv("MLX_RANK", "0")
    with pytest.raises(UsageError, match="--procs inside mlx.launch: mlx.launch already started"):
        launch(2, ["tune", "m", "t.jsonl", "--procs", "2"])


class _Broken:
    @staticmethod
    def any_of(flag):
        raise RuntimeError("[ring] connection to a peer was lost")


def test_a_failed_collective_is_group_lost_in_one_line_said_at_once(capfd, monkeypatch):
    """Said where the loss is found, not by the CLI later: a launcher ending the rest of the job
    may end this process before the error reaches it."""
    monkeypatch.delenv(group.SAID_ENV, raising=False)
    g = group.Group(rank=1, world=2, exchange=_Broken)
    with pytest.raises(group.GroupLost) as e:
        g.stop_wanted(False)
    assert e.value.exit_code == EXIT_PREEMPTED and e.value.said
    assert str(e.value).startswith(
        "rank 1: another process of this job is gone (connection to a peer was lost); "
        "nothing half-published"
    )
    assert capfd.readouterr().err == f"spill: error: {e.value}\n"


def test_a_loss_a_caller_expects_is_not_said(capfd):
    """Rank 0 telling the others of its refusal, or waiting for them at a stop: a peer gone
    there is no news, and rank 0's own line stands alone."""
    g = group.Group(rank=0, world=2, exchange=_Broken)
    g._together()
    assert capfd.readouterr().err == ""


def test_the_loss_is_said_once_per_job_under_procs(capfd, monkeypatch, tmp_path):
    """Under ``--procs`` the first rank to claim the launcher's file says the line; another
    rank that finds the group lost too does not repeat it."""
    said = tmp_path / "said"
    monkeypatch.setenv(group.SAID_ENV, str(said))
    for rank in (1, 2):
        with pytest.raises(group.GroupLost) as e:
            group.Group(rank=rank, world=3, exchange=_Broken).stop_wanted(False)
        assert e.value.said  # the CLI does not say it either
    err = capfd.readouterr().err
    assert err.count("another process of this job is gone") == 1 and err.startswith(
        "spill: error: rank 1: "
    )
    assert said.read_bytes() == b"said"


def test_the_launcher_says_a_loss_no_rank_said(tmp_path):
    """torch's teardown may end every rank before one notices the loss: the launcher says it,
    naming how each rank ended; never where a rank said it, none died, or none was another's."""
    said = tmp_path / "said"
    line = unsaid_loss({1: -9, 0: -15}, 2, said)
    assert line.startswith(
        "the launcher: another process of this job is gone (rank 1 ended by SIGKILL, rank 0 "
        "ended by SIGTERM); nothing half-published: run the same command (any --procs)"
    )
    assert unsaid_loss({1: -9, 0: 75}, 2, said) is not None  # 75 alone says nothing was said
    assert unsaid_loss({1: 75, 0: 75}, 2, said) is None  # a stop: rank 0 said it
    assert unsaid_loss({0: -9}, 1, said) is None  # one process: no other to lose
    said.write_bytes(b"said")
    assert unsaid_loss({1: -9, 0: -15}, 2, said) is None


def test_the_watchdog_ends_a_collective_that_never_returns():
    """A real process whose collective sleeps forever: the watchdog says the line and exits 75."""
    code = textwrap.dedent(
        """
        import time
        from spill.jobs import group

        class Hung:
            @staticmethod
            def any_of(flag):
                time.sleep(3600)

        g = group.Group(rank=0, world=2, exchange=Hung, watchdog=group.Watchdog(0, 0.5))
        g.stop_wanted(False)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30
    )  # fmt: skip
    assert done.returncode == EXIT_PREEMPTED, done.stderr
    assert done.stderr.strip().startswith(
        "spill: error: rank 0: another process of this job is gone (no answer in 0.5 s)"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_whose_launcher_died_before_it_asked_stops_at_once(tmp_path):
    """A rank of ``--procs`` asks for its parent-death signal, then checks its parent is still
    the launcher that started it: one that died first (here: a pid that is not the parent)
    would send no signal, so the rank stops with GroupLost's line."""
    code = "from spill.jobs import group\ntry:\n    group.die_with_launcher()\n"
    code += "except group.GroupLost as e:\n    print(e)\nelse:\n    print('alive')\n"
    env = {**os.environ, group.PARENT_ENV: "1", "RANK": "1"}
    gone = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert gone.stdout.startswith("rank 1: another process of this job is gone (its launcher"), gone
    env[group.PARENT_ENV] = str(os.getpid())  # the child's real parent
    kept = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert kept.stdout.strip() == "alive", kept
