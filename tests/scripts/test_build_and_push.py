"""scripts/build_and_push.py: the ECR logic against a real moto server, and the docker commands through a stand-in CLI.

The stand-in is a shell script that records its arguments: it replaces docker (no daemon in CI), never AWS.
"""

from __future__ import annotations

import base64
import shlex
from pathlib import Path

import boto3
import pytest
from _aws_cli import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, ScriptError, run_cli
from build_and_push import (
    ImageBuild,
    collect_build_args,
    decode_authorization_token,
    ensure_repository,
    main,
    registry_host,
    registry_login,
)

ACCOUNT_ID = "123456789012"  # moto's default account
REGION = "us-east-1"  # set by the aws fixture
REGISTRY = f"{ACCOUNT_ID}.dkr.ecr.{REGION}.amazonaws.com"


@pytest.fixture
def context(tmp_path: Path) -> Path:
    """A build context with its own Dockerfile, so these tests never depend on the repository's."""
    root = tmp_path / "context"
    root.mkdir()
    (root / "Dockerfile").write_text("FROM scratch\n")
    return root


@pytest.fixture
def fake_docker(tmp_path: Path) -> tuple[Path, Path]:
    """A docker CLI stand-in: logs each call, logs what login reads on stdin, and fails for `$FAKE_DOCKER_FAIL`."""
    log = tmp_path / "docker.log"
    script = tmp_path / "bin" / "docker"
    script.parent.mkdir()
    script.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$*" >> {shlex.quote(str(log))}\n'
        f'if [ "$1" = login ]; then printf "stdin %s\\n" "$(cat)" >> {shlex.quote(str(log))}; fi\n'
        'if [ "$1" = "${FAKE_DOCKER_FAIL:-}" ]; then exit 3; fi\n'
    )
    script.chmod(0o755)
    return script, log


def test_ensure_repository_creates_a_missing_repository_once(aws: str) -> None:
    ecr = boto3.client("ecr")

    uri, created = ensure_repository(ecr, "mme-gpu")
    again, created_again = ensure_repository(ecr, "mme-gpu")

    assert (uri, created) == (f"{REGISTRY}/mme-gpu", True)
    assert (again, created_again) == (uri, False)
    assert [repo["repositoryName"] for repo in ecr.describe_repositories()["repositories"]] == ["mme-gpu"]


def test_composed_registry_matches_what_ecr_reports(aws: str) -> None:
    ecr = boto3.client("ecr")
    uri, _ = ensure_repository(ecr, "mme-gpu")

    login = registry_login(ecr)

    assert registry_host(ACCOUNT_ID, REGION) == uri.split("/")[0] == login.registry


def test_registry_host_uses_the_china_dns_suffix() -> None:
    assert registry_host(ACCOUNT_ID, "cn-north-1") == f"{ACCOUNT_ID}.dkr.ecr.cn-north-1.amazonaws.com.cn"


def test_registry_login_decodes_the_ecr_token(aws: str) -> None:
    ecr = boto3.client("ecr")
    token = ecr.get_authorization_token()["authorizationData"][0]["authorizationToken"]

    login = registry_login(ecr)

    assert login.username == "AWS"
    assert login.password
    assert base64.b64encode(f"{login.username}:{login.password}".encode()).decode() == token
    assert login.password not in repr(login)  # never in a log line or traceback


@pytest.mark.parametrize("token", ["not base64!", base64.b64encode(b"no-separator").decode(), ""])
def test_decode_authorization_token_rejects_malformed_tokens(token: str) -> None:
    with pytest.raises(ScriptError, match="not base64 of user:password"):
        decode_authorization_token(token)


def test_build_args_pass_only_what_was_given() -> None:
    assert collect_build_args(None, None, []) == {}  # the Dockerfile's pinned defaults apply
    assert collect_build_args("nvidia/cuda:x", "torch==2.13.0", ["PIP_INDEX_URL=https://mirror/simple"]) == {
        "BASE_IMAGE": "nvidia/cuda:x",
        "TORCH_SPEC": "torch==2.13.0",
        "PIP_INDEX_URL": "https://mirror/simple",
    }
    with pytest.raises(ScriptError, match="expected KEY=VALUE"):
        collect_build_args(None, None, ["NO_VALUE"])


def test_build_command_carries_platform_dockerfile_and_sorted_build_args(context: Path) -> None:
    image = ImageBuild(
        docker="docker",
        context=context,
        dockerfile=context / "Dockerfile",
        platform="linux/amd64",
        build_args={"TORCH_SPEC": "torch==2.13.0", "BASE_IMAGE": "nvidia/cuda:x"},
        local_image="mme-gpu:1.0",
        remote_image=f"{REGISTRY}/mme-gpu:1.0",
    )
    assert image.build_command() == [
        "docker", "build", "--platform", "linux/amd64", "-f", str(context / "Dockerfile"),
        "--build-arg", "BASE_IMAGE=nvidia/cuda:x", "--build-arg", "TORCH_SPEC=torch==2.13.0",
        "-t", "mme-gpu:1.0", str(context),
    ]  # fmt: skip
    assert image.tag_command() == ["docker", "tag", "mme-gpu:1.0", f"{REGISTRY}/mme-gpu:1.0"]
    assert image.push_command() == ["docker", "push", f"{REGISTRY}/mme-gpu:1.0"]


def test_push_creates_the_repository_logs_in_on_stdin_builds_tags_and_pushes(
    aws: str, context: Path, fake_docker: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    docker, log = fake_docker
    argv = ["--repository", "team/mme-gpu", "--tag", "1.0", "--torch-spec", "torch==2.13.0"]

    assert run_cli(main, [*argv, "--context", str(context), "--docker", str(docker)]) == EXIT_OK

    remote = f"{REGISTRY}/team/mme-gpu:1.0"
    password = registry_login(boto3.client("ecr")).password
    assert log.read_text().splitlines() == [
        f"login --username AWS --password-stdin {REGISTRY}",
        f"stdin {password}",
        f"build --platform linux/amd64 -f {context / 'Dockerfile'} --build-arg TORCH_SPEC=torch==2.13.0 "
        f"-t team/mme-gpu:1.0 {context}",
        f"tag team/mme-gpu:1.0 {remote}",
        f"push {remote}",
    ]
    assert boto3.client("ecr").describe_repositories(repositoryNames=["team/mme-gpu"])["repositories"]
    assert capsys.readouterr().out.splitlines()[-1] == remote


def test_dry_run_prints_the_commands_and_changes_nothing(
    aws: str, context: Path, fake_docker: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    docker, log = fake_docker

    assert run_cli(main, ["--dry-run", "--context", str(context), "--docker", str(docker), "--tag", "1.0"]) == EXIT_OK

    out = capsys.readouterr().out
    assert f"{docker} login --username AWS --password-stdin {REGISTRY}  # password from ECR on stdin" in out
    assert f"{docker} push {REGISTRY}/mme-gpu:1.0" in out
    assert not log.exists()
    ecr = boto3.client("ecr")
    with pytest.raises(ecr.exceptions.RepositoryNotFoundException):
        ecr.describe_repositories(repositoryNames=["mme-gpu"])


def test_missing_credentials_is_one_line_and_exit_2(
    no_aws_credentials: None, context: Path, fake_docker: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    docker, log = fake_docker

    assert run_cli(main, ["--context", str(context), "--docker", str(docker)]) == EXIT_CONFIG

    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: no AWS credentials found")
    assert not log.exists()  # nothing was built for an image that could not be pushed


def test_missing_docker_is_a_setup_error(
    aws: str, context: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "docker"

    assert run_cli(main, ["--context", str(context), "--docker", str(missing)]) == EXIT_CONFIG

    assert f"'{missing}' not found: install Docker" in capsys.readouterr().err


def test_failed_docker_step_names_the_step_and_stops(
    aws: str,
    context: Path,
    fake_docker: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    docker, log = fake_docker
    monkeypatch.setenv("FAKE_DOCKER_FAIL", "build")

    assert run_cli(main, ["--context", str(context), "--docker", str(docker)]) == EXIT_FAILURE

    assert f"`{docker} build` failed with exit code 3" in capsys.readouterr().err
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["login", "stdin", "build"]


def test_missing_dockerfile_is_a_setup_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(main, ["--context", str(tmp_path), "--dry-run"]) == EXIT_CONFIG
    assert "Dockerfile" in capsys.readouterr().err
