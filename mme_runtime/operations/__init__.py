"""What an operator watches and the container adjusts: ``metrics`` recorded by every model process
(through ``metric_series``) and merged by ``metrics_exporter`` for Prometheus and by
``cloudwatch_metrics`` for CloudWatch, ``memory`` checks before a LOAD, and the ``scaler`` that
gives batching models their workers.
It may import: ``base``.
"""
