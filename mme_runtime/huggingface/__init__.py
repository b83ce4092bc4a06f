"""Hugging Face ``save_pretrained`` directories served with no code, as the AWS Hugging Face container serves them.

``defaults`` is the contract they are served with; ``register`` offers it to ``serving/transformer.py`` for the
directories it serves (the handler calls it, in every process that loads a model). ``loading`` loads a directory for
its task, speech models' included. ``requests`` reads the AWS container's request and writes its answer (JSON, CSV,
images, NPY and audio bodies); ``tasks`` runs a batch through the task's pipeline (rows padded together, a tokenizer
lent a step at a time), with ``question_answering``, ``zero_shot``, ``tables``, ``vision`` and ``sentences`` for
their tasks. Generative tasks go through ``generation``, ``scheduler`` and ``decoding``; speech tasks through
``audio``.
It may import: ``base``, ``operations``, ``models``, ``serving``.
"""
