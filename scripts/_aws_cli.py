"""What the AWS helper scripts share: exit codes, one error type, S3 URIs, and the turn of AWS
errors into one line.

Only ``run_cli`` prints errors or picks exit codes; the functions the scripts import for tests raise
instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import boto3
import botocore.exceptions

# Exit codes, as the container's entrypoint names them: 2 is also what argparse uses for a bad
# command line, so "fix your setup or your arguments" is one code, and "AWS or docker said no" is
# another.
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2

NO_CREDENTIALS_MESSAGE = (
    "no AWS credentials found: run `aws configure`, set AWS_PROFILE, or export AWS_ACCESS_KEY_ID "
    "and AWS_SECRET_ACCESS_KEY"
)
NO_REGION_MESSAGE = "no AWS region: pass --region or set AWS_DEFAULT_REGION"


class ScriptError(Exception):
    """A failure the user can act on; ``run_cli`` prints the message alone, without a traceback."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def config_error(message: str) -> ScriptError:
    """A missing or wrong setting (credentials, role, region, a local file): exit code 2."""
    return ScriptError(message, EXIT_CONFIG)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Splits ``s3://bucket/key`` into bucket and key (the key may be empty or end with '/')."""
    if not uri.startswith("s3://"):
        raise config_error(f"not an S3 URI (expected s3://bucket/prefix/): {uri!r}")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket:
        raise config_error(f"S3 URI has no bucket: {uri!r}")
    return bucket, key


def aws_error_code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def aws_error_message(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message", ""))


def boto_session(region: str | None) -> boto3.Session:
    """A session for ``region``, or for the default chain's region; raises early when there is
    none."""
    session = boto3.Session(region_name=region)
    if not session.region_name:
        raise config_error(NO_REGION_MESSAGE)
    return session


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Runs a script's ``main`` and turns the errors people meet every day into one line on stderr.

    Anything else keeps its traceback: it is a bug in the script, and the traceback is how we find
    it.
    """
    try:
        return main(argv)
    except ScriptError as exc:
        message, code = str(exc), exc.exit_code
    except botocore.exceptions.NoCredentialsError:
        message, code = NO_CREDENTIALS_MESSAGE, EXIT_CONFIG
    except botocore.exceptions.NoRegionError:
        message, code = NO_REGION_MESSAGE, EXIT_CONFIG
    except botocore.exceptions.ClientError as exc:
        operation = getattr(exc, "operation_name", "request")
        message, code = (
            f"AWS {operation} failed: {aws_error_code(exc)}: {aws_error_message(exc)}",
            EXIT_FAILURE,
        )
    except botocore.exceptions.BotoCoreError as exc:
        # Endpoint unreachable, expired SSO session, unreadable config file: botocore's own text
        # says which.
        message, code = f"AWS call failed: {exc}", EXIT_FAILURE
    except KeyboardInterrupt:
        message, code = "interrupted", 130
    print(f"error: {message}", file=sys.stderr)
    return code
