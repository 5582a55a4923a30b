"""``editrain train --resume RUN`` without ``--config`` continues that run: its own
``config.toml`` is the base, the options given on the command line go over it (before, the
defaults were the base, so ``--resume runs/x --train.steps 200`` of a tiny-preset run was
refused for a model of another shape, another corpus and another method)."""

from __future__ import annotations

import pytest

from editrain.config import load_config, to_dict
from editrain.config.applicability import drop_inapplicable
from editrain.config.toml_io import dumps_toml, load_resumed_config, resumed_run_config
from editrain.errors import ConfigError
from editrain.launch.job import resolved


def _run(tmp_path, **sections):
    """A run directory whose config.toml is written as the launcher writes it."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "step_00000004" / "editrain.json").write_text("{}")
    cfg = load_config(None, sections)
    data = drop_inapplicable(to_dict(resolved(cfg)))
    data.update(run_dir=str(run), overwrite=True, quiet=True)
    (run / "config.toml").write_text(dumps_toml(data))
    return run


def test_the_runs_configuration_is_the_base_and_the_options_go_over_it(tmp_path):
    run = _run(tmp_path, model={"preset": "tiny", "n_layers": 3}, train={"steps": 8},
               sync={"method": "diloco", "local_sgd_sync_interval": 4},
               dist={"nproc": 2, "shard_size": 1})
    for resume in (run, run / "checkpoints" / "step_00000004"):
        cfg, source = load_resumed_config(str(resume), {"resume": str(resume),
                                                        "train": {"steps": 12}})
        assert source == run / "config.toml" == resumed_run_config(str(resume))
        assert (cfg.model.preset, cfg.model.n_layers) == ("tiny", 3)
        assert (cfg.sync.method, cfg.sync.local_sgd_sync_interval) == ("diloco", 4)
        assert (cfg.dist.nproc, cfg.dist.shard_size) == (2, 1)
        assert cfg.train.steps == 12  # the option given now
        # the job's own flags are not the run's: never overwrite, quiet or a run dir
        assert (cfg.overwrite, cfg.quiet, cfg.run_dir) == (False, False, None)
        assert cfg.resume == str(resume)


def test_without_a_config_toml_the_defaults_stand(tmp_path):
    (tmp_path / "bare").mkdir()
    cfg, source = load_resumed_config(str(tmp_path / "bare"), {"train": {"steps": 5}})
    assert source is None and cfg.model.preset == load_config(None, {}).model.preset


@pytest.mark.parametrize("text, said", [
    ("[train\nsteps = 1", "is not the TOML editrain writes"),
    ("x" * (2 << 20), "more than the 1048576 it can hold"),
    ("[train]\nsteps = -3\n", "train.steps: must be >= 1, got -3")])
def test_a_hostile_config_toml_is_one_line(tmp_path, text, said):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_resumed_config(str(run), {})
    assert said in str(e.value) and "\n" not in str(e.value)


def test_what_the_options_make_inapplicable_is_dropped_if_the_run_set_it(tmp_path):
    """A pipeline run resumed with --dist.pp_size 1: its pp_microbatches no longer applies
    and goes (the checkpoint check then names the pp size); the same option given now is
    refused, as for any job."""
    run = _run(tmp_path, model={"preset": "tiny", "n_layers": 4, "tie_embeddings": False},
               dist={"nproc": 4, "shard_size": 1, "pp_size": 2, "pp_microbatches": 4})
    base = {"resume": str(run)}
    cfg, _ = load_resumed_config(str(run), base)
    assert (cfg.dist.pp_size, cfg.dist.pp_microbatches) == (2, 4)
    cfg, _ = load_resumed_config(str(run), {**base, "dist": {"pp_size": 1}})
    assert cfg.dist.pp_size == 1 and cfg.dist.pp_microbatches == load_config().dist.pp_microbatches
    with pytest.raises(ConfigError, match="dist.pp_microbatches: applies only where"):
        load_resumed_config(str(run), {**base, "dist": {"pp_size": 1, "pp_microbatches": 8}})


def test_a_run_written_under_older_rules_resumes(tmp_path):
    """A config.toml an older editrain wrote with an option that did nothing then and is
    refused now (a diloco run's sync.prefetch_depth: its rounds are not layer-wise) resumes
    without it; refused from the run's own file, no option given could have helped."""
    run = _run(tmp_path, sync={"method": "diloco"})
    text = (run / "config.toml").read_text()
    (run / "config.toml").write_text(text.replace("[sync]\n", "[sync]\nprefetch_depth = 2\n"))
    assert "prefetch_depth = 2" in (run / "config.toml").read_text()
    cfg, _ = load_resumed_config(str(run), {"resume": str(run)})
    assert (cfg.sync.method, cfg.sync.prefetch_depth) == ("diloco", 1)


def test_a_ft_runs_checkpoints_resume_only_with_ft(tmp_path):
    """A --ft run's group checkpoint holds that group's data positions alone: a plain job
    refuses it before any worker starts, naming the option and what to do; the run's
    directory says the same; a group's checkpoint takes the run's config.toml (above it)."""
    from editrain.checkpoint import MARKER, check_compatible, resolve_resume
    from editrain.config.toml_io import resumed_run_config
    from editrain.errors import CheckpointError

    ft = {"format": 3, "config": {"dist": {"fault_tolerance": "torchft"}}}
    plain = {"format": 3, "config": {"dist": {"fault_tolerance": "none"}}}
    (said,) = check_compatible(ft, plain)
    assert said.startswith("dist.fault_tolerance: the checkpoint is one replica group's")
    assert "--ft --resume RUN_DIR" in said
    assert check_compatible(ft, ft) == [] and check_compatible(plain, ft) == []
    run = tmp_path / "ft"
    ckpt = run / "replica0" / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    (ckpt / MARKER).write_text("{}")
    with pytest.raises(CheckpointError, match=r"^--resume: .* is a --ft run .* resume it with "
                                              r"--ft$"):
        resolve_resume(run)
    (run / "config.toml").write_text("[train]\nsteps = 3\n")
    assert resumed_run_config(str(ckpt)) == run / "config.toml"
    assert resumed_run_config(str(run / "replica0")) == run / "config.toml"


def test_a_resumed_run_does_not_fail_again_unless_told_so(tmp_path):
    """sim.fail killed a worker of the job that was; a --resume of the run died again at
    the same step on every resume (exit 17) until --sim.fail none. The stragglers and
    links of the simulated cluster stay; a fault given again applies."""
    run = _run(tmp_path, model={"preset": "tiny"}, train={"steps": 8},
               dist={"nproc": 2, "shard_size": 1},
               sim={"fail": "1@4:checkpoint", "straggler": "1=2"})
    cfg, _ = load_resumed_config(str(run), {"resume": str(run), "train": {"steps": 12}})
    assert cfg.sim.fail is None and cfg.sim.straggler == ["1=2"]
    again, _ = load_resumed_config(str(run), {"resume": str(run), "train": {"steps": 12},
                                              "sim": {"fail": "0@10"}})
    assert again.sim.fail == "0@10"


def test_each_job_that_resumes_the_run_writes_its_configuration_and_keeps_the_old(tmp_path):
    """``config.toml`` stayed the first job's: after ``--resume RUN --nproc 1 --steps 28`` a
    plain ``--resume RUN`` went back to nproc 2 (an elastic resume) and steps 12 (refused:
    no steps left). Each job that resumes the run now writes its own configuration there,
    and its line of the run record's history keeps the file it replaced."""
    import json

    from editrain import rundir
    from editrain.launch.run_dir import prepare_run_dir

    run = tmp_path / "run"
    first = {"model": {"preset": "tiny"}, "train": {"steps": 12},
             "dist": {"nproc": 2, "shard_size": 1}, "run_dir": str(run)}
    record = prepare_run_dir(load_config(None, first), run)
    original = (run / "config.toml").read_text()
    ckpt = run / "checkpoints" / "step_00000012"
    ckpt.mkdir(parents=True)
    (ckpt / "editrain.json").write_text(json.dumps(
        {"step": 12, "run_id": record.run_id, "branch": record.branch}))

    over = {"resume": str(run), "dist": {"nproc": 1}, "train": {"steps": 28}}
    cfg, _ = load_resumed_config(str(run), over)
    prepare_run_dir(cfg, run)
    # the next plain --resume RUN continues with the latest job's settings
    plain, _ = load_resumed_config(str(run), {"resume": str(run)})
    assert (plain.dist.nproc, plain.train.steps, plain.model.preset) == (1, 28, "tiny")
    # as --config of a new run, the file starts a run: no job flag of the resume in it
    as_config = load_config(run / "config.toml", {"run_dir": str(tmp_path / "new")})
    assert (as_config.resume, as_config.overwrite) == (None, False)
    last = rundir.read_record(run).history[-1]
    # what the first job's file held and this job changed; not the file's ~4 KB of text
    assert last["config_changed"] == {"dist.nproc": "2 -> 1", "train.steps": "12 -> 28"}
    assert "config_before" not in last and "nproc = 2\n" in original

    # A job that changes nothing keeps the file as it is, and its line says nothing of it.
    before = (run / "config.toml").read_text()
    prepare_run_dir(plain, run)
    assert (run / "config.toml").read_text() == before
    assert "config_before" not in rundir.read_record(run).history[-1]


def _resumable_run(tmp_path, steps=12):
    """A run claimed by a first job, with a checkpoint at step 4 to resume from."""
    import json

    from editrain.launch.run_dir import prepare_run_dir

    run = tmp_path / "run"
    record = prepare_run_dir(load_config(None, {"model": {"preset": "tiny"},
                                                "train": {"steps": steps},
                                                "run_dir": str(run)}), run)
    ckpt = run / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "editrain.json").write_text(json.dumps(
        {"step": 4, "run_id": record.run_id, "branch": record.branch}))
    return run


def _resume(run, **sections):
    from editrain.launch.run_dir import prepare_run_dir

    cfg, _ = load_resumed_config(str(run), {"resume": str(run), **sections})
    return prepare_run_dir(cfg, run)


def test_resumes_that_change_options_keep_the_record_small_and_say_what_changed(tmp_path):
    """Each job that resumed with a changed option kept the whole old config.toml (2 to 4
    KB) in its history line: the record grew by that per resume (2.5 KB here, 360 bytes now).
    Now a line keeps the options changed, old and new; the run's options before each job
    are the latest config.toml with the lines' changes undone, from the last line back."""
    import itertools
    import tomllib

    from editrain import rundir

    run = _resumable_run(tmp_path)
    first = tomllib.loads((run / "config.toml").read_text())
    assert len((run / "config.toml").read_bytes()) > 1500  # what a line used to copy
    record = run / "editrain-run.json"
    sizes = [record.stat().st_size]
    jobs = 8
    for job in range(jobs):
        _resume(run, train={"steps": 20 + job, "lr": 1e-3 * (job + 1)})
        sizes.append(record.stat().st_size)
    growth = [b - a for a, b in itertools.pairwise(sizes)]
    assert max(growth) < 600, growth  # a line's own fields and two changes
    history = rundir.read_record(run).history
    assert len(history) == jobs + 1 and all("config_before" not in h for h in history)
    assert history[1]["config_changed"] == {"train.lr": f"{first['train']['lr']!r} -> 0.001",
                                            "train.steps": "12 -> 20"}
    assert history[-1]["config_changed"] == {"train.lr": "0.007 -> 0.008",
                                             "train.steps": "26 -> 27"}
    # undoing the changes from the last line back gives the first job's options
    options = tomllib.loads((run / "config.toml").read_text())
    for line in reversed(history[1:]):
        for name, change in line["config_changed"].items():
            section, key = name.split(".")
            old, new = change.split(" -> ")
            assert options[section][key] == tomllib.loads(f"v = {new}")["v"]
            options[section][key] = tomllib.loads(f"v = {old}")["v"]
    assert options == first


def test_a_record_of_an_older_editrain_with_config_before_still_reads(tmp_path):
    """Records written before kept the replaced file's text (``config_before``) in history
    lines: they read as before, keep those lines as they are, and the next job's line holds
    its changes only."""
    import json

    from editrain import rundir

    run = _resumable_run(tmp_path)
    path = run / "editrain-run.json"
    data = json.loads(path.read_text())
    old_text = (run / "config.toml").read_text()
    data["history"].append({"started_at": "2024-01-01 00:00:00", "pid": 1,
                            "config_before": old_text,
                            "config_changed": {"train.steps": "8 -> 12"}})
    path.write_text(json.dumps(data, indent=1))
    assert rundir.read_record(run).history[-1]["config_before"] == old_text
    _resume(run, train={"steps": 30})
    history = rundir.read_record(run).history
    assert history[-2]["config_before"] == old_text  # the older line is kept as it was
    assert history[-1]["config_changed"] == {"train.steps": "12 -> 30"}
    assert "config_before" not in history[-1]


def test_a_config_toml_that_is_not_toml_is_kept_as_text(tmp_path):
    """A config.toml editrain did not write (not TOML) cannot be compared option by option:
    its text is the one record of what it held, so that line keeps it, once (the job
    writes its own file, and the next change is recorded as options)."""
    from editrain import rundir

    run = _resumable_run(tmp_path)
    (run / "config.toml").write_text("this is [not toml\n")
    cfg = load_config(None, {"model": {"preset": "tiny"}, "train": {"steps": 20},
                             "run_dir": str(run), "resume": str(run)})
    from editrain.launch.run_dir import prepare_run_dir

    prepare_run_dir(cfg, run)
    last = rundir.read_record(run).history[-1]
    assert last["config_before"] == "this is [not toml\n" and "config_changed" not in last
    _resume(run, train={"steps": 24})
    last = rundir.read_record(run).history[-1]
    assert last["config_changed"] == {"train.steps": "20 -> 24"} and "config_before" not in last


def test_a_config_toml_that_cannot_be_kept_is_refused_before_any_work(tmp_path):
    """The job replaces the run's config.toml and keeps the old one in the record: one it
    cannot read back within the bound (here a resume with --config, which does not read
    it) is refused by the check, naming it, and nothing is written."""
    import json

    from editrain.errors import RunDirError
    from editrain.launch.run_dir import check_run_dir, prepare_run_dir

    run = tmp_path / "run"
    record = prepare_run_dir(load_config(None, {"run_dir": str(run)}), run)
    ckpt = run / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "editrain.json").write_text(json.dumps(
        {"step": 4, "run_id": record.run_id, "branch": record.branch}))
    (run / "config.toml").write_text("# " + "x" * (2 << 20) + "\n")
    before = (run / "editrain-run.json").read_text()
    cfg = load_config(None, {"run_dir": str(run), "resume": str(run)})
    with pytest.raises(RunDirError, match=r"config\.toml\": the run's configuration has .* "
                                          r"move it away first"):
        check_run_dir(cfg, run)
    with pytest.raises(RunDirError, match="cannot be kept in the run record"):
        prepare_run_dir(cfg, run)
    assert (run / "editrain-run.json").read_text() == before
    assert (run / "config.toml").stat().st_size > 2 << 20
