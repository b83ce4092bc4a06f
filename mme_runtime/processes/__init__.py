"""The process tree, from the top: the entrypoint's ``supervisor`` starts MMS (``frontend``); MMS
starts a stub per model (``warm_stub``), which hands its model to the ``warm_start`` process over
``warm_protocol``. Every model (``shared_models``) is loaded once by a ``model_loader`` and served
by the ``device_hosts``, keyed by device and tenant: a ``device_host`` per device for the models
that share, and one per device for each model that needs isolation; a ``crash_board`` names whose
code killed a host.
It may import: ``base``, ``operations``, ``models``, ``serving``, ``huggingface``.
"""
