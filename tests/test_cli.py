"""The command line as users drive it: exit codes, messages, what is written (and what is not)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml
from conftest import LIBRARY_NOISE, run_cli
from conftest import PROJECT_ROOT as ROOT
from omegaconf import OmegaConf

from offload_runner.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Mode, main, split_argv
from offload_runner.hardware import te_available as validation_te_available

BRIDGE_COMMAND = (
    "--recipe",
    "qwen3_30b_a3b_pretrain_config",
    "optimizer.optimizer_cpu_offload=True",
    "optimizer.optimizer_offload_fraction=0.5",
    "train.train_iters=20",
    "train.global_batch_size=8",
    "train.micro_batch_size=1",
)


def test_split_argv_translates_bridge_flags() -> None:
    options, hydra_args = split_argv(
        ["--recipe", "llama3_8b_pretrain_config", "--dry-run", "model.num_layers=1"]
    )
    assert options.mode == Mode.dry_run
    assert hydra_args == ["recipe=llama3_8b", "model.num_layers=1"]
    _, hydra_args = split_argv(["--recipe=tiny", "-m", "train.seed=1,2"])
    assert hydra_args == ["-m", "recipe=tiny", "train.seed=1,2"]
    _, hydra_args = split_argv(["recipe=qwen3_30b_a3b_pretrain_config"])
    assert hydra_args == ["recipe=qwen3_30b_a3b"]


def test_bridge_command_dry_run_saves_the_resolved_config(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main([*BRIDGE_COMMAND, f"output_dir={out}", "--dry-run"]) == EXIT_OK
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["name"] == "qwen3_30b_a3b"
    assert saved["optimizer"]["optimizer_cpu_offload"] is True
    assert saved["optimizer"]["optimizer_offload_fraction"] == 0.5
    assert saved["train"] == {**saved["train"], "train_iters": 20, "global_batch_size": 8}
    assert "${" not in (out / "config.yaml").read_text()  # resolved
    overrides = yaml.safe_load((out / "overrides.yaml").read_text())
    assert "optimizer.optimizer_offload_fraction=0.5" in overrides
    printed = capsys.readouterr().out
    assert "offloaded" in printed and "optimizer (hybrid)" in printed
    assert "checked" in printed and "plan: " in printed


def test_dry_run_is_a_summary_at_80_columns_and_the_tree_is_behind_full(tmp_path: Path) -> None:
    """What is offloaded, what the command line changed, whether it fits, the checks: a screen,
    not the resolved tree (485 lines before), which --full adds."""
    args = (
        "--recipe",
        "qwen3_30b_a3b_proxy",
        "offload/optimizer=states",
        "offload/activation=enabled",
        "--dry-run",
    )
    env_cols = {"COLUMNS": "80"}
    short = run_cli(*args, f"output_dir={tmp_path}/a", env=env_cols)
    assert short.returncode == EXIT_OK
    lines = short.stdout.splitlines()
    assert len(lines) <= 80 and all(len(line) <= 80 for line in lines)
    for said in (
        "changed on the command line:",
        "optimizer states (offload/optimizer=states)",
        "plan: ",
        "checked",
        "add --full",
    ):
        assert said in short.stdout
    full = run_cli(*args, "--full", f"output_dir={tmp_path}/b", env=env_cols)
    assert full.returncode == EXIT_OK and len(full.stdout.splitlines()) > 200
    assert run_cli("--recipe", "tiny", "--full").returncode == EXIT_USAGE


def test_hydra_native_command(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    code = main(
        [
            "recipe=qwen3_30b_a3b_proxy",
            "offload/optimizer=cpu_50",
            "offload/activation=enabled",
            "model.cpu_offloading_num_layers=2",
            f"output_dir={out}",
            "--dry-run",
        ]
    )
    assert code == EXIT_OK
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["cpu_offloading"] is True
    assert saved["model"]["cpu_offloading_num_layers"] == 2


def test_illegal_combination_lists_every_violation_and_writes_nothing(tmp_path: Path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "--recipe",
            "qwen3_30b_a3b",
            "offload/activation=enabled",
            "model.cuda_graph_impl=local",
            "optimizer.optimizer_offload_fraction=1.5",
            f"output_dir={out}",
            "--dry-run",
        ]
    )
    assert code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "Currently there is no support for Pipeline parallelism with CPU offloading" in err
    assert "CUDA graphs not supported with CPU offloading." in err
    assert "optimizer_offload_fraction must be in [0.0, 1.0]" in err
    assert err.count("fix:") >= 3
    assert not out.exists()


@pytest.mark.parametrize(
    "args",
    [
        ("--recipe", "tiny", "model.num_layerz=3"),  # typo: Hydra's message
        ("--recipe", "tiny", "model.num_layers=four"),  # wrong type
        ("--recipe", "no_such_recipe"),
        ("--recipe", "tiny", "offload/optimizer=cpu_33"),
        ("--recipe",),
        ("--recipe", "missing.yaml"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(args, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main([*args, f"output_dir={out}", "--dry-run"]) == EXIT_USAGE
    assert not out.exists()


def test_own_recipe_file(tmp_path: Path, capsys) -> None:
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("# @package _global_\n# mine\ndefaults:\n  - tiny\nname: mine\n")
    out = tmp_path / "run"
    assert main(["--recipe", str(recipe), f"output_dir={out}", "--dry-run"]) == EXIT_OK
    assert yaml.safe_load((out / "config.yaml").read_text())["name"] == "mine"


def test_list_recipes(capsys) -> None:
    assert main(["--list-recipes"]) == EXIT_OK
    printed = capsys.readouterr().out
    for name in ("qwen3_30b_a3b", "qwen3_30b_a3b_proxy", "llama3_8b", "tiny"):
        assert name in printed


def test_help_lists_groups_options_and_recipes(capsys) -> None:
    assert main(["--help"]) == EXIT_OK
    printed = capsys.readouterr().out
    assert (
        "offload/optimizer: auto, cpu_100, cpu_25, cpu_50, cpu_75, cpu_adam, cpu_adam_delayed, "
        "cpu_adam_delayed_experts, disabled, states" in printed
    )
    assert "offload/activation: auto, disabled, enabled" in printed
    for flag in ("--plan", "--json", "--verify", "--collect"):
        assert flag in printed
    assert (
        "recipe: llama3_8b, llama3_8b_sft, qwen3_30b_a3b, qwen3_30b_a3b_proxy, "
        "qwen3_30b_a3b_sft, qwen3_moe_small, tiny" in printed
    )
    assert "--dry-run" in printed


def test_help_and_list_recipes_start_fast_and_quiet() -> None:
    """A newcomer's first commands: no library warning before our words, and neither torch nor
    Megatron-Core imported (they take seconds); the page is Hydra's own template."""
    import subprocess
    import sys

    from offload_runner.cli import help_text

    for flag in ("--help", "--list-recipes"):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", str(ROOT / "run_recipe.py"), flag],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0
        imported = [
            line.split("|")[-1].strip()
            for line in done.stderr.splitlines()
            if line.startswith("import time:")
        ]
        assert not {"torch", "megatron.core"} & set(imported), flag
        assert "Warning" not in done.stderr and "warn" not in done.stdout.lower()
    assert "== Config groups (group=option) ==" in help_text()


def test_hydra_cfg_job_and_info_defaults(capsys) -> None:
    assert main(["--recipe", "tiny", "offload/optimizer=cpu_25", "--cfg", "job"]) == EXIT_OK
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optimizer"]["optimizer_offload_fraction"] == 0.25
    assert main(["--recipe", "qwen3_30b_a3b_proxy", "--info", "defaults"]) == EXIT_OK
    printed = capsys.readouterr().out
    assert "recipe/qwen3_30b_a3b_proxy" in printed and "offload/optimizer/disabled" in printed


def _sweep_fractions(values: str, sweep_dir: Path) -> int:
    return main(
        [
            "-m",
            "--recipe",
            "tiny",
            "optimizer.optimizer_cpu_offload=true",
            f"optimizer.optimizer_offload_fraction={values}",
            f"hydra.sweep.dir={sweep_dir}",
            "--dry-run",
        ]
    )


def test_multirun_sweeps_a_key(tmp_path: Path, capsys) -> None:
    assert _sweep_fractions("0.25,1.0", tmp_path) == EXIT_OK
    saved = [yaml.safe_load((tmp_path / str(i) / "config.yaml").read_text()) for i in (0, 1)]
    fractions = sorted(c["optimizer"]["optimizer_offload_fraction"] for c in saved)
    assert fractions == [0.25, 1.0]


def test_multirun_with_a_bad_job_exits_2(tmp_path: Path, capsys) -> None:
    assert _sweep_fractions("0.5,2.0", tmp_path) == EXIT_USAGE


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message of a machine without GPUs"
)
def test_training_without_a_gpu_says_so(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["--recipe", "tiny", f"output_dir={out}"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--dry-run" in err
    assert not out.exists()


# --- as a real process: exit codes and no tracebacks -----------------------------------------


def test_subprocess_bridge_dry_run(tmp_path: Path) -> None:
    result = run_cli(*BRIDGE_COMMAND, f"output_dir={tmp_path / 'run'}", "--dry-run")
    assert result.returncode == EXIT_OK, result.stderr
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert "Traceback" not in result.stderr


def test_subprocess_rule_violation(tmp_path: Path) -> None:
    result = run_cli(
        "--recipe",
        "tiny",
        "offload/optimizer=states",
        "optimizer.optimizer_cpu_offload=true",
        f"output_dir={tmp_path / 'run'}",
        "--dry-run",
    )
    assert result.returncode == EXIT_USAGE
    assert "offload_optimizer_states can not be used with optimizer_cpu_offload." in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_subprocess_hydra_error(tmp_path: Path) -> None:
    result = run_cli("--recipe", "tiny", "optimizer.no_such_key=1", "--dry-run", cwd=tmp_path)
    assert result.returncode == EXIT_USAGE
    assert "no_such_key" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message of a machine without GPUs"
)
def test_subprocess_no_gpu(tmp_path: Path) -> None:
    result = run_cli("--recipe", "tiny", cwd=tmp_path)
    assert result.returncode == EXIT_FAILED
    assert "no CUDA device" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "message", "fix"),
    [
        (["--dry-run", "--plan"], "--plan can not be combined with --dry-run", "pick one"),
        (["--recipe"], "--recipe needs a name", "--list-recipes"),
        (["--recipe", "missing.yaml"], "recipe file missing.yaml does not exist", "check the path"),
        (["--collect", "/no/such/dir"], "--collect needs a sweep folder", "multirun"),
        (["--recipe", "tiny", "--json"], "--json goes with --plan", "--plan --json"),
    ],
)
def test_usage_errors_name_their_own_fix(args, message: str, fix: str, capsys) -> None:
    assert main(args) == EXIT_USAGE
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert message in text and fix in text
    assert "--dry_run" not in text
    if "--recipe" not in args:
        assert "--list-recipes shows the recipes" not in text


def test_version_is_this_projects(capsys) -> None:
    assert main(["--version"]) == EXIT_OK
    assert capsys.readouterr().out.startswith("offload-runner 0.1.0 (hydra-core ")


def test_bridge_cpu_offloading_alone_is_a_warning(tmp_path: Path, capsys) -> None:
    """Megatron-Core's default cpu_offloading_num_layers=0 is legal there: warn, do not refuse."""
    args = ["--recipe", "tiny", "model.cpu_offloading=True", "--dry-run", f"output_dir={tmp_path}"]
    assert main(args) == EXIT_OK
    assert "offloads no layer" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        ("model: {num_layers: [1\n", "bad.yaml", "is not valid YAML: while parsing"),
        ("", "empty.yaml", "is empty (it would run the built-in defaults)"),
        ("model: {num_layers: 2}\n", "notes.txt", "is not a .yaml/.yml file"),
        (None, "folder", "is a folder"),
        ("defaults: tiny\n", "str.yaml", "defaults must be a list, not 'tiny'"),
        ("defaults: [nosuch]\n", "r.yaml", "defaults name 'nosuch', not an option of recipe"),
        ("defaults: [tiny, stats: x]\n", "g.yaml", "defaults name a group 'stats', which does"),
        (
            "defaults: [tiny, override /offload/optimizer: stats]\n",
            "o.yaml",
            "defaults name 'stats', not an option of offload/optimizer",
        ),
        ("model: {num_layers: 2}\n", "x" * 300 + ".yaml", "File name too long"),
    ],
)
def test_broken_recipe_files_are_usage_errors(
    content, name: str, message: str, tmp_path: Path, capsys
) -> None:
    path = tmp_path / name
    if content is None:
        path.mkdir()
    elif len(name) < 255:
        path.write_text(content)
    assert main(["--recipe", str(path), "--dry-run", f"output_dir={tmp_path}/out"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert message in " ".join((captured.out + captured.err).split())
    assert not (tmp_path / "out").exists()


def test_interpolation_to_nothing_and_a_name_too_long_are_usage_errors(tmp_path, capsys) -> None:
    assert main(["--recipe", "x" * 5000, "--dry-run"]) == EXIT_USAGE
    bad = ["--recipe", "tiny", "model.num_layers=${model.nosuch}", f"output_dir={tmp_path}/o"]
    assert main([*bad, "--dry-run"]) == EXIT_USAGE and not (tmp_path / "o").exists()
    said = " ".join(capsys.readouterr().err.split())
    assert "(5000 characters)" in said and "Interpolation key 'model.nosuch' not found" in said


def test_a_recipe_file_loads_alone_not_its_folder(tmp_path: Path, capsys) -> None:
    (tmp_path / "broken_neighbour.yaml").write_text("model: {num_layers: [1\n")
    (tmp_path / "mine.yml").write_text("defaults:\n  - tiny\nmodel:\n  num_layers: 2\n")
    out = tmp_path / "out"
    assert main(["--recipe", str(tmp_path / "mine.yml"), "--dry-run", f"output_dir={out}"]) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["num_layers"] == 2


def test_unknown_recipe_names_the_closest(capsys) -> None:
    assert main(["--recipe", "tiyn", "--dry-run"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert "unknown recipe 'tiyn' (did you mean tiny?)" in captured.out + captured.err


@pytest.mark.parametrize(
    "override",
    [
        "+optimizer.optimizer_offload_fractoin=0.5",
        "optimizer.optimizer_offload_fractoin=0.5",
        "++optimizer.optimizer_offload_fractoin=0.5",
    ],
)
def test_unknown_keys_are_refused_however_spelled(override: str, tmp_path: Path, capsys) -> None:
    assert main(["--recipe", "tiny", override, "--dry-run", f"output_dir={tmp_path}/o"]) == 2
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert "unknown key optimizer.optimizer_offload_fractoin" in text
    assert "did you mean optimizer.optimizer_offload_fraction?" in text
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("removed", "evidence"),
    [
        ("optimizer.cpu_adam_copy_during_backward=false", "suite cpu-adam-4-backward"),
        ("optimizer.cpu_adam_threads=14", "over 37 suites"),
        ("optimizer.cpu_adam_chunk_mb=16", "suite cpu-adam-4-pieces"),
    ],
)
def test_a_removed_key_says_why_it_went(
    tmp_path: Path, capsys, removed: str, evidence: str
) -> None:
    """A knob cut for a derived default: the message names the bench rows behind the cut."""
    args = [
        "--recipe",
        "tiny",
        "offload/optimizer=cpu_adam_delayed",
        removed,
        f"output_dir={tmp_path}/o",
    ]
    assert main([*args, "--dry-run"]) == 2
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert f"{removed.split('=')[0]} was removed" in text
    assert evidence in text and "fix: drop it" in text
    assert "Traceback" not in text and not (tmp_path / "o").exists()


def test_unknown_key_in_a_recipe_file_is_refused(tmp_path: Path, capsys) -> None:
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults:\n  - tiny\nmodel:\n  num_layer: 2\n")
    assert main(["--recipe", str(recipe), "--dry-run", f"output_dir={tmp_path}/o"]) == 2
    captured = capsys.readouterr()
    assert "did you mean model.num_layers?" in captured.out + captured.err


def test_hydra_flags_work_in_any_position(capsys, tmp_path: Path) -> None:
    _, args = split_argv(["--recipe", "tiny", "--cfg", "job", "model.num_layers=8"])
    assert args == ["--cfg", "job", "recipe=tiny", "model.num_layers=8"]
    _, args = split_argv(["model.num_layers=8", "--info", "defaults", "-m", "train.seed=1,2"])
    assert args == ["--info", "defaults", "-m", "model.num_layers=8", "train.seed=1,2"]
    assert main(["--recipe", "tiny", "--cfg", "job", "model.num_layers=8"]) == EXIT_OK
    assert yaml.safe_load(capsys.readouterr().out)["model"]["num_layers"] == 8
    sweep = tmp_path / "sweep"
    code = main(
        [
            "--recipe",
            "tiny",
            "-m",
            "train.micro_batch_size=1,2",
            "--dry-run",
            f"hydra.sweep.dir={sweep}",
        ]
    )
    assert code == EXIT_OK and (sweep / "1/config.yaml").is_file()


@pytest.mark.parametrize("extra", [["model.num_layers=0"], ["--plan"]], ids=["refused", "plan"])
def test_a_sweep_that_runs_nothing_leaves_nothing(extra, tmp_path: Path, capsys) -> None:
    sweep = tmp_path / "sweep"
    main(["--recipe", "tiny", "-m", "train.seed=1,2", *extra, f"hydra.sweep.dir={sweep}"])
    assert not sweep.exists()
    assert "--collect" not in capsys.readouterr().out


@pytest.mark.parametrize("where", ["file", "long"])
def test_unusable_output_dir_is_one_line_and_exit_2(where: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file/run" if where == "file" else tmp_path / ("a" * 300)
    assert main(["--recipe", "tiny", "--dry-run", f"output_dir={out}"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot write the run directory" in err and "fix: set output_dir=" in err


def test_time_stamped_runs_of_one_second_get_their_own_folders(tmp_path: Path) -> None:
    # ${now:%Y}: both runs resolve to the same name, as two runs started in the same second do
    args = ["--recipe", "tiny", "--dry-run", f"output_dir={tmp_path}/${{now:%Y}}-tiny"]
    assert main(args) == EXIT_OK and main(args) == EXIT_OK
    assert len(list(tmp_path.glob("*-tiny*/config.yaml"))) == 2
    fixed = ["--recipe", "tiny", "--dry-run", f"output_dir={tmp_path}/mine"]
    assert main(fixed) == EXIT_OK and main(fixed) == EXIT_OK  # a chosen name is used as it is
    assert not list(tmp_path.glob("mine-*"))


def test_dry_run_under_torchrun_is_rank_0s_alone(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(["--recipe", "tiny", "--dry-run", f"output_dir={tmp_path}/run"]) == EXIT_OK
    assert not (tmp_path / "run").exists()
    assert "recipe tiny" not in capsys.readouterr().out


@pytest.mark.parametrize("world", ["2", "two"])
def test_a_stale_rank_in_the_shell_is_no_torchrun(monkeypatch, tmp_path, capsys, world) -> None:
    """RANK / WORLD_SIZE left in a shell, no torchrun around (no LOCAL_RANK): a dry run is a
    person's and answers."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", world)
    assert main(["--recipe", "tiny", "--dry-run", f"output_dir={tmp_path}/run"]) == EXIT_OK
    assert "recipe tiny" in capsys.readouterr().out and (tmp_path / "run").is_dir()


def test_no_cuda_under_torchrun_says_so(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["--recipe", "tiny", f"output_dir={tmp_path}/run"]) == EXIT_FAILED
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(validation_te_available(), reason="Transformer Engine is installed here")
def test_missing_transformer_engine_at_launch_is_a_run_failure(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """On a GPU machine without Transformer Engine: the machine lacks it (exit 1, not 2); on a
    machine without a GPU either, the GPU is said first."""
    args = [
        "--recipe",
        "tiny",
        "offload/activation=enabled",
        "model.cpu_offloading_num_layers=1",
        f"output_dir={tmp_path}/run",
    ]
    assert main(args) == EXIT_FAILED
    said = capsys.readouterr().err
    assert "no CUDA device is visible" in said and "Transformer Engine" not in said
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(args) == EXIT_FAILED  # the machine lacks it: not a usage error
    assert "Transformer Engine" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("train.micro_batch_size=1.5",), "could not be converted to Integer"),
        (("optimizer.lr=abc",), "could not be converted to Float"),
        (("offload/optimizer=nosuch",), "offload/optimizer has no option 'nosuch'"),
        (("stray",), "can not read the override 'stray'"),
        (("model.num_layers=",), "model.num_layers="),
        (("model.offload_modules=[nosuch]",), "expected one of"),
        (("offload/optimizer=states", "offload/optimizer=cpu_50"), "is given twice"),
        (("-m", "offload/optimizer=cpu_25,cpu_999"), "has no option 'cpu_999'"),
        (("dataset.split=98,2,0",), "dataset.split='98,2,0'"),
        (("checkpoint.load=/does/not/exist",), "does not exist"),
    ],
    ids=[
        "int",
        "float",
        "group-option",
        "stray-word",
        "empty",
        "enum",
        "group-twice",
        "sweep",
        "sweep-without-m",
        "missing-checkpoint",
    ],
)
def test_bad_input_is_one_line_and_a_fix_and_writes_nothing(
    tmp_path: Path, args: tuple[str, ...], said: str, capsys, monkeypatch
) -> None:
    """What Hydra would refuse in its own form (and what it would silently accept: a group given
    twice, a resume from nowhere) is refused in ours before anything starts: exit 2, the error
    and a fix line, no traceback, no Hydra hint, no output folder. In this process (a fresh
    one for the stray word: the same answer as the command a user types)."""
    monkeypatch.chdir(tmp_path)
    _drop_closed_log_streams()  # an earlier test's Hydra run logged to its own captured stderr
    if args == ("stray",):
        done = run_cli("--recipe", "tiny", *args, "--dry-run", cwd=tmp_path)
        code, err = done.returncode, done.stderr
    else:
        code, err = main(["--recipe", "tiny", *args, "--dry-run"]), capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert said in err and "fix:" in err
    assert "Traceback" not in err and "HYDRA_FULL_ERROR" not in err
    assert not any(tmp_path.iterdir())


def _drop_closed_log_streams() -> None:
    import logging

    for logger in [logging.root, *logging.Logger.manager.loggerDict.values()]:
        for handler in list(getattr(logger, "handlers", ())):
            if getattr(getattr(handler, "stream", None), "closed", False):
                logger.removeHandler(handler)


def test_training_is_refused_before_it_starts_when_host_ram_is_short() -> None:
    """DeepSpeed users meet page-locked allocations that fail half way: here the plan's host
    side (with each rank's process and the margin) is held against the node's RAM first."""
    from offload_runner.cli import host_ram_short
    from tests.conftest import compose_run

    run = compose_run(
        "recipe=qwen3_30b_a3b_proxy", "offload/optimizer=states", "planner.host_memory_gb=30"
    )
    message, fix = host_ram_short(run, 1)
    assert "needs" in message and "the node has 30 GB" in message
    assert "optimizer.exp_avg_dtype=bf16" in fix
    bf16 = compose_run(
        "recipe=qwen3_30b_a3b_proxy",
        "offload/optimizer=states",
        "optimizer.exp_avg_dtype=bf16",
        "optimizer.exp_avg_sq_dtype=bf16",
        "planner.host_memory_gb=30",
    )
    assert host_ram_short(bf16, 1) is None


def _junk_tracker(tmp: Path) -> list[str]:
    (tmp / "ckpt").mkdir()
    (tmp / "ckpt" / "latest_checkpointed_iteration.txt").write_text("junk\n")
    return [f"checkpoint.load={tmp / 'ckpt'}"]


def _gone_iteration(tmp: Path) -> list[str]:
    (tmp / "ckpt").mkdir()
    (tmp / "ckpt" / "latest_checkpointed_iteration.txt").write_text("5\n")
    return [f"checkpoint.load={tmp / 'ckpt'}"]


def _a_file(tmp: Path) -> list[str]:
    (tmp / "notes").write_text("x")
    return [f"checkpoint.load={tmp / 'notes'}"]


def _save_under_a_file(tmp: Path) -> list[str]:
    (tmp / "notes").write_text("x")
    return [f"checkpoint.save={tmp / 'notes' / 'ckpt'}"]


def _truncated_precision(tmp: Path) -> list[str]:
    saved = tmp / "ckpt" / "iter_0000005"
    saved.mkdir(parents=True)
    (tmp / "ckpt" / "latest_checkpointed_iteration.txt").write_text("5\n")
    (saved / "metadata.json").write_text("{}")
    (saved / "optimizer_precision.json").write_text('{"precision": "q8')
    return [f"checkpoint.load={tmp / 'ckpt'}"]


NEW_USER = {
    "group typo": (lambda tmp: ["offload/optimiser=states"], "no config group offload/optimiser"),
    "flag typo": (lambda tmp: ["--dry_run"], "unknown flag --dry_run (did you mean --dry-run?)"),
    "host RAM 0": (lambda tmp: ["planner.host_memory_gb=0"], "planner.host_memory_gb=0.0 is out"),
    "heads and groups": (
        lambda tmp: ["model.num_attention_heads=8", "model.num_query_groups=3"],
        "model.num_attention_heads=8 is not a multiple of model.num_query_groups=3",
    ),
    "removed key": (
        lambda tmp: ["optimizer.offload_states_window_mb=64"],
        "optimizer.offload_states_window_mb was removed",
    ),
    "junk tracker": (_junk_tracker, "holds 'junk', not an iteration"),
    "a tracker whose folder is gone": (_gone_iteration, "names iter_0000005, which is not there"),
    "load a file": (_a_file, "is a file, not a checkpoint folder"),
    "load a folder of other files": (
        lambda tmp: [f"checkpoint.load={Path(__file__).parent}"],
        "holds files but no checkpoint",
    ),
    "a truncated precision file": (_truncated_precision, "does not read as the precision file"),
    "save under /proc": (lambda tmp: ["checkpoint.save=/proc/ck"], "can not be written here"),
    "save under a file": (_save_under_a_file, "can not be written here"),
}


@pytest.mark.parametrize("case", sorted(NEW_USER))
def test_what_a_new_user_trips_on_is_one_line_and_a_fix(case, tmp_path: Path, capsys) -> None:
    """Each was accepted and failed later, or answered in another tool's words (issue: a house
    a successor can carry on, 'what a new user still trips on')."""
    make, said = NEW_USER[case]
    out = tmp_path / "run"
    assert main(["--recipe", "tiny", *make(tmp_path), f"output_dir={out}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    # in one pytest process an earlier test's Hydra logging may hold a closed captured stream
    # ("--- Logging error ---", with a traceback of its own): none of ours
    assert said in err and "fix:" in err
    assert err.count("Traceback") == err.count("--- Logging error ---")
    assert not out.exists()


def test_a_bracketed_data_path_prints_as_typed(tmp_path: Path, capsys) -> None:
    """The form the data=indexed fix line asks for, echoed without rich reading it as markup."""
    args = ["--recipe", "tiny", "data=indexed", "dataset.data_path=[/data/x]"]
    assert main([*args, f"output_dir={tmp_path}/run", "--dry-run"]) == EXIT_OK
    assert "dataset.data_path=[/data/x]" in capsys.readouterr().out.replace("\n", "")


def test_the_launcher_and_a_rank_keep_import_warnings_off_the_terminal(tmp_path) -> None:
    """With Python's warnings on, Megatron-Core's and torch's import-time deprecations neither
    precede the launcher's own lines nor a rank's: the rank logs them in rank0.log (its log is
    set up before it imports them), and the launcher's own copies (the same imports) are
    dropped unless --verbose."""
    import subprocess
    import sys

    from offload_runner.config.compose import compose_config
    from offload_runner.rundir import create_run_dir

    loud = {"PYTHONWARNINGS": "default", "CUDA_VISIBLE_DEVICES": ""}
    launcher = run_cli("--recipe", "tiny", f"output_dir={tmp_path}/run", env=loud)
    assert not LIBRARY_NOISE.search(launcher.stdout + launcher.stderr), launcher.stderr
    verbose = run_cli("--recipe", "tiny", f"output_dir={tmp_path}/run", "--verbose", env=loud)
    assert "DeprecationWarning" in verbose.stderr
    resolved = OmegaConf.to_container(compose_config(["recipe=tiny"]), resolve=True)
    run_dir = create_run_dir(tmp_path / "rank", resolved, [])
    rank = subprocess.run(
        [sys.executable, "-m", "offload_runner.worker", "--run-dir", str(run_dir)],
        env={**os.environ, **loud, "RANK": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert not LIBRARY_NOISE.search(rank.stdout + rank.stderr), rank.stderr
    assert "DeprecationWarning" in (run_dir / "rank0.log").read_text()


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_library_warnings_go_to_the_rank_log(tmp_path, monkeypatch, capfd, verbose) -> None:
    """Megatron-Core's loggers and Python warnings (TE's, torch's) land in rank0.log, and in the
    terminal only with --verbose; our own lines stay in the log and out of stderr."""
    import logging
    import warnings

    from offload_runner.worker import VERBOSE_ENV, setup_rank_logging

    monkeypatch.setenv(VERBOSE_ENV, "1" if verbose else "0")
    root = logging.getLogger()
    ours = logging.getLogger("offload_runner")
    saved = (root.handlers[:], root.level, ours.handlers[:], ours.propagate)
    try:
        setup_rank_logging(tmp_path, 0)
        logging.getLogger("megatron.core.datasets").warning("Unable to save indexes")
        warnings.warn("GPTModel IS DEPRECATED", UserWarning, stacklevel=1)
        ours.info("our own line")
    finally:
        logging.captureWarnings(False)
        root.handlers, root.level = saved[0], saved[1]
        ours.handlers, ours.propagate = saved[2], saved[3]
    log = (tmp_path / "rank0.log").read_text()
    assert "Unable to save indexes" in log and "GPTModel IS DEPRECATED" in log
    assert log.count("our own line") == 1
    err = capfd.readouterr().err
    assert ("Unable to save indexes" in err) is verbose
    assert ("GPTModel IS DEPRECATED" in err) is verbose
    assert "our own line" not in err


def test_an_empty_output_dir_is_refused_and_the_users_config_stays(tmp_path) -> None:
    """output_dir= names the current folder: config.yaml there is the user's."""
    (tmp_path / "config.yaml").write_text("mine: true\n")
    done = run_cli("--recipe", "tiny", "output_dir=", "--dry-run", cwd=tmp_path)
    assert done.returncode == EXIT_USAGE and "would be written over yours" in done.stderr
    assert (tmp_path / "config.yaml").read_text() == "mine: true\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_auto_micro_batch_asked_and_forbidden_at_once_is_refused(capsys) -> None:
    args = ["--recipe", "tiny", "train.micro_batch_size=auto", "planner.auto_micro_batch=false"]
    assert main([*args, "--dry-run"]) == EXIT_USAGE
    assert "forbids it" in capsys.readouterr().err


def test_what_a_user_may_not_read_or_write_is_one_line(tmp_path: Path) -> None:
    """With file permissions holding (a child without root's overrides): a checkpoint whose
    tracker the user cannot read, a --prepare output in a read-only folder, a checkpoint.save
    there: exit 2, one line, no traceback, nothing written."""
    from tests.conftest import SAMPLE, as_a_user

    prefix = as_a_user()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5\n")
    (ckpt / "latest_checkpointed_iteration.txt").chmod(0)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    run = ("--recipe", "tiny", "--dry-run", f"output_dir={tmp_path}/run")
    cases = [
        ((*run, f"checkpoint.load={ckpt}"), "Permission denied"),
        (("--prepare", str(SAMPLE), "--output", str(locked / "data")), "can not be written"),
        ((*run, f"checkpoint.save={locked}/ckpt"), "can not be written"),
    ]
    for args, said in cases:
        done = run_cli(*args, prefix=prefix)
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr[-800:])
        assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()
        assert not any(locked.iterdir())
