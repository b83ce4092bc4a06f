"""One request, from the socket to ``predict_fn`` and back, in reading order: ``connection`` (MMS's
messages on a frontend connection, answered through ``handler_service.py``; a batching model's
connections opened as its requests overlap), ``served_model`` (the model's contract from LOAD to
UNLOAD, and each message's requests through it), ``contract`` (the user's functions over the
defaults, the ``context`` they receive, and the defaults other packages register: a Hugging Face
directory's, ``mme_runtime.huggingface``), ``batcher`` (one forward pass for many requests;
``pass_threads`` runs a GPU's passes on a few threads), ``content`` (codecs, statuses and error
bodies) and ``placement`` (the model on its device, compiled for it if asked).
It may import: ``base``, ``operations``, ``models``.
"""
