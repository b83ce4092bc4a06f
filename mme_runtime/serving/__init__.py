"""One request, from the socket to ``predict_fn`` and back, in reading order: ``connection`` (MMS's messages on a
frontend connection, answered through ``handler_service.py``; a batching model's connections opened as its requests
overlap), ``transformer`` (the model's lifecycle), ``pipeline`` (each request through
the contract), ``contract`` (the user's functions over the defaults), ``batcher`` (one forward pass
for many requests; ``pass_threads`` runs a GPU's passes on a few threads), ``content`` (codecs, statuses and
error bodies), ``context`` (what user functions receive) and ``placement`` (the model on its
device). Defaults other than the PyTorch ones are registered with ``transformer`` by the
package that brings them (``mme_runtime.huggingface``, for a Hugging Face directory).
It may import: ``base``, ``operations``, ``models``.
"""
