"""``volunteer-coordinator`` as a user runs it: real processes, one-line errors, files on disk."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import coordinator_cli, create_run_on_disk

COMMANDS = [
    [],
    ["init"],
    ["serve"],
    ["runs"],
    ["runs", "create"],
    ["runs", "list"],
    ["runs", "flags"],
    ["runs", "pause"],
    ["runs", "resume"],
    ["runs", "finish"],
    ["volunteers"],
    ["volunteers", "list"],
    ["volunteers", "ban"],
    ["keys", "rotate"],
]


cli = coordinator_cli


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "top")
def test_every_command_answers_help(command: list[str]) -> None:
    result = cli(*command, "--help")
    assert result.returncode == 0 and "usage: volunteer-coordinator" in result.stdout


def test_init_is_idempotent_and_keeps_secrets_private(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = cli("init", "--data-dir", str(data))
    assert first.returncode == 0, first.stderr
    token = (data / "admin-token").read_text().strip()
    # never printed (service managers keep output in their logs): the output says where it is
    assert token not in first.stdout and token.startswith("org_")
    assert f"cat {(data / 'admin-token').resolve()}" in first.stdout
    assert (data / "admin-token").stat().st_mode & 0o777 == 0o600
    keys = list((data / "keys").glob("*.pem"))
    assert len(keys) == 1 and keys[0].stat().st_mode & 0o777 == 0o600
    second = cli("init", "--data-dir", str(data))
    assert second.returncode == 0 and token not in second.stdout and "already initialized" in second.stdout
    assert (data / "admin-token").read_text().strip() == token
    assert list((data / "keys").glob("*.pem")) == keys
    rotated = cli("init", "--data-dir", str(data), "--rotate-admin-token")
    assert rotated.returncode == 0 and (data / "admin-token").read_text().strip() != token


def test_runs_and_volunteers_commands(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    created = create_run_on_disk(data, "--config", "num_shards=8", "--json")
    run = json.loads(created.stdout)
    assert run["task_config"]["num_shards"] == 8 and run["stats"]["shards_total"] == 8
    invite = cli(
        "runs",
        "create",
        "--data-dir",
        data,
        "--name",
        "private",
        "--task",
        "tiny-lm",
        "--visibility",
        "invite",
    )
    assert invite.returncode == 0 and "invite code (shown once): " in invite.stdout
    listing = cli("runs", "list", "--data-dir", data)
    assert "shapes" in listing.stdout and "private" in listing.stdout and "0/8" in listing.stdout
    assert cli("runs", "pause", "shapes", "--data-dir", data).stdout.strip() == "run shapes is paused"
    assert cli("runs", "resume", "shapes", "--data-dir", data).stdout.strip() == "run shapes is active"
    assert cli("runs", "finish", "shapes", "--data-dir", data).stdout.strip() == "run shapes is finished"
    assert_one_line_error(cli("runs", "resume", "shapes", "--data-dir", data), "finished")
    assert json.loads(cli("volunteers", "list", "--data-dir", data, "--json").stdout) == []
    rotated = cli("keys", "rotate", "--data-dir", data)
    assert rotated.returncode == 0 and "new signing key" in rotated.stdout


def test_error_paths_print_one_line_and_exit_non_zero(tmp_path: Path) -> None:
    data = str(tmp_path / "data")

    def create_x(*options: str) -> subprocess.CompletedProcess[str]:
        return cli("runs", "create", "--data-dir", data, "--name", "x", *options)

    assert_one_line_error(cli("runs", "list"), "--data-dir is required")
    assert_one_line_error(create_x(), "--task")
    assert_one_line_error(create_x("--task", "nope"), "unknown task")
    assert_one_line_error(
        create_x("--task", "shapes-dalle", "--config", "d_model=100", "--config", "n_heads=3"), "d_model"
    )
    assert_one_line_error(
        cli("runs", "create", "--data-dir", data, "--name", "bad name", "--task", "tiny-lm"), "name"
    )
    assert_one_line_error(create_x("--task", "tiny-lm", "--config", "oops"), "KEY=VALUE")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert_one_line_error(create_x("--task", "tiny-lm", "--config-file", str(broken)), "not valid JSON")
    assert_one_line_error(cli("runs", "pause", "ghost", "--data-dir", data), "no run named 'ghost'")
    assert_one_line_error(cli("volunteers", "ban", "ghost", "--data-dir", data), "no volunteer named 'ghost'")
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert_one_line_error(cli("init", "--data-dir", str(a_file)), "not a directory")
    assert_one_line_error(cli("init", "--data-dir", data, "--database-url", "nosuchdb://x"), "database")
    assert_one_line_error(cli("serve", "--data-dir", data, "--port", "99999"), "port")
    assert_one_line_error(cli("frobnicate"), "invalid choice")


def test_runs_create_optimizer_options_fit_the_update_mode(tmp_path: Path) -> None:
    """Options left out keep the defaults of the chosen update mode; contradictory ones are refused."""
    data = str(tmp_path / "data")

    def create(name: str, *options: str) -> subprocess.CompletedProcess[str]:
        return cli(
            "runs", "create", "--data-dir", data, "--name", name, "--task", "tiny-lm", *options, "--json"
        )

    def optimizer(result: subprocess.CompletedProcess[str]) -> dict[str, object]:
        assert result.returncode == 0, result.stderr
        settings: dict[str, object] = json.loads(result.stdout)["optimizer"]
        return settings

    default = optimizer(create("plain"))
    assert (default["update_mode"], default["target_batch_size"], default["early_epochs"]) == (
        "local",
        2048,
        0,
    )
    gradients = optimizer(create("grads", "--update-mode", "gradients"))
    assert (gradients["target_batch_size"], gradients["average_state_every"]) == (4096, 4)
    tuned = optimizer(create("tuned", "--early-epochs", "20", "--early-target-batch-size", "256"))
    assert (tuned["early_epochs"], tuned["early_target_batch_size"]) == (20, 256)
    assert optimizer(create("legacy-flag", "--local-updates"))["update_mode"] == "local"
    outer = optimizer(
        create("outer", "--update-mode", "diloco", "--outer-lr", "1.5", "--outer-momentum", "0")
    )
    assert (outer["update_mode"], outer["outer_lr"], outer["outer_momentum"]) == ("diloco", 1.5, 0.0)
    assert_one_line_error(create("bad", "--update-mode", "diloco", "--outer-momentum", "1"), "outer_momentum")
    assert_one_line_error(
        create("bad", "--early-epochs", "5", "--target-batch-size", "256"),
        "early_target_batch_size (512) must be below target_batch_size (256)",
    )
    assert_one_line_error(
        create("bad", "--update-mode", "gradients", "--early-epochs", "5"), "local and diloco update modes"
    )
    assert_one_line_error(create("bad", "--early-matchmaking-time", "0"), "early_matchmaking_time")
