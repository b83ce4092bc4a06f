"""The process tree, from the top: the entrypoint's ``supervisor`` starts MMS (``frontend``); MMS starts a stub per
model (``warm_stub``), which hands its model to the ``warm_start`` process over ``warm_protocol``. A shareable model
(``shared_models``, ``shared_model``) is loaded once by a ``model_loader`` and served by the ``device_hosts``: one
``device_host`` per device, each model in it a ``hosted_model``, with a ``crash_board`` naming whose code killed a
host. An isolated model gets a ``backend`` server whose ``executor_pool`` forks an ``executor`` per device, after
``fork_safety`` checks.
It may import: ``base``, ``operations``, ``models``, ``serving``, ``huggingface``.
"""
