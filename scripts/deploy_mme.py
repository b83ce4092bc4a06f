#!/usr/bin/env python3
# mypy: disable-error-code="no-untyped-call"
# (the SageMaker SDK ships without type hints, so every call into it is "untyped")
"""Deploys, feeds, calls and deletes a SageMaker multi-model endpoint that serves the mme-gpu image.

subcommands:
  deploy     copy model archives to the S3 prefix, then create the model (Mode=MultiModel), its
             endpoint config and the endpoint, and wait until it is InService
  add-model  copy more archives to a deployed endpoint's prefix: they can be called at once, without
             a redeploy
  invoke     call one model (TargetModel) with JSON through SageMaker SDK v3, or with any bytes
             through boto3
  scale      change a deployed endpoint's autoscaling bounds (and its invocations-per-instance
             target)
  delete     delete the endpoint's autoscaling, the endpoint, its endpoint config and its model; the
             archives in S3 are kept

examples:
  scripts/deploy_mme.py deploy --name mme-gpu \\
      --image-uri 123456789012.dkr.ecr.us-east-1.amazonaws.com/mme-gpu:0.1.0 \\
      --model-data-prefix s3://my-bucket/mme/models/ --role MySageMakerRole \\
      --model resnet.tar.gz --model bert.tar.gz
  scripts/deploy_mme.py add-model --endpoint-name mme-gpu vit.tar.gz
  scripts/deploy_mme.py invoke --endpoint-name mme-gpu --target-model resnet.tar.gz \\
      --data '[[0.1, 0.2, 0.3, 0.4]]'
  scripts/deploy_mme.py invoke --endpoint-name mme-gpu --target-model resnet.tar.gz \\
      --client boto3 --content-type application/x-npy --data-file batch.npy --output result.npy
  scripts/deploy_mme.py deploy ... --min-instances 1 --max-instances 4 \\
      --target-invocations-per-instance 600
  scripts/deploy_mme.py scale --endpoint-name mme-gpu --min-instances 2 --max-instances 8
  scripts/deploy_mme.py delete --endpoint-name mme-gpu
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import _autoscaling
import boto3
import botocore.exceptions
from _aws_cli import (
    EXIT_OK,
    ScriptError,
    aws_error_code,
    aws_error_message,
    boto_session,
    config_error,
    parse_s3_uri,
    run_cli,
)
from boto3.exceptions import S3UploadFailedError
from botocore.client import BaseClient

T = TypeVar("T")

ROLE_ENV = "MME_SAGEMAKER_ROLE"
MULTI_MODEL_ENV = "SAGEMAKER_MULTI_MODEL"
ARCHIVE_SUFFIX = ".tar.gz"
JSON = "application/json"
DEFAULT_INSTANCE_TYPE = "ml.g5.xlarge"
# A first call to a model makes SageMaker download and load it (up to 360 s) and answer
# ModelNotReadyException meanwhile; the caller is expected to retry.
MODEL_NOT_READY = "ModelNotReadyException"
DEFAULT_LOAD_WAIT_SECONDS = 360.0
RETRY_DELAY_SECONDS = 5.0


@dataclass(frozen=True)
class ModelSpec:
    """One archive to add: where it is now (local path or s3:// URI), and its TargetModel name under
    the prefix."""

    source: str
    target: str


def parse_model_spec(text: str) -> ModelSpec:
    """``SOURCE`` or ``TARGET=SOURCE``; the target defaults to the source's file name."""
    target, sep, source = text.partition("=")
    if not sep or not target.endswith(ARCHIVE_SUFFIX):
        source, target = text, text.rstrip("/").rsplit("/", 1)[-1]
    if not source.endswith(ARCHIVE_SUFFIX) or not target.endswith(ARCHIVE_SUFFIX):
        raise config_error(
            f"model {text!r}: multi-model endpoints load only {ARCHIVE_SUFFIX} archives"
        )
    if not source.startswith("s3://") and not Path(source).is_file():
        raise config_error(
            f"model archive {source} not found (make one with scripts/package_model.py)"
        )
    return ModelSpec(source=source, target=target)


def parse_environment(pairs: Sequence[str]) -> dict[str, str]:
    """The container environment: the user's KEY=VALUE pairs, with multi-model mode always on."""
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise config_error(f"--env {pair!r}: expected KEY=VALUE")
        env[key] = value
    if env.get(MULTI_MODEL_ENV, "true").lower() != "true":
        raise config_error(
            f"--env {MULTI_MODEL_ENV}={env[MULTI_MODEL_ENV]}: a multi-model endpoint needs true"
        )
    env[MULTI_MODEL_ENV] = "true"
    return env


def normalize_prefix(prefix: str) -> str:
    """SageMaker appends the TargetModel to ModelDataUrl as it is: without the '/', "models" +
    "a.tar.gz" would name s3://bucket/modelsa.tar.gz."""
    if not prefix.startswith("s3://") or len(prefix) <= len("s3://"):
        raise config_error(f"--model-data-prefix {prefix!r}: expected s3://bucket/prefix/")
    return prefix if prefix.endswith("/") else prefix + "/"


def resolve_role(iam: BaseClient, role: str | None) -> str:
    """An execution role ARN from an ARN or a role name; SageMaker needs the role to pull the image
    and models."""
    if not role:
        raise config_error(f"no execution role: pass --role (a name or ARN) or set {ROLE_ENV}")
    if role.startswith("arn:"):
        return role
    try:
        return str(iam.get_role(RoleName=role)["Role"]["Arn"])
    except iam.exceptions.NoSuchEntityException as exc:
        raise config_error(
            f"IAM role {role!r} not found: pass an existing role name or its full ARN"
        ) from exc


def is_not_found(exc: botocore.exceptions.ClientError) -> bool:
    # SageMaker has no NotFound error code for endpoints and models: it answers ValidationException
    # with this text.
    return aws_error_code(exc) == "ValidationException" and "Could not find" in aws_error_message(
        exc
    )


def describe_endpoint(sm: BaseClient, name: str) -> dict[str, Any]:
    try:
        return dict(sm.describe_endpoint(EndpointName=name))
    except botocore.exceptions.ClientError as exc:
        if is_not_found(exc):
            raise ScriptError(f"endpoint {name!r} not found in {sm.meta.region_name}") from exc
        raise


def require_in_service(sm: BaseClient, name: str) -> None:
    status = describe_endpoint(sm, name)["EndpointStatus"]
    if status != "InService":
        raise ScriptError(f"endpoint {name!r} is {status}, not InService: it cannot take calls yet")


def endpoint_models(sm: BaseClient, endpoint: dict[str, Any]) -> tuple[str, list[str]]:
    """The endpoint config's name and the models its variants serve."""
    config_name = str(endpoint["EndpointConfigName"])
    config = sm.describe_endpoint_config(EndpointConfigName=config_name)
    return config_name, [str(variant["ModelName"]) for variant in config["ProductionVariants"]]


def find_model_data_prefix(sm: BaseClient, endpoint_name: str) -> str:
    """The S3 prefix a deployed multi-model endpoint loads its TargetModels from."""
    _, models = endpoint_models(sm, describe_endpoint(sm, endpoint_name))
    container = sm.describe_model(ModelName=models[0]).get("PrimaryContainer", {})
    if container.get("Mode") != "MultiModel":
        raise ScriptError(
            f"endpoint {endpoint_name!r} is not a multi-model endpoint (its model {models[0]!r})"
        )
    return str(container["ModelDataUrl"])


def wait_for_endpoint(
    sm: BaseClient, name: str, timeout_seconds: float, poll_seconds: float
) -> None:
    """Waits for InService; unlike the SDK's own wait, checks before the first sleep and reports why
    it failed."""
    attempts = max(1, math.ceil(timeout_seconds / poll_seconds))
    try:
        sm.get_waiter("endpoint_in_service").wait(
            EndpointName=name, WaiterConfig={"Delay": poll_seconds, "MaxAttempts": attempts}
        )
    except botocore.exceptions.WaiterError as exc:
        endpoint = describe_endpoint(sm, name)
        reason = (
            endpoint.get("FailureReason")
            or f"still {endpoint['EndpointStatus']} after {timeout_seconds:.0f} s"
        )
        raise ScriptError(f"endpoint {name!r} did not come into service: {reason}") from exc


def upload_archives(s3: BaseClient, specs: Sequence[ModelSpec], prefix: str) -> list[str]:
    """Uploads (local) or copies (S3) each archive under the prefix, as its TargetModel name;
    returns the S3 URIs."""
    bucket, key_prefix = parse_s3_uri(prefix)
    uris = []
    for spec in specs:
        key = key_prefix + spec.target
        try:
            if spec.source.startswith("s3://"):
                source_bucket, source_key = parse_s3_uri(spec.source)
                # multipart above 8 MiB
                s3.copy({"Bucket": source_bucket, "Key": source_key}, bucket, key)
            else:
                s3.upload_file(spec.source, bucket, key)
        except S3UploadFailedError as exc:
            # boto3 wraps NoSuchBucket, AccessDenied, ... in this one type
            raise ScriptError(f"upload of {spec.source} to {prefix} failed: {exc}") from exc
        except botocore.exceptions.ClientError as exc:
            if aws_error_code(exc) in ("404", "NoSuchKey"):
                raise config_error(f"model archive {spec.source} not found") from exc
            raise
        uris.append(f"s3://{bucket}/{key}")
    return uris


def create_endpoint(
    session: boto3.Session, args: argparse.Namespace, prefix: str, role: str, env: dict[str, str]
) -> str:
    """The model (``Mode=MultiModel``), its endpoint config and the endpoint, with SDK v3's resource
    classes (v3 has no ``MultiDataModel``); returns the endpoint's name. The SDK is imported here:
    it takes seconds.

    A model of that name left by ``delete --keep-model`` (or by a deploy that stopped halfway) is
    used again when it is the same image, prefix and environment, as SDK v2's ``deploy`` did;
    otherwise the deploy stops and says why."""
    import pydantic
    from sagemaker.core.resources import Endpoint, EndpointConfig, Model
    from sagemaker.core.shapes import ContainerDefinition, ProductionVariant

    endpoint_name = str(args.endpoint_name or args.name)
    where = {"session": session, "region": session.region_name}
    container = ContainerDefinition(
        image=args.image_uri, mode="MultiModel", model_data_url=prefix, environment=env
    )
    variant = ProductionVariant(
        variant_name="AllTraffic",
        model_name=args.name,
        initial_instance_count=args.instance_count,
        instance_type=args.instance_type,
        initial_variant_weight=1.0,
    )
    try:
        try:
            Model.create(
                model_name=args.name, primary_container=container, execution_role_arn=role, **where
            )
        except botocore.exceptions.ClientError as exc:
            if not _already_exists(exc):
                raise
            _reuse_model(session.client("sagemaker"), args.name, args.image_uri, prefix, env)
        EndpointConfig.create(
            endpoint_config_name=endpoint_name, production_variants=[variant], **where
        )
        Endpoint.create(endpoint_name=endpoint_name, endpoint_config_name=endpoint_name, **where)
    except pydantic.ValidationError as exc:
        # v3 describes each resource after creating it, and validates the answer
        reason = str(exc).strip().splitlines()[0]
        raise ScriptError(
            f"SageMaker took the request, but SDK v3 could not read its answer back: {reason}"
        ) from exc
    return endpoint_name


def _already_exists(exc: botocore.exceptions.ClientError) -> bool:
    return aws_error_code(exc) == "ValidationException" and "already exist" in aws_error_message(
        exc
    )


def _reuse_model(
    sm: BaseClient, name: str, image_uri: str, prefix: str, env: dict[str, str]
) -> None:
    container = sm.describe_model(ModelName=name).get("PrimaryContainer", {})
    found = (
        container.get("Image"),
        container.get("Mode"),
        container.get("ModelDataUrl"),
        container.get("Environment"),
    )
    if found != (image_uri, "MultiModel", prefix, env):
        raise config_error(
            f"model {name!r} exists with another image, prefix or environment: delete it "
            "(`deploy_mme.py delete --endpoint-name ...` without --keep-model) or deploy with "
            "another --name"
        )
    print(f"using the existing model {name}")


def build_invoke_kwargs(
    endpoint_name: str,
    target_model: str,
    body: bytes,
    content_type: str,
    accept: str,
    custom_attributes: str | None = None,
) -> dict[str, Any]:
    """The arguments of sagemaker-runtime invoke_endpoint, in one place so that a test can check
    them."""
    kwargs: dict[str, Any] = {
        "EndpointName": endpoint_name,
        "TargetModel": target_model,
        "ContentType": content_type,
        "Accept": accept,
        "Body": body,
    }
    if custom_attributes is not None:
        kwargs["CustomAttributes"] = custom_attributes
    return kwargs


def is_model_not_ready(exc: BaseException) -> bool:
    return (
        isinstance(exc, botocore.exceptions.ClientError) and aws_error_code(exc) == MODEL_NOT_READY
    )


def retry_while_loading(
    call: Callable[[], T],
    timeout_seconds: float,
    delay_seconds: float = RETRY_DELAY_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Repeats ``call`` while SageMaker is still loading the target model, until ``timeout_seconds``
    have passed."""
    deadline = clock() + timeout_seconds
    while True:
        try:
            return call()
        except botocore.exceptions.ClientError as exc:
            if not is_model_not_ready(exc) or clock() + delay_seconds > deadline:
                raise
        print(f"model is loading; retrying in {delay_seconds:.0f} s", file=sys.stderr)
        sleep(delay_seconds)


def invoke_with_sdk(
    session: boto3.Session,
    endpoint_name: str,
    target_model: str,
    data: Any,
    custom_attributes: str | None,
) -> Any:
    """JSON in, JSON out, through SDK v3's ``Endpoint.invoke`` with its JSON serializer and
    deserializer."""
    from sagemaker.core.deserializers import JSONDeserializer
    from sagemaker.core.resources import Endpoint
    from sagemaker.core.serializers import JSONSerializer

    endpoint = Endpoint(
        endpoint_name=endpoint_name, serializer=JSONSerializer(), deserializer=JSONDeserializer()
    )
    extra = {} if custom_attributes is None else {"custom_attributes": custom_attributes}
    result = endpoint.invoke(
        body=data,
        content_type=JSON,
        accept=JSON,
        target_model=target_model,
        session=session,
        region=session.region_name,
        **extra,
    )
    return result.body


def invoke_with_boto3(runtime: BaseClient, kwargs: dict[str, Any]) -> tuple[bytes, str]:
    """Any payload, as raw bytes both ways: for NPY, CSV or images, which the JSON path cannot
    carry."""
    response = runtime.invoke_endpoint(**kwargs)
    return response["Body"].read(), str(response.get("ContentType", ""))


def delete_endpoint(sm: BaseClient, name: str, keep_model: bool = False) -> list[str]:
    """Deletes the endpoint, then its config, then (unless kept) its models; returns what was
    deleted."""
    config_name, models = endpoint_models(sm, describe_endpoint(sm, name))
    sm.delete_endpoint(EndpointName=name)
    deleted = [f"endpoint {name}"]
    sm.delete_endpoint_config(EndpointConfigName=config_name)
    deleted.append(f"endpoint config {config_name}")
    for model_name in [] if keep_model else models:
        sm.delete_model(ModelName=model_name)
        deleted.append(f"model {model_name}")
    return deleted


def cmd_deploy(args: argparse.Namespace) -> int:
    session = boto_session(args.region)
    env = parse_environment(args.env)
    specs = [parse_model_spec(text) for text in args.model]
    prefix = normalize_prefix(args.model_data_prefix)
    role = resolve_role(session.client("iam"), args.role)
    endpoint_name = args.endpoint_name or args.name
    scaling = _autoscaling.from_arguments(args, default_min=args.instance_count)
    if scaling is not None and args.no_wait:
        raise config_error(
            "autoscaling is set up on an InService endpoint: drop --no-wait, or run `scale` later"
        )
    # Archives first: a wrong path then fails before an endpoint starts billing.
    for uri in upload_archives(session.client("s3"), specs, prefix):
        print(f"added {uri}")
    create_endpoint(session, args, prefix, role, env)
    print(
        f"creating endpoint {endpoint_name} (model {args.name}, {args.instance_count} x "
        f"{args.instance_type})"
    )
    if not args.no_wait:
        sm = session.client("sagemaker")
        wait_for_endpoint(sm, endpoint_name, args.wait_seconds, args.poll_seconds)
        print(f"endpoint {endpoint_name} is InService")
        if scaling is not None:
            variant = _autoscaling.variant_of(describe_endpoint(sm, endpoint_name))
            for item in _autoscaling.apply(
                session.client("application-autoscaling"), endpoint_name, variant, scaling
            ):
                print(f"set {item}")
    return EXIT_OK


def cmd_scale(args: argparse.Namespace) -> int:
    session = boto_session(args.region)
    scaling = _autoscaling.from_arguments(args, default_min=args.min_instances)
    if scaling is None:  # argparse requires the bounds; kept for the type checker
        raise config_error("scale needs --min-instances and --max-instances")
    sm = session.client("sagemaker")
    require_in_service(sm, args.endpoint_name)
    variant = _autoscaling.variant_of(describe_endpoint(sm, args.endpoint_name))
    for item in _autoscaling.apply(
        session.client("application-autoscaling"), args.endpoint_name, variant, scaling
    ):
        print(f"set {item}")
    return EXIT_OK


def cmd_add_model(args: argparse.Namespace) -> int:
    session = boto_session(args.region)
    specs = [parse_model_spec(text) for text in args.models]
    prefix = args.model_data_prefix or find_model_data_prefix(
        session.client("sagemaker"), args.endpoint_name
    )
    for uri in upload_archives(session.client("s3"), specs, normalize_prefix(prefix)):
        print(f"added {uri}")
    return EXIT_OK


def _read_payload(args: argparse.Namespace) -> bytes:
    if args.data_file is not None:
        if str(args.data_file) == "-":
            return sys.stdin.buffer.read()
        if not args.data_file.is_file():
            raise config_error(f"--data-file {args.data_file}: no such file")
        return Path(args.data_file).read_bytes()
    return str(args.data).encode("utf-8")


def _write_result(output: Path | None, body: bytes) -> None:
    if output is None:
        sys.stdout.buffer.write(body if body.endswith(b"\n") else body + b"\n")
        sys.stdout.flush()
    else:
        output.write_bytes(body)
        print(f"wrote {len(body)} bytes to {output}", file=sys.stderr)


def _json_payload(args: argparse.Namespace, payload: bytes) -> Any:
    if args.content_type != JSON or args.accept != JSON:
        raise config_error(
            "--client sdk speaks JSON only; use --client boto3 for other content types"
        )
    try:
        return json.loads(payload)
    except ValueError as exc:
        raise config_error(
            f"the payload is not JSON ({exc}); use --client boto3 to send raw bytes"
        ) from exc


def cmd_invoke(args: argparse.Namespace) -> int:
    payload = _read_payload(args)
    # bad input fails before any AWS call
    data = _json_payload(args, payload) if args.client == "sdk" else None
    session = boto_session(args.region)
    require_in_service(session.client("sagemaker"), args.endpoint_name)
    if args.client == "sdk":
        result = retry_while_loading(
            lambda: invoke_with_sdk(
                session, args.endpoint_name, args.target_model, data, args.custom_attributes
            ),
            args.load_wait_seconds,
        )
        _write_result(args.output, json.dumps(result, indent=2).encode("utf-8"))
        return EXIT_OK
    kwargs = build_invoke_kwargs(
        args.endpoint_name,
        args.target_model,
        payload,
        args.content_type,
        args.accept,
        args.custom_attributes,
    )
    runtime = session.client("sagemaker-runtime")
    body, content_type = retry_while_loading(
        lambda: invoke_with_boto3(runtime, kwargs), args.load_wait_seconds
    )
    print(f"content type: {content_type}", file=sys.stderr)
    _write_result(args.output, body)
    return EXIT_OK


def cmd_delete(args: argparse.Namespace) -> int:
    session = boto_session(args.region)
    sm = session.client("sagemaker")
    # Autoscaling first: a scalable target left on a deleted endpoint would try to scale it.
    variant = _autoscaling.variant_of(describe_endpoint(sm, args.endpoint_name))
    removed = _autoscaling.remove(
        session.client("application-autoscaling"), args.endpoint_name, variant
    )
    for item in removed + delete_endpoint(sm, args.endpoint_name, args.keep_model):
        print(f"deleted {item}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deploy_mme.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # --region goes on every subcommand, where people type it (`deploy_mme.py delete --region ...`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--region", help="AWS region (default: the AWS configuration's)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    deploy = commands.add_parser(
        "deploy", parents=[common], help="create a multi-model endpoint and add models to it"
    )
    deploy.add_argument(
        "--name", required=True, help="SageMaker model name (and endpoint name by default)"
    )
    deploy.add_argument(
        "--image-uri", required=True, help="ECR image, as printed by build_and_push.py"
    )
    deploy.add_argument(
        "--model-data-prefix", required=True, help="s3://bucket/prefix/ holding the model archives"
    )
    deploy.add_argument(
        "--role",
        default=os.environ.get(ROLE_ENV),
        help=f"execution role name or ARN (default: ${ROLE_ENV})",
    )
    deploy.add_argument("--endpoint-name", help="endpoint name (default: --name)")
    deploy.add_argument(
        "--instance-type",
        default=DEFAULT_INSTANCE_TYPE,
        help="GPU instance type (default: %(default)s)",
    )
    deploy.add_argument(
        "--instance-count", type=int, default=1, help="initial instance count (default: 1)"
    )
    deploy.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[TARGET=]SOURCE",
        help="model archive to add, local or s3://; TARGET (default: its file name) is the "
        "TargetModel (repeatable)",
    )
    deploy.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"container environment variable (repeatable); {MULTI_MODEL_ENV}=true is always set",
    )
    deploy.add_argument(
        "--no-wait", action="store_true", help="return once the endpoint is being created"
    )
    deploy.add_argument(
        "--wait-seconds",
        type=float,
        default=1800.0,
        help="how long to wait for InService (default: %(default).0f)",
    )
    deploy.add_argument(
        "--poll-seconds",
        type=float,
        default=30.0,
        help="status check interval (default: %(default).0f)",
    )
    _autoscaling.add_arguments(deploy, required=False)
    deploy.set_defaults(handler=cmd_deploy)

    scale = commands.add_parser(
        "scale", parents=[common], help="change a deployed endpoint's autoscaling"
    )
    scale.add_argument("--endpoint-name", required=True, help="the multi-model endpoint")
    _autoscaling.add_arguments(scale, required=True)
    scale.set_defaults(handler=cmd_scale)

    add = commands.add_parser(
        "add-model", parents=[common], help="add model archives to a deployed endpoint"
    )
    add.add_argument("--endpoint-name", required=True, help="the multi-model endpoint")
    add.add_argument(
        "--model-data-prefix", help="S3 prefix (default: read from the endpoint's model)"
    )
    add.add_argument(
        "models", nargs="+", metavar="[TARGET=]SOURCE", help="model archives, local or s3://"
    )
    add.set_defaults(handler=cmd_add_model)

    invoke = commands.add_parser("invoke", parents=[common], help="call one model of the endpoint")
    invoke.add_argument("--endpoint-name", required=True, help="the multi-model endpoint")
    invoke.add_argument(
        "--target-model", required=True, help="archive path relative to the prefix, e.g. a.tar.gz"
    )
    payload = invoke.add_mutually_exclusive_group(required=True)
    payload.add_argument("--data", help="request body as text, e.g. a JSON document")
    payload.add_argument(
        "--data-file", type=Path, help="file with the request body ('-' for stdin)"
    )
    invoke.add_argument(
        "--client",
        choices=("sdk", "boto3"),
        default="sdk",
        help="sdk: SageMaker Predictor, JSON only; boto3: invoke_endpoint with raw bytes (default: "
        "%(default)s)",
    )
    invoke.add_argument(
        "--content-type", default=JSON, help="request content type (default: %(default)s)"
    )
    invoke.add_argument(
        "--accept", default=JSON, help="response content type wanted (default: %(default)s)"
    )
    invoke.add_argument(
        "--custom-attributes", help="passed to the handler as X-Amzn-SageMaker-Custom-Attributes"
    )
    invoke.add_argument(
        "--output", type=Path, help="write the response body here (default: stdout)"
    )
    invoke.add_argument(
        "--load-wait-seconds",
        type=float,
        default=DEFAULT_LOAD_WAIT_SECONDS,
        help="retry this long while the model is being loaded (default: %(default).0f)",
    )
    invoke.set_defaults(handler=cmd_invoke)

    delete = commands.add_parser(
        "delete", parents=[common], help="delete the endpoint, its config and its model"
    )
    delete.add_argument("--endpoint-name", required=True, help="the endpoint to delete")
    delete.add_argument(
        "--keep-model", action="store_true", help="keep the SageMaker model for a later redeploy"
    )
    delete.set_defaults(handler=cmd_delete)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
