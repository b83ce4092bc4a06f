#!/usr/bin/env python3
"""Builds the mme-gpu image and pushes it to Amazon ECR.

Steps: create the ECR repository if it is missing, log docker in to the registry with a token from
ECR (the password goes to docker on stdin, never on the command line), build, tag as
<registry>/<repository>:<tag>, push. The image URI is printed last, ready for deploy_mme.py
--image-uri.

examples:
  scripts/build_and_push.py --repository mme-gpu --tag 0.1.0
  scripts/build_and_push.py --repository mme-gpu --tag 0.1.0-cu130 \
      --base-image nvidia/cuda:13.0.2-runtime-ubuntu24.04 --torch-spec torch==2.13.0
  scripts/build_and_push.py --repository mme-gpu --dry-run --account-id 123456789012 \
      --region us-east-1
"""

from __future__ import annotations

import argparse
import base64
import binascii
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _aws_cli import EXIT_OK, ScriptError, boto_session, config_error, run_cli
from botocore.client import BaseClient

REPO_ROOT = Path(__file__).resolve().parent.parent
# SageMaker hosts are x86_64; an image built for the builder's own arch on an ARM laptop would fail
# to start there.
DEFAULT_PLATFORM = "linux/amd64"
DOCKER_HELP = (
    "install Docker (https://docs.docker.com/get-docker/) or pass --docker with the path of a "
    "compatible CLI"
)


@dataclass(frozen=True)
class RegistryLogin:
    registry: str
    username: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class ImageBuild:
    """The docker commands for one image; pure, so a dry run prints exactly what a real run
    executes."""

    docker: str
    context: Path
    dockerfile: Path
    platform: str
    build_args: dict[str, str]
    local_image: str
    remote_image: str

    def build_command(self) -> list[str]:
        command = [self.docker, "build", "--platform", self.platform, "-f", str(self.dockerfile)]
        for key, value in sorted(self.build_args.items()):
            command += ["--build-arg", f"{key}={value}"]
        return [*command, "-t", self.local_image, str(self.context)]

    def tag_command(self) -> list[str]:
        return [self.docker, "tag", self.local_image, self.remote_image]

    def push_command(self) -> list[str]:
        return [self.docker, "push", self.remote_image]


def login_command(docker: str, login: RegistryLogin) -> list[str]:
    return [docker, "login", "--username", login.username, "--password-stdin", login.registry]


def registry_host(account_id: str, region: str) -> str:
    """The ECR registry of an account and region, for when no ECR call has told us (a dry run)."""
    # China regions live under their own DNS suffix; every other partition we deploy to uses
    # amazonaws.com.
    suffix = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"{account_id}.dkr.ecr.{region}.{suffix}"


def ensure_repository(ecr: BaseClient, name: str) -> tuple[str, bool]:
    """The repository's URI, creating the repository when it does not exist; also says whether it
    was created."""
    try:
        return ecr.describe_repositories(repositoryNames=[name])["repositories"][0][
            "repositoryUri"
        ], False
    except ecr.exceptions.RepositoryNotFoundException:
        pass
    try:
        return ecr.create_repository(repositoryName=name)["repository"]["repositoryUri"], True
    except ecr.exceptions.RepositoryAlreadyExistsException:
        # Another build created it between our two calls; theirs is as good as ours.
        return ecr.describe_repositories(repositoryNames=[name])["repositories"][0][
            "repositoryUri"
        ], False


def decode_authorization_token(token: str) -> tuple[str, str]:
    """ECR tokens are base64 of "user:password"; the user is always AWS, but we take what the token
    says."""
    try:
        username, sep, password = (
            base64.b64decode(token, validate=True).decode("utf-8").partition(":")
        )
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise ScriptError(
            "ECR returned an authorization token that is not base64 of user:password"
        ) from exc
    if not sep or not username or not password:
        raise ScriptError("ECR returned an authorization token that is not base64 of user:password")
    return username, password


def registry_login(ecr: BaseClient) -> RegistryLogin:
    data = ecr.get_authorization_token()["authorizationData"][0]
    username, password = decode_authorization_token(data["authorizationToken"])
    # proxyEndpoint is "https://<registry>"; docker wants the host alone so that it matches the
    # image names.
    registry = data["proxyEndpoint"].removeprefix("https://").rstrip("/")
    return RegistryLogin(registry=registry, username=username, password=password)


def account_id(sts: BaseClient) -> str:
    return str(sts.get_caller_identity()["Account"])


def parse_build_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise config_error(f"--build-arg {text!r}: expected KEY=VALUE")
    return key, value


def collect_build_args(
    base_image: str | None, torch_spec: str | None, extra: Sequence[str]
) -> dict[str, str]:
    """Build args to pass; unset options pass nothing, so the Dockerfile's pinned defaults apply."""
    build_args = dict(parse_build_arg(item) for item in extra)
    if base_image:
        build_args["BASE_IMAGE"] = base_image
    if torch_spec:
        build_args["TORCH_SPEC"] = torch_spec
    return build_args


def require_docker(docker: str) -> str:
    path = shutil.which(docker)
    if path is None:
        raise config_error(f"{docker!r} not found: {DOCKER_HELP}")
    return path


def run_command(command: Sequence[str], stdin: str | None = None) -> None:
    print("+ " + shlex.join(command), file=sys.stderr, flush=True)
    try:
        completed = subprocess.run(command, input=stdin, text=True, check=False)
    except OSError as exc:
        raise config_error(f"cannot run {command[0]}: {exc.strerror}; {DOCKER_HELP}") from exc
    if completed.returncode != 0:
        raise ScriptError(
            f"`{shlex.join(command[:2])}` failed with exit code {completed.returncode}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="build_and_push.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--repository", default="mme-gpu", help="ECR repository name (default: %(default)s)"
    )
    parser.add_argument("--tag", default="latest", help="image tag (default: %(default)s)")
    parser.add_argument("--region", help="AWS region (default: the AWS configuration's)")
    parser.add_argument(
        "--base-image", help="passed as --build-arg BASE_IMAGE (default: the Dockerfile's)"
    )
    parser.add_argument("--torch-spec", help="passed as --build-arg TORCH_SPEC, e.g. torch==2.13.0")
    parser.add_argument(
        "--build-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other build arg (repeatable)",
    )
    parser.add_argument(
        "--context", type=Path, default=REPO_ROOT, help="build context (default: the repository)"
    )
    parser.add_argument("--dockerfile", type=Path, help="Dockerfile (default: CONTEXT/Dockerfile)")
    parser.add_argument(
        "--platform", default=DEFAULT_PLATFORM, help="target platform (default: %(default)s)"
    )
    parser.add_argument(
        "--docker", default="docker", help="docker-compatible CLI to run (default: %(default)s)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the commands without creating the repository or running docker",
    )
    parser.add_argument(
        "--account-id", help="AWS account of the registry for --dry-run (default: asked from STS)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dockerfile: Path = args.dockerfile or args.context / "Dockerfile"
    if not dockerfile.is_file():
        raise config_error(f"Dockerfile {dockerfile} not found (pass --context or --dockerfile)")
    build_args = collect_build_args(args.base_image, args.torch_spec, args.build_arg)
    docker = args.docker if args.dry_run else require_docker(args.docker)
    session = boto_session(args.region)

    if args.dry_run:
        account = args.account_id or account_id(session.client("sts"))
        registry = registry_host(account, session.region_name)
        login = RegistryLogin(registry=registry, username="AWS", password="")
        repository_uri = f"{registry}/{args.repository}"
        print(
            f"# create ECR repository {args.repository} in {session.region_name} if it is missing"
        )
    else:
        ecr = session.client("ecr")
        repository_uri, created = ensure_repository(ecr, args.repository)
        print(
            f"{'created' if created else 'using'} ECR repository {repository_uri}", file=sys.stderr
        )
        login = registry_login(ecr)

    image = ImageBuild(
        docker=docker,
        context=args.context,
        dockerfile=dockerfile,
        platform=args.platform,
        build_args=build_args,
        local_image=f"{args.repository}:{args.tag}",
        remote_image=f"{repository_uri}:{args.tag}",
    )
    # Log in before building, so that a BASE_IMAGE in the same private registry can be pulled.
    steps: list[tuple[list[str], str | None]] = [
        (login_command(docker, login), login.password),
        (image.build_command(), None),
        (image.tag_command(), None),
        (image.push_command(), None),
    ]
    for command, stdin in steps:
        if args.dry_run:
            print(
                shlex.join(command)
                + ("  # password from ECR on stdin" if stdin is not None else "")
            )
        else:
            run_command(command, stdin)
    print(image.remote_image)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(run_cli(main))
