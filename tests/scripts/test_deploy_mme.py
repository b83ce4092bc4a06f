"""scripts/deploy_mme.py against a real moto server: what deploy creates, add-model, invoke, delete, and the errors.

moto 5.2.5 implements CreateModel, CreateEndpointConfig, CreateEndpoint (InService at once), Describe*/Delete*,
S3, IAM and sagemaker-runtime InvokeEndpoint. Its InvokeEndpoint does not run a container: it answers from a
queue filled through /moto-api/static/sagemaker/endpoint-results, and accepts any endpoint name. So the invoke
tests check what went over the wire (moto's request recorder) and what the script makes of the answer; they
cannot check inference itself, which the container suites do.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import _aws_cli
import boto3
import botocore.exceptions
import deploy_mme
import pytest
from _aws_cli import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, ScriptError, run_cli
from deploy_mme import (
    MODEL_NOT_READY,
    ModelSpec,
    build_invoke_kwargs,
    find_model_data_prefix,
    main,
    normalize_prefix,
    parse_environment,
    parse_model_spec,
    resolve_role,
    retry_while_loading,
)

BUCKET = "mme-test-models"
PREFIX = f"s3://{BUCKET}/mme/models/"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/mme-gpu:1.0"
ROLE_ARN = "arn:aws:iam::123456789012:role/SageMakerExecution"
# moto checks instance types against an older list that has no g5: g4dn is a GPU type it knows.
INSTANCE_TYPE = "ml.g4dn.xlarge"


def _drop_empty_structures(parsed: dict[str, Any], **_: Any) -> None:
    for key in [key for key, value in parsed.items() if value == {}]:
        del parsed[key]


@pytest.fixture(autouse=True)
def sdk_v3_reads_moto(monkeypatch: pytest.MonkeyPatch) -> None:
    """moto 5.2.5 describes models, endpoint configs and endpoints with empty structures (``VpcConfig: {}``,
    ``DataCaptureConfig: {}``) where AWS leaves them out, and SDK v3's pydantic shapes refuse them after every create.
    The sessions the script makes here drop them, as AWS would have."""

    def session(region: str | None) -> boto3.Session:
        made = _aws_cli.boto_session(region)
        made.events.register("after-call.sagemaker", _drop_empty_structures)
        return made

    monkeypatch.setattr(deploy_mme, "boto_session", session)


@pytest.fixture
def archives(aws: str, tmp_path: Path) -> dict[str, Path | str]:
    """A local archive and one already in S3 (as a training job leaves it), in a bucket that holds the prefix."""
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key="jobs/42/output/model.tar.gz", Body=b"archive from s3")
    local = tmp_path / "resnet.tar.gz"
    local.write_bytes(b"local archive")
    return {"local": local, "s3": f"s3://{BUCKET}/jobs/42/output/model.tar.gz"}


def _deploy(*extra: str) -> int:
    argv = ["deploy", "--name", "mme-gpu", "--image-uri", IMAGE, "--model-data-prefix", PREFIX]
    return run_cli(main, [*argv, "--instance-type", INSTANCE_TYPE, "--poll-seconds", "1", *extra])


def _object(key: str) -> bytes:
    return bytes(boto3.client("s3").get_object(Bucket=BUCKET, Key=key)["Body"].read())


def _recorded_invocations(moto_api: Any) -> list[dict[str, Any]]:
    lines = moto_api("recorder/download-recording").decode().splitlines()
    return [entry for entry in map(json.loads, lines) if entry["url"].endswith("/invocations")]


def _headers(entry: dict[str, Any]) -> dict[str, str]:
    return {name.lower(): value for name, value in entry["headers"].items()}


def _body(entry: dict[str, Any]) -> bytes:
    return base64.b64decode(entry["body"]) if entry["body_encoded"] else str(entry["body"]).encode()


def test_deploy_creates_a_multi_model_with_image_env_and_prefix(archives: dict[str, Any]) -> None:
    code = _deploy(
        "--role", ROLE_ARN,
        "--env", "SAGEMAKER_MODEL_SERVER_WORKERS=2",
        "--model", str(archives["local"]),
        "--model", f"bert.tar.gz={archives['s3']}",
        "--instance-count", "2",
    )  # fmt: skip
    assert code == EXIT_OK

    sm = boto3.client("sagemaker")
    model = sm.describe_model(ModelName="mme-gpu")
    assert model["ExecutionRoleArn"] == ROLE_ARN
    assert model["PrimaryContainer"] == {
        "Image": IMAGE,
        "Mode": "MultiModel",
        "ModelDataUrl": PREFIX,
        "Environment": {"SAGEMAKER_MODEL_SERVER_WORKERS": "2", "SAGEMAKER_MULTI_MODEL": "true"},
    }
    endpoint = sm.describe_endpoint(EndpointName="mme-gpu")
    assert endpoint["EndpointStatus"] == "InService"
    variants = sm.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])["ProductionVariants"]
    assert [(v["ModelName"], v["InstanceType"], v["InitialInstanceCount"]) for v in variants] == [
        ("mme-gpu", INSTANCE_TYPE, 2)
    ]
    assert _object("mme/models/resnet.tar.gz") == b"local archive"
    assert _object("mme/models/bert.tar.gz") == b"archive from s3"


def test_deploy_resolves_a_role_name_through_iam(archives: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    iam = boto3.client("iam")
    arn = iam.create_role(RoleName="MmeRole", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    monkeypatch.setenv("MME_SAGEMAKER_ROLE", "MmeRole")

    assert _deploy("--endpoint-name", "mme-endpoint") == EXIT_OK

    assert boto3.client("sagemaker").describe_model(ModelName="mme-gpu")["ExecutionRoleArn"] == arn
    assert boto3.client("sagemaker").describe_endpoint(EndpointName="mme-endpoint")["EndpointStatus"] == "InService"


def test_resolve_role_passes_arns_and_refuses_unknown_names(aws: str) -> None:
    iam = boto3.client("iam")
    assert resolve_role(iam, ROLE_ARN) == ROLE_ARN
    with pytest.raises(ScriptError, match="IAM role 'Missing' not found") as error:
        resolve_role(iam, "Missing")
    assert error.value.exit_code == EXIT_CONFIG


def test_deploy_without_a_role_exits_2_before_creating_anything(
    archives: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _deploy("--model", str(archives["local"])) == EXIT_CONFIG

    assert "no execution role: pass --role" in capsys.readouterr().err
    assert boto3.client("sagemaker").list_models()["Models"] == []
    assert "Contents" not in boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="mme/")


def test_deploy_with_a_missing_s3_archive_fails_before_the_endpoint(
    archives: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _deploy("--role", ROLE_ARN, "--model", f"s3://{BUCKET}/nope/model.tar.gz") == EXIT_CONFIG

    assert f"model archive s3://{BUCKET}/nope/model.tar.gz not found" in capsys.readouterr().err
    assert boto3.client("sagemaker").list_endpoints()["Endpoints"] == []


def test_missing_credentials_is_one_line_and_exit_2(
    no_aws_credentials: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(main, ["delete", "--endpoint-name", "mme-gpu"]) == EXIT_CONFIG

    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: no AWS credentials found")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("dist/resnet.tar.gz", ModelSpec("dist/resnet.tar.gz", "resnet.tar.gz")),
        ("s3://b/jobs/1/output/model.tar.gz", ModelSpec("s3://b/jobs/1/output/model.tar.gz", "model.tar.gz")),
        ("team/bert.tar.gz=s3://b/out/model.tar.gz", ModelSpec("s3://b/out/model.tar.gz", "team/bert.tar.gz")),
    ],
)
def test_parse_model_spec_names_the_target_model(
    text: str, expected: ModelSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "resnet.tar.gz").write_bytes(b"")
    assert parse_model_spec(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [("s3://b/model.zip", "only .tar.gz"), ("missing.tar.gz", "not found"), ("a.tar.gz=s3://b/m.pt", "only .tar.gz")],
)
def test_parse_model_spec_refuses_what_an_endpoint_cannot_load(
    text: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ScriptError, match=message):
        parse_model_spec(text)


def test_environment_always_turns_multi_model_on() -> None:
    assert parse_environment(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y", "SAGEMAKER_MULTI_MODEL": "true"}
    with pytest.raises(ScriptError, match="needs true"):
        parse_environment(["SAGEMAKER_MULTI_MODEL=false"])
    with pytest.raises(ScriptError, match="expected KEY=VALUE"):
        parse_environment(["NOVALUE"])


def test_prefix_gets_its_trailing_slash() -> None:
    assert normalize_prefix("s3://bucket/models") == "s3://bucket/models/"
    assert normalize_prefix("s3://bucket/models/") == "s3://bucket/models/"
    with pytest.raises(ScriptError, match="expected s3://bucket/prefix/"):
        normalize_prefix("bucket/models")


def test_add_model_finds_the_prefix_from_the_endpoint(archives: dict[str, Any], tmp_path: Path) -> None:
    assert _deploy("--role", ROLE_ARN) == EXIT_OK
    extra = tmp_path / "vit.tar.gz"
    extra.write_bytes(b"added later")

    assert run_cli(main, ["add-model", "--endpoint-name", "mme-gpu", str(extra)]) == EXIT_OK

    assert _object("mme/models/vit.tar.gz") == b"added later"


def test_add_model_refuses_a_single_model_endpoint(aws: str) -> None:
    sm = boto3.client("sagemaker")
    sm.create_model(
        ModelName="single",
        ExecutionRoleArn=ROLE_ARN,
        PrimaryContainer={"Image": IMAGE, "ModelDataUrl": f"s3://{BUCKET}/single/model.tar.gz"},
    )
    sm.create_endpoint_config(
        EndpointConfigName="single",
        ProductionVariants=[
            {
                "VariantName": "AllTraffic",
                "ModelName": "single",
                "InstanceType": INSTANCE_TYPE,
                "InitialInstanceCount": 1,
            }
        ],
    )
    sm.create_endpoint(EndpointName="single", EndpointConfigName="single")

    with pytest.raises(ScriptError, match="not a multi-model endpoint"):
        find_model_data_prefix(sm, "single")


def test_invoke_through_the_sdk_sends_json_to_the_target_model(
    archives: dict[str, Any], moto_api: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _deploy("--role", ROLE_ARN) == EXIT_OK
    answer = {"predictions": [[0.1, 0.2, 0.7]]}
    moto_api(
        "static/sagemaker/endpoint-results",
        {"results": [{"Body": json.dumps(answer), "ContentType": "application/json"}]},
    )
    moto_api("recorder/reset-recording")
    moto_api("recorder/start-recording")
    capsys.readouterr()
    try:
        code = run_cli(
            main,
            ["invoke", "--endpoint-name", "mme-gpu", "--target-model", "resnet.tar.gz", "--data", "[[1, 2, 3, 4]]"],
        )
    finally:
        moto_api("recorder/stop-recording")

    assert code == EXIT_OK
    assert json.loads(capsys.readouterr().out) == answer
    [call] = _recorded_invocations(moto_api)
    assert call["url"].endswith("/endpoints/mme-gpu/invocations")
    headers = _headers(call)
    assert headers["x-amzn-sagemaker-target-model"] == "resnet.tar.gz"
    assert (headers["content-type"], headers["accept"]) == ("application/json", "application/json")
    assert json.loads(_body(call)) == [[1, 2, 3, 4]]


def test_invoke_through_boto3_sends_the_file_as_is_and_writes_the_answer_as_is(
    archives: dict[str, Any], moto_api: Any, tmp_path: Path
) -> None:
    assert _deploy("--role", ROLE_ARN) == EXIT_OK
    moto_api(
        "static/sagemaker/endpoint-results",
        {"results": [{"Body": "0.1,0.2,0.7\n", "ContentType": "text/csv"}]},
    )
    # moto 5.2.5 decodes every request body as UTF-8 and answers 500 to a binary one (an NPY file), so the raw
    # path is shown with CSV; the script itself passes the file's bytes through untouched.
    payload = tmp_path / "batch.csv"
    payload.write_bytes(b"1,2,3,4\n5,6,7,8\n")
    output = tmp_path / "result.csv"
    moto_api("recorder/reset-recording")
    moto_api("recorder/start-recording")
    try:
        code = run_cli(
            main,
            [
                "invoke", "--endpoint-name", "mme-gpu", "--target-model", "team/bert.tar.gz", "--client", "boto3",
                "--content-type", "text/csv", "--accept", "text/csv", "--custom-attributes", "trace=1",
                "--data-file", str(payload), "--output", str(output),
            ],
        )  # fmt: skip
    finally:
        moto_api("recorder/stop-recording")

    assert code == EXIT_OK
    assert output.read_bytes() == b"0.1,0.2,0.7\n"
    [call] = _recorded_invocations(moto_api)
    headers = _headers(call)
    assert headers["x-amzn-sagemaker-target-model"] == "team/bert.tar.gz"
    assert headers["x-amzn-sagemaker-custom-attributes"] == "trace=1"
    assert (headers["content-type"], headers["accept"]) == ("text/csv", "text/csv")
    assert _body(call) == payload.read_bytes()


def test_build_invoke_kwargs_matches_the_invoke_endpoint_api() -> None:
    kwargs = build_invoke_kwargs("ep", "a.tar.gz", b"{}", "application/json", "application/json")
    assert kwargs == {
        "EndpointName": "ep",
        "TargetModel": "a.tar.gz",
        "ContentType": "application/json",
        "Accept": "application/json",
        "Body": b"{}",
    }
    assert build_invoke_kwargs("ep", "a.tar.gz", b"", "text/csv", "text/csv", "k=v")["CustomAttributes"] == "k=v"
    # Every name must be a parameter of the real operation, or boto3 would refuse the call.
    shape = boto3.client("sagemaker-runtime", region_name="us-east-1").meta.service_model.operation_model(
        "InvokeEndpoint"
    )
    assert set(kwargs) | {"CustomAttributes"} <= set(shape.input_shape.members)


def test_invoke_sdk_client_refuses_non_json_before_calling_aws(
    no_aws_credentials: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # No credentials: reaching AWS would fail differently, so this proves the payload is checked first.
    argv = ["invoke", "--endpoint-name", "mme-gpu", "--target-model", "a.tar.gz", "--data", "1,2,3"]
    assert run_cli(main, argv) == EXIT_CONFIG
    assert "the payload is not JSON" in capsys.readouterr().err
    assert run_cli(main, [*argv[:5], "--data", "{}", "--content-type", "text/csv"]) == EXIT_CONFIG
    assert "--client sdk speaks JSON only" in capsys.readouterr().err


def test_invoke_unknown_endpoint_says_not_found(aws: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["invoke", "--endpoint-name", "nope", "--target-model", "a.tar.gz", "--data", "{}"]

    assert run_cli(main, argv) == EXIT_FAILURE

    assert capsys.readouterr().err.strip() == "error: endpoint 'nope' not found in us-east-1"


def test_delete_removes_endpoint_config_and_model_but_keeps_archives(
    archives: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _deploy("--role", ROLE_ARN, "--model", str(archives["local"])) == EXIT_OK

    assert run_cli(main, ["delete", "--endpoint-name", "mme-gpu"]) == EXIT_OK

    sm = boto3.client("sagemaker")
    assert sm.list_endpoints()["Endpoints"] == []
    assert sm.list_endpoint_configs()["EndpointConfigs"] == []
    assert sm.list_models()["Models"] == []
    assert _object("mme/models/resnet.tar.gz") == b"local archive"
    assert capsys.readouterr().out.splitlines()[-3:] == [
        "deleted endpoint mme-gpu",
        "deleted endpoint config mme-gpu",
        "deleted model mme-gpu",
    ]


def test_delete_keep_model_leaves_the_model(archives: dict[str, Any]) -> None:
    assert _deploy("--role", ROLE_ARN) == EXIT_OK
    assert run_cli(main, ["delete", "--endpoint-name", "mme-gpu", "--keep-model"]) == EXIT_OK
    assert [m["ModelName"] for m in boto3.client("sagemaker").list_models()["Models"]] == ["mme-gpu"]


def test_delete_unknown_endpoint_says_not_found(aws: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(main, ["delete", "--endpoint-name", "nope"]) == EXIT_FAILURE
    assert capsys.readouterr().err.strip() == "error: endpoint 'nope' not found in us-east-1"


def _client_error(code: str) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError({"Error": {"Code": code, "Message": "m"}}, "InvokeEndpoint")


def test_retry_while_loading_retries_only_model_not_ready_until_the_deadline() -> None:
    # moto cannot be made to answer ModelNotReadyException, so a local callable raises it; the retry policy is ours.
    now = 0.0
    outcomes: list[Any] = []

    def call() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return str(outcome)

    def sleep(seconds: float) -> None:
        nonlocal now
        now += seconds

    def retry(timeout_seconds: float) -> str:
        return retry_while_loading(call, timeout_seconds, delay_seconds=5, sleep=sleep, clock=lambda: now)

    outcomes[:] = [_client_error(MODEL_NOT_READY), _client_error(MODEL_NOT_READY), "answer"]
    assert retry(60) == "answer"
    assert now == 10

    outcomes[:] = [_client_error("ModelError"), "never reached"]
    with pytest.raises(botocore.exceptions.ClientError, match="ModelError"):
        retry(60)
    assert outcomes == ["never reached"]

    now = 0.0
    outcomes[:] = [_client_error(MODEL_NOT_READY)] * 4
    with pytest.raises(botocore.exceptions.ClientError, match=MODEL_NOT_READY):
        retry(10)
    assert (len(outcomes), now) == (1, 10)  # tried at 0, 5 and 10 s; a fourth try would come after the deadline


RESOURCE = "endpoint/mme-gpu/variant/AllTraffic"


def _scalable_targets() -> list[dict[str, Any]]:
    autoscaling = boto3.client("application-autoscaling")
    return list(autoscaling.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"])


def _policies() -> list[dict[str, Any]]:
    autoscaling = boto3.client("application-autoscaling")
    return list(autoscaling.describe_scaling_policies(ServiceNamespace="sagemaker")["ScalingPolicies"])


def test_deploy_with_autoscaling_registers_the_variant_and_a_target_tracking_policy(
    archives: dict[str, Any],
) -> None:
    code = _deploy(
        "--role", ROLE_ARN, "--instance-count", "2",
        "--max-instances", "6", "--target-invocations-per-instance", "750", "--scale-in-cooldown", "600",
    )  # fmt: skip
    assert code == EXIT_OK

    [target] = _scalable_targets()
    assert (target["ResourceId"], target["ScalableDimension"]) == (RESOURCE, "sagemaker:variant:DesiredInstanceCount")
    assert (target["MinCapacity"], target["MaxCapacity"]) == (2, 6)  # the minimum defaults to --instance-count
    [policy] = _policies()
    assert policy["PolicyName"] == "mme-gpu-invocations-per-instance"
    assert policy["PolicyType"] == "TargetTrackingScaling"
    configuration = policy["TargetTrackingScalingPolicyConfiguration"]
    assert configuration["TargetValue"] == 750
    assert configuration["PredefinedMetricSpecification"]["PredefinedMetricType"] == (
        "SageMakerVariantInvocationsPerInstance"
    )
    assert (configuration["ScaleInCooldown"], configuration["ScaleOutCooldown"]) == (600, 60)


def test_deploy_without_scaling_options_sets_up_no_autoscaling(archives: dict[str, Any]) -> None:
    assert _deploy("--role", ROLE_ARN) == EXIT_OK
    assert _scalable_targets() == [] and _policies() == []


def test_scale_changes_the_bounds_of_a_running_endpoint(archives: dict[str, Any]) -> None:
    assert _deploy("--role", ROLE_ARN, "--max-instances", "3", "--target-invocations-per-instance", "500") == EXIT_OK

    argv = ["scale", "--endpoint-name", "mme-gpu", "--min-instances", "2", "--max-instances", "8"]
    assert run_cli(main, argv) == EXIT_OK

    [target] = _scalable_targets()
    assert (target["MinCapacity"], target["MaxCapacity"]) == (2, 8)
    assert [p["TargetTrackingScalingPolicyConfiguration"]["TargetValue"] for p in _policies()] == [500]


def test_delete_removes_the_policy_and_the_scalable_target_before_the_endpoint(
    archives: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _deploy("--role", ROLE_ARN, "--max-instances", "3", "--target-invocations-per-instance", "500") == EXIT_OK

    assert run_cli(main, ["delete", "--endpoint-name", "mme-gpu"]) == EXIT_OK

    assert _scalable_targets() == [] and _policies() == []
    assert capsys.readouterr().out.splitlines()[-5:] == [
        "deleted scaling policy mme-gpu-invocations-per-instance",
        f"deleted scalable target {RESOURCE}",
        "deleted endpoint mme-gpu",
        "deleted endpoint config mme-gpu",
        "deleted model mme-gpu",
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--min-instances", "5", "--max-instances", "2"], "--max-instances (2) must be at least --min-instances (5)"),
        (["--min-instances", "-1", "--max-instances", "2"], "--min-instances must be at least 1, not -1"),
        (["--max-instances", "2", "--target-invocations-per-instance", "0"], "must be above 0, not 0.0"),
        (["--target-invocations-per-instance", "100"], "autoscaling needs --max-instances"),
        (["--max-instances", "2", "--no-wait"], "drop --no-wait, or run `scale` later"),
    ],
)
def test_bad_scaling_options_exit_2_with_one_line_before_anything_is_created(
    archives: dict[str, Any], capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    assert _deploy("--role", ROLE_ARN, *options) == EXIT_CONFIG

    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert boto3.client("sagemaker").list_endpoints()["Endpoints"] == []


def test_scale_with_bad_bounds_exits_2(aws: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["scale", "--endpoint-name", "mme-gpu", "--min-instances", "3", "--max-instances", "1"]
    assert run_cli(main, argv) == EXIT_CONFIG
    assert capsys.readouterr().err.strip() == "error: --max-instances (1) must be at least --min-instances (3)"


@pytest.fixture
def create_model_refuses_existing(monkeypatch: pytest.MonkeyPatch) -> None:
    """SageMaker refuses to create a model whose name exists ("Cannot create already existing model"); moto 5.2.5
    replaces it silently. This makes SDK v3's Model.create answer as SageMaker does."""
    from sagemaker.core.resources import Model

    original = Model.create.__func__  # type: ignore[attr-defined]

    def create(cls: Any, model_name: str, **kwargs: Any) -> Any:
        if any(m["ModelName"] == model_name for m in boto3.client("sagemaker").list_models()["Models"]):
            message = (
                f'Cannot create already existing model "arn:aws:sagemaker:us-east-1:123456789012:model/{model_name}".'
            )
            raise botocore.exceptions.ClientError(
                {"Error": {"Code": "ValidationException", "Message": message}}, "CreateModel"
            )
        return original(cls, model_name=model_name, **kwargs)

    monkeypatch.setattr(Model, "create", classmethod(create))


def _deploy_then_delete_keeping_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert _deploy("--role", ROLE_ARN) == EXIT_OK
    assert run_cli(main, ["delete", "--endpoint-name", "mme-gpu", "--keep-model"]) == EXIT_OK
    capsys.readouterr()  # what the later deploy prints is what the tests read


def test_deploy_again_after_delete_keep_model_reuses_the_model(
    archives: dict[str, Any], create_model_refuses_existing: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _deploy_then_delete_keeping_the_model(capsys)

    assert _deploy("--role", ROLE_ARN) == EXIT_OK

    assert "using the existing model mme-gpu" in capsys.readouterr().out
    sm = boto3.client("sagemaker")
    assert [m["ModelName"] for m in sm.list_models()["Models"]] == ["mme-gpu"]
    assert sm.describe_endpoint(EndpointName="mme-gpu")["EndpointStatus"] == "InService"


def test_deploy_over_a_different_model_of_that_name_exits_2_before_any_endpoint(
    archives: dict[str, Any], create_model_refuses_existing: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _deploy_then_delete_keeping_the_model(capsys)

    assert _deploy("--role", ROLE_ARN, "--env", "SAGEMAKER_MODEL_SERVER_WORKERS=4") == EXIT_CONFIG

    assert "model 'mme-gpu' exists with another image, prefix or environment" in capsys.readouterr().err
    assert boto3.client("sagemaker").list_endpoints()["Endpoints"] == []
