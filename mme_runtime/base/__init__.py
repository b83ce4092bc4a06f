"""The base every layer stands on: ``config`` (read from the environment, as ``settings`` lists and
documents it and ``parsing`` reads), ``errors`` and ``failures`` (what went wrong, in words),
``logs``, ``locks``, ``devices``, ``nvidia``, ``child_processes`` (the one place processes are
made), ``descriptor_table`` and ``janitor``. It imports no other layer.
"""
