"""Hugging Face ``save_pretrained`` directories served with no code, as the AWS Hugging Face
container serves them: registered with the serving core as the defaults of such a directory.

``defaults`` is the contract they are served with; its ``register`` offers it to
``serving/contract.py`` and tells ``models/package_cache.py`` which files hold a base's weights
(``handler_service.py`` calls it when imported, in every process that loads a model). ``loading``
loads a directory for its task; ``requests`` reads the AWS container's requests and writes its
answers; ``tasks`` runs a batch through the task's pipeline, with ``question_answering``,
``zero_shot``, ``tables``, ``vision`` and ``sentences`` for those tasks and ``audio`` for speech;
generative tasks go through ``generation`` (each input made ready by ``prompts``), ``scheduler``,
``decoding`` (a beam search's rows picked by ``beams``) and ``kv_cache``.
It may import: ``base``, ``operations``, ``models``, ``serving``.
"""
