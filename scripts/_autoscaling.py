"""Endpoint autoscaling for deploy_mme.py: Application Auto Scaling on the endpoint's production
variant.

A multi-model endpoint grows by instances: SageMaker routes each TargetModel to an instance that
holds it (loading it there on first use), so more instances spread both the models and the requests.
The scalable target bounds the variant's instance count; a target-tracking policy on
SageMakerVariantInvocationsPerInstance adds instances when each takes more than the target number of
invocations per minute, and removes them when load falls.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from _aws_cli import config_error
from botocore.client import BaseClient

NAMESPACE = "sagemaker"
DIMENSION = "sagemaker:variant:DesiredInstanceCount"
METRIC = "SageMakerVariantInvocationsPerInstance"


@dataclass(frozen=True)
class Scaling:
    """What the variant may scale between, and on what: invocations per instance per minute (None:
    bounds only)."""

    min_instances: int
    max_instances: int
    target_invocations: float | None = None
    scale_in_cooldown: int = 300
    scale_out_cooldown: int = 60

    def __post_init__(self) -> None:
        if self.min_instances < 1:
            raise config_error(f"--min-instances must be at least 1, not {self.min_instances}")
        if self.max_instances < self.min_instances:
            raise config_error(
                f"--max-instances ({self.max_instances}) must be at least --min-instances "
                f"({self.min_instances})"
            )
        if self.target_invocations is not None and not self.target_invocations > 0:
            raise config_error(
                f"--target-invocations-per-instance must be above 0, not {self.target_invocations}"
            )
        if min(self.scale_in_cooldown, self.scale_out_cooldown) < 0:
            raise config_error(
                "--scale-in-cooldown and --scale-out-cooldown must be at least 0 seconds"
            )


def add_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    """The scaling options of ``deploy`` (all optional: no autoscaling without them) and
    ``scale``."""
    parser.add_argument("--min-instances", type=int, required=required, help="fewest instances")
    parser.add_argument("--max-instances", type=int, required=required, help="most instances")
    parser.add_argument(
        "--target-invocations-per-instance",
        type=float,
        help="invocations per instance per minute to keep each instance at (target tracking)",
    )
    parser.add_argument(
        "--scale-in-cooldown", type=int, default=300, help="seconds between removals (%(default)s)"
    )
    parser.add_argument(
        "--scale-out-cooldown", type=int, default=60, help="seconds between additions (%(default)s)"
    )


def from_arguments(args: argparse.Namespace, default_min: int) -> Scaling | None:
    """The scaling ``args`` ask for; None when they ask for none (``deploy`` without scaling
    options)."""
    if (
        args.max_instances is None
        and args.target_invocations_per_instance is None
        and args.min_instances is None
    ):
        return None
    if args.max_instances is None:
        raise config_error("autoscaling needs --max-instances")
    return Scaling(
        args.min_instances if args.min_instances is not None else default_min,
        args.max_instances,
        args.target_invocations_per_instance,
        args.scale_in_cooldown,
        args.scale_out_cooldown,
    )


def resource_id(endpoint: str, variant: str) -> str:
    return f"endpoint/{endpoint}/variant/{variant}"


def policy_name(endpoint: str) -> str:
    return f"{endpoint}-invocations-per-instance"


def variant_of(endpoint: dict[str, Any]) -> str:
    """The (first) production variant of a DescribeEndpoint answer: it holds the endpoint's
    instances."""
    variants = endpoint.get("ProductionVariants") or []
    if not variants:
        raise config_error(
            f"endpoint {endpoint['EndpointName']!r} has no production variant to scale"
        )
    return str(variants[0]["VariantName"])


def apply(autoscaling: BaseClient, endpoint: str, variant: str, scaling: Scaling) -> list[str]:
    """Registers (or updates) the scalable target and, with a target, the tracking policy; returns
    what was set."""
    resource = resource_id(endpoint, variant)
    autoscaling.register_scalable_target(
        ServiceNamespace=NAMESPACE,
        ResourceId=resource,
        ScalableDimension=DIMENSION,
        MinCapacity=scaling.min_instances,
        MaxCapacity=scaling.max_instances,
    )
    done = [
        f"scalable target {resource}: {scaling.min_instances} to {scaling.max_instances} instances"
    ]
    if scaling.target_invocations is not None:
        autoscaling.put_scaling_policy(
            PolicyName=policy_name(endpoint),
            ServiceNamespace=NAMESPACE,
            ResourceId=resource,
            ScalableDimension=DIMENSION,
            PolicyType="TargetTrackingScaling",
            TargetTrackingScalingPolicyConfiguration={
                "TargetValue": scaling.target_invocations,
                "PredefinedMetricSpecification": {"PredefinedMetricType": METRIC},
                "ScaleInCooldown": scaling.scale_in_cooldown,
                "ScaleOutCooldown": scaling.scale_out_cooldown,
            },
        )
        done.append(
            f"policy {policy_name(endpoint)}: {scaling.target_invocations:g} invocations per "
            "instance"
        )
    return done


def remove(autoscaling: BaseClient, endpoint: str, variant: str) -> list[str]:
    """Removes the endpoint's policies and its scalable target, whichever exist; returns what was
    removed."""
    resource = resource_id(endpoint, variant)
    removed = []
    policies = autoscaling.describe_scaling_policies(
        ServiceNamespace=NAMESPACE, ResourceId=resource
    )
    for policy in policies.get("ScalingPolicies", []):
        autoscaling.delete_scaling_policy(
            PolicyName=policy["PolicyName"],
            ServiceNamespace=NAMESPACE,
            ResourceId=resource,
            ScalableDimension=DIMENSION,
        )
        removed.append(f"scaling policy {policy['PolicyName']}")
    targets = autoscaling.describe_scalable_targets(
        ServiceNamespace=NAMESPACE, ResourceIds=[resource], ScalableDimension=DIMENSION
    )
    if targets.get("ScalableTargets"):
        autoscaling.deregister_scalable_target(
            ServiceNamespace=NAMESPACE, ResourceId=resource, ScalableDimension=DIMENSION
        )
        removed.append(f"scalable target {resource}")
    return removed
