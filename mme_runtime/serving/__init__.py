"""One request, from the socket to ``predict_fn`` and back, in reading order: ``connection`` (MMS's messages on a
frontend connection, answered through ``handler_service.py``; ``connection_demand`` opens a batching model's
connections as its requests overlap), ``transformer`` (the model's lifecycle), ``pipeline`` (each request through
the contract), ``contract`` (the user's functions over the defaults), ``batcher`` and ``collate`` (one forward pass
for many requests; ``pass_threads`` runs a GPU's passes on a few threads), ``responses`` (statuses and error
bodies), ``content`` (codecs), ``context`` (what user functions receive) and ``placement`` (the model on its
device). Defaults other than the PyTorch ones are registered with ``transformer`` by the
package that brings them (``mme_runtime.huggingface``, for a Hugging Face directory).
It may import: ``base``, ``operations``, ``models``.
"""
