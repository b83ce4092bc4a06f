"""The base every layer stands on: ``config`` (read from the environment, as ``settings`` and ``model_settings`` list
and ``parsing`` reads; ``config_page`` documents it), ``errors`` and ``failures`` (what went wrong, in words),
``logs``, ``locks``, ``devices``, ``nvidia``, ``child_processes`` and ``janitor``. It imports no other layer, and
never torch.
"""
