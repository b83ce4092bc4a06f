"""The process tree, from the top: the entrypoint's ``supervisor`` starts MMS (``frontend``); MMS
starts a stub per model (``warm_stub``), which hands its model to the ``warm_start`` process over
``warm_protocol``. Every model (``shared_models``, each a ``shared_model``) is loaded once by a
``model_loader`` and served by the ``device_hosts``, keyed by device and tenant: a ``device_host``
per device for the models that share (each there a ``hosted_model``, let go in turn by its
``host_unloads``), and one per device for each model that needs isolation; a ``crash_board`` names
whose code killed a host, and a CPU host that UNLOADs drained moves what it has left to a fresh one
(``host_recycling``). What the JDK's launcher left in the kernel for each stub is freed at the
lowest priority (``launcher_entries``).
It may import: ``base``, ``operations``, ``models``, ``serving``, ``huggingface``.
"""
