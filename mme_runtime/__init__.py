"""Internals of the mme-gpu container, in six layers; a layer imports only the layers before it:

* ``base``: configuration, errors, logs, devices, process plumbing.
* ``operations``: metrics and their endpoint, memory checks, worker scaling.
* ``models``: a model's artifacts, its code and its settings, loaded, packed and cached.
* ``serving``: one request from the socket to ``predict_fn`` and back.
* ``huggingface``: Hugging Face directories served with no code, as defaults of ``serving``.
* ``processes``: the process tree, from the entrypoint's supervisor to the device hosts.

``handler_service.py`` and ``inference_handler.py`` (the handler MMS names, with its PyTorch
defaults; it registers the Hugging Face ones) sit between ``huggingface`` and ``processes``.
Importing any of it never initialises CUDA: model processes are forked after it.
"""
