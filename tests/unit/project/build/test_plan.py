"""The pure planner: specs + recorded state + --stop-after -> decisions, without any engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from spill.project.build.plan import PlanError, Recorded, StopAfter, describe_change, plan
from spill.project.build.specs import specs
from spill.project.config import from_record
from spill.project.data import Prepared
from tests.conftest import ENGINES, assert_not_imported

CONFIG = {
    "schema_version": 1,
    "name": "p",
    "seed": 0,
    "data": {
        "file": "d.csv",
        "input": "text",
        "output": "label",
        "task": "auto",
        "test_fraction": 0.2,
    },
    "model": {"name": "tiny:llama:1"},
    "teacher": {"name": None, "max_new_tokens": 64, "temperature": 0.0, "batch": 8},
    "tune": {
        "steps": 40,
        "lr": 0.001,
        "warmup": 0,
        "weight_decay": 0.0,
        "rank": 4,
        "alpha": None,
        "dropout": 0.0,
        "targets": "q_proj,v_proj",
        "batch": 4,
        "micro_batch": 2,
        "seq_len": 64,
        "ckpt_every": 10,
        "activations": "auto",
    },
    "eval": {"max_new_tokens": None, "batch": 8},
    "engine": {
        "name": "torch",
        "device": None,
        "dtype": None,
        "ring": None,
        "resident": False,
        "memory": None,
    },
    "prompt": {"template": "{input}\n", "chat": False},
}
PREPARED = Prepared("classification", ("a", "b"), 10, b"train\n", b"test\n", b"prompts\n", 8, 2)


def project(**changes):
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in CONFIG.items()}
    for path, value in changes.items():
        section, _, key = path.partition("__")
        if key:
            doc[section][key] = value
        else:
            doc[section] = value
    return from_record(doc, Path("/tmp/p"))


def done_records(stage_specs, status="done", **extra):
    out = {}
    for s in stage_specs:
        st = "skipped" if not s.enabled else status
        out[s.name] = Recorded(st, s.fingerprint, dict(s.inputs), **extra)
    return out


def actions(decisions):
    return {d.stage: d.action for d in decisions}


def test_nothing_recorded_runs_everything_but_a_missing_teacher():
    d = plan(specs(project(), PREPARED), {})
    assert actions(d) == {
        "eval:base": "run",
        "distill": "skip",
        "tune": "run",
        "eval": "run",
        "export": "skip",
    }
    assert all(x.fresh for x in d if x.action == "run")
    assert d[0].reason == "fresh: not run yet"
    assert "no teacher" in d[1].reason


def test_finished_build_is_all_done():
    s = specs(project(), PREPARED)
    d = plan(s, done_records(s))
    assert actions(d) == {
        "eval:base": "done",
        "distill": "skip",
        "tune": "done",
        "eval": "done",
        "export": "skip",
    }
    assert not any(x.works for x in d)


@pytest.mark.parametrize(
    "change",
    [
        {"tune__ckpt_every": 1},
        {"tune__activations": "recompute"},
        {"eval__batch": 1},
        {"teacher__batch": 2},
        {"engine__name": "mlx", "engine__dtype": "bfloat16", "engine__ring": 2},
    ],
    ids=["ckpt_every", "activations", "eval.batch", "teacher.batch", "engine"],
)
def test_values_that_cannot_change_results_rerun_nothing(change):
    recorded = done_records(specs(project(), PREPARED))
    d = plan(specs(project(**change), PREPARED), recorded)
    assert not any(x.works for x in d), [x.reason for x in d]


def test_a_tune_value_reruns_tune_and_eval_and_names_the_value():
    recorded = done_records(specs(project(), PREPARED))
    d = plan(specs(project(tune__lr=0.003), PREPARED), recorded)
    assert actions(d) == {
        "eval:base": "done",
        "distill": "skip",
        "tune": "run",
        "eval": "run",
        "export": "skip",
    }
    assert d[2].reason == "fresh: tune.lr 0.001 -> 0.003"
    assert d[3].reason == "fresh: tune changed"


def test_data_edits_rerun_the_stages_that_read_the_changed_rows():
    recorded = done_records(specs(project(), PREPARED))
    train_edit = replace(PREPARED, train=b"train edited\n", prompts=b"prompts edited\n")
    d = plan(specs(project(), train_edit), recorded)
    assert actions(d) == {
        "eval:base": "done",
        "distill": "skip",
        "tune": "run",
        "eval": "run",
        "export": "skip",
    }
    assert "training rows differ" in d[2].reason
    test_edit = replace(PREPARED, test=b"test edited\n")
    d = plan(specs(project(), test_edit), recorded)
    assert actions(d) == {
        "eval:base": "run",
        "distill": "skip",
        "tune": "done",
        "eval": "run",
        "export": "skip",
    }
    assert "test rows differ" in d[0].reason


def test_model_and_seed_changes_rerun_everything():
    recorded = done_records(specs(project(), PREPARED))
    for change, shown in (({"model__name": "tiny:llama:2"}, "model.name"), ({"seed": 3}, "seed")):
        d = plan(specs(project(**change), PREPARED), recorded)
        assert [x.action for x in d] == ["run", "skip", "run", "run", "skip"]
        assert d[0].reason.startswith(f"fresh: {shown} ")


def test_teacher_adds_distill_and_tune_reads_its_answers():
    plain = specs(project(), PREPARED)
    taught = specs(project(teacher__name="qwen2.5:1.5b"), PREPARED)
    d = plan(taught, done_records(plain))
    assert actions(d) == {
        "eval:base": "done",
        "distill": "run",
        "tune": "run",
        "eval": "run",
        "export": "skip",
    }
    assert taught[2].inputs["stage:distill"] == taught[1].fingerprint
    # a new teacher setting reruns distill, and tune because it reads distill's answers
    again = specs(project(teacher__name="qwen2.5:1.5b", teacher__max_new_tokens=9), PREPARED)
    d = plan(again, done_records(taught))
    assert actions(d)["distill"] == "run" and "teacher.max_new_tokens 64 -> 9" in d[1].reason
    assert d[2].reason == "fresh: distill changed"


def test_stopped_stage_continues_at_its_step():
    s = specs(project(), PREPARED)
    rec = done_records(s)
    rec["tune"] = Recorded("stopped", s[2].fingerprint, dict(s[2].inputs), done=12)
    del rec["eval"]
    d = plan(s, rec)
    assert actions(d) == {
        "eval:base": "done",
        "distill": "skip",
        "tune": "continue",
        "eval": "run",
        "export": "skip",
    }
    assert d[2].reason == "continue at step 12 of 40" and not d[2].fresh
    rec["tune"] = Recorded("running", s[2].fingerprint, dict(s[2].inputs), done=0)
    assert plan(s, rec)[2].reason == "continue (nothing committed yet)"


def test_stop_after_counts_and_waits():
    s = specs(project(), PREPARED)
    d = plan(s, {}, StopAfter.parse("train:20"))
    assert actions(d) == {
        "eval:base": "run",
        "distill": "skip",
        "tune": "run",
        "eval": "wait",
        "export": "skip",
    }
    assert d[2].stop == 20 and d[0].stop is None
    d = plan(s, {}, StopAfter.parse("eval:base:1"))
    assert d[0].stop == 1 and actions(d)["tune"] == "wait"
    rec = {s[0].name: Recorded("done", s[0].fingerprint, dict(s[0].inputs))}
    rec["tune"] = Recorded("stopped", s[2].fingerprint, dict(s[2].inputs), done=25)
    d = plan(s, rec, StopAfter.parse("tune:20"))
    assert actions(d)["tune"] == "wait" and "stopped at step 25" in d[2].reason


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tuning", "no stage 'tuning'"),
        ("eval:base:x", "no stage 'eval:base:x'"),
        ("tune:0", "at least 1"),
    ],
)
def test_stop_after_errors(text, message):
    with pytest.raises(PlanError, match=message):
        StopAfter.parse(text)


def test_stop_after_past_the_end():
    with pytest.raises(PlanError, match="past the end"):
        plan(specs(project(), PREPARED), {}, StopAfter.parse("tune:41"))
    with pytest.raises(PlanError, match="past the end"):
        plan(specs(project(), PREPARED), {}, StopAfter.parse("eval:3"))


def test_describe_change_lists_config_first_and_counts_the_rest():
    old = {"a": 1, "b": 2, "c": 3, "d": 4, "data:test.jsonl": "sha256:" + "0" * 64}
    new = {"a": 9, "b": 8, "c": 7, "d": 6, "data:test.jsonl": "sha256:" + "1" * 64}
    assert describe_change(old, new) == "a 1 -> 9; b 2 -> 8; c 3 -> 7; 1 more values"


def test_planning_imports_no_engine():
    code = (
        "import spill.project.build.plan, spill.project.build.stages, spill.project.build.build\n"
        "import spill.project.report.status, spill.project.build.execute\n"
    )
    assert_not_imported(code, (*ENGINES, "numpy", "hydra"))


def test_make_rule_a_stage_after_one_that_reruns_waits_and_drops_its_result():
    """Issue 8 item 2: tune.lr changed, --stop-after tune:3: eval is not done, and it says why."""
    recorded = done_records(specs(project(), PREPARED))
    d = plan(specs(project(tune__lr=0.004), PREPARED), recorded, StopAfter.parse("tune:3"))
    assert actions(d) == {
        "eval:base": "done",
        "distill": "skip",
        "tune": "run",
        "eval": "wait",
        "export": "skip",
    }
    assert d[2].stop == 3 and d[2].drop
    assert d[3].reason == "waits for tune (runs first)" and d[3].drop and not d[3].works
    # a stop before tune: tune itself waits, out of date, and both lose their records
    d = plan(specs(project(tune__lr=0.004), PREPARED), recorded, StopAfter.parse("eval:base"))
    assert actions(d)["tune"] == "wait" and d[2].drop
    assert (
        d[2].reason == "not now: after --stop-after eval:base; out of date: tune.lr 0.001 -> 0.004"
    )
    assert d[3].drop and d[3].reason.endswith("; out of date: tune changed")
    # nothing recorded: nothing to drop
    d = plan(specs(project(), PREPARED), {}, StopAfter.parse("tune:3"))
    assert d[3].reason == "waits for tune (runs first)" and not d[3].drop


def test_a_done_stage_downstream_of_a_continuing_one_is_not_done():
    s = specs(project(), PREPARED)
    rec = done_records(s)
    rec["tune"] = Recorded("stopped", s[2].fingerprint, dict(s[2].inputs), done=12)
    d = plan(s, rec)
    assert actions(d)["eval"] == "run" and d[3].reason == "fresh: tune runs first" and d[3].drop
    d = plan(s, rec, StopAfter.parse("tune:20"))
    assert d[3].action == "wait" and d[3].reason == "waits for tune (continues first)" and d[3].drop


def test_missing_outputs_restore_from_committed_state_without_rerunning_downstream():
    s = specs(project(), PREPARED)
    rec = done_records(s)
    rec["tune"] = replace(
        rec["tune"], problem="adapters/p missing", source="tune step 40 checkpoint"
    )
    d = plan(s, rec)
    assert actions(d) == {
        "eval:base": "done",
        "distill": "skip",
        "tune": "restore",
        "eval": "done",
        "export": "skip",
    }
    assert d[2].reason == "adapters/p missing; restored from tune step 40 checkpoint"
    assert d[2].works and not d[2].fresh and not d[2].drop
    # repairing happens even past --stop-after
    assert actions(plan(s, rec, StopAfter.parse("eval:base")))["tune"] == "restore"


def test_missing_outputs_that_cannot_be_restored_rerun_the_stage_and_what_reads_it():
    s = specs(project(), PREPARED)
    rec = done_records(s)
    rec["tune"] = replace(rec["tune"], problem="adapters/p missing")
    d = plan(s, rec)
    assert actions(d) == {
        "eval:base": "done",
        "distill": "skip",
        "tune": "run",
        "eval": "run",
        "export": "skip",
    }
    assert d[2].reason == "fresh: adapters/p missing" and d[2].fresh
    d = plan(s, rec, StopAfter.parse("eval:base"))
    assert [x.action for x in d[2:4]] == ["wait", "wait"] and d[2].drop and d[3].drop
    assert d[2].reason.endswith("; out of date: adapters/p missing")
    rec = done_records(s)
    rec["eval:base"] = replace(rec["eval:base"], problem="files/eval-base.jsonl changed")
    d = plan(s, rec)
    assert actions(d) == {
        "eval:base": "run",
        "distill": "skip",
        "tune": "done",
        "eval": "done",
        "export": "skip",
    }


def test_the_export_stage_runs_after_tune_and_only_when_the_adapter_or_its_settings_change():
    hf = {"formats": ["hf", "gguf"], "dtype": None, "quantize": None}
    s = specs(project(export=hf), PREPARED)
    assert [x.name for x in s][-1] == "export" and s[-1].total == 2 and s[-1].needs == ("tune",)
    assert actions(plan(s, {}))["export"] == "run"
    rec = done_records(s)
    assert set(actions(plan(s, rec)).values()) == {"done", "skip"}
    # another eval or teacher batch: the export is done; another dtype: it alone runs again
    d = plan(specs(project(export={**hf, "dtype": "f16"}), PREPARED), rec)
    assert actions(d) == {
        "eval:base": "done", "distill": "skip", "tune": "done", "eval": "done", "export": "run",
    }  # fmt: skip
    assert d[-1].reason == 'fresh: export.dtype null -> "f16"'
    # another adapter: tune, eval and export run again
    d = plan(specs(project(export=hf, tune__lr=0.002), PREPARED), rec)
    assert [actions(d)[k] for k in ("tune", "eval", "export")] == ["run", "run", "run"]
    # no formats: skipped, and the stage's inputs are those of every build before it existed
    off = specs(project(), PREPARED)[-1]
    assert (off.enabled, off.inputs) == (False, {"export.formats": []})
    assert plan([off], {})[0].reason == "skipped: no formats (export.formats is [])"


def test_an_export_stopped_after_one_format_continues_at_the_next():
    s = specs(project(export={"formats": ["hf", "mlx"]}), PREPARED)
    rec = done_records(s)
    rec["export"] = replace(rec["export"], status="stopped", done=1)
    d = plan(s, rec)
    assert (d[-1].action, d[-1].reason) == ("continue", "continue at format 1 of 2")
    assert plan(s, {}, StopAfter.parse("export:1"))[-1].stop == 1
    with pytest.raises(PlanError, match="past the end \\(export's formats: 2\\)"):
        plan(s, {}, StopAfter.parse("export:3"))
